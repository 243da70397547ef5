"""Names a client makes up: kept, exported and logged only in bounded bytes.

A model name or a response id is the client's own text, as long as the body
allows (32 MiB by default). Whatever the router keeps of such names (the
unserved-demand tally, its metric label, the status document, the access log,
the responses memory) must be bounded in bytes, not only in entries: a
hundred names of a megabyte each must not cost a hundred megabytes.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import get_json, samples, scrape
from tests.support.waiting import tick, wait_for
from tests.support.wire import CHAT, Exchange, StartRaw, Wire, json_answer, post


def _asking_for(model: str) -> bytes:
    return post(orjson.dumps({**CHAT, "model": model}))


async def test_long_or_unprintable_model_names_are_tallied_as_other_and_never_exported(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], tick_seconds=0.05)
    long_names = [f"{i:03d}" + "x" * 65536 for i in range(12)]
    unprintable = ["evil\x1b[2J", "line\nbreak"]
    async with await Wire.open(server.client_address) as wire:
        for name in [*long_names, *unprintable, "nope", "nope"]:
            wire.send(_asking_for(name))
            answer = await wire.answer()
            assert answer.status == 404
            # The message quotes enough of the name to recognise it, not all of it.
            assert len(answer.body) < 1024
    # The tally reaches /metrics at the next tick.
    await tick(server)
    text = await scrape(server)
    assert samples(text, "router_unserved_requests_total") == {
        (("model", "__other__"),): len(long_names) + len(unprintable),
        (("model", "nope"),): 2,
    }
    assert len(text) < 64 * 1024
    status = await get_json(f"{server.admin_url}/api/v1/status")
    assert status["unserved"] == {"__other__": len(long_names) + len(unprintable), "nope": 2}


async def test_the_access_log_keeps_a_recognisable_piece_of_a_huge_model_name(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake = await start_fake("m")
    log = tmp_path / "access.log"
    server = await start_router([replica_entry("r0", fake)], access_log=str(log))
    name = "huge-" + "y" * (1 << 20)
    async with await Wire.open(server.client_address) as wire:
        wire.send(_asking_for(name))
        assert (await wire.answer()).status == 404
    await wait_for(lambda: log.exists() and log.read_bytes().endswith(b"\n"))
    (line,) = log.read_bytes().splitlines()
    assert len(line) < 2048
    entry = orjson.loads(line)
    assert entry["model"].startswith("huge-yyy")
    assert entry["model"].endswith(f"({len(name)} characters)")


async def test_a_response_id_past_any_engines_length_is_not_remembered(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    huge_id = "resp_" + "z" * 100_000

    async def answer(exchange: Exchange) -> None:
        body = orjson.dumps({"id": huge_id, "object": "response", "output": []})
        exchange.writer.write(json_answer(body))
        await exchange.writer.drain()

    replica = await start_raw(answer)
    server = await start_router([{"id": "r0", "model": "m", "url": replica.url}])
    request = {"model": "m", "input": "hi"}
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(orjson.dumps(request), path=b"/v1/responses"))
        first = await wire.answer()
        assert first.status == 200 and first.json()["id"] == huge_id
        wire.send(post(orjson.dumps({**request, "previous_response_id": huge_id}), path=b"/v1/responses"))
        follow_up = await wire.answer()
    # Never seen, as far as the router can say: the same answer as an id it never passed.
    assert follow_up.status == 404
    assert follow_up.json()["error"]["code"] == "response_not_found"  # type: ignore[index]
    assert len(follow_up.body) < 1024
    assert len(replica.requests) == 1
