"""Tokens counted from every answer through a router: /metrics, the access log, /api/v1/status; the bytes untouched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.run.app import RouterServer
from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import access_log_lines, get_json, samples, scrape
from tests.support.waiting import wait_for

KEYS = {"alpha": {"key": "sk-alpha", "tenant": "a"}, "beta": {"key": "sk-beta", "tenant": "b"}}
Samples = dict[tuple[tuple[str, str], ...], float]


def chat(*, stream: bool = False, usage: bool = False, content: str = "hi", max_tokens: int = 16) -> bytes:
    doc: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    if stream:
        doc["stream"] = True
    if usage:
        doc["stream_options"] = {"include_usage": True}
    return orjson.dumps(doc)


async def send(server: RouterServer, body: bytes, key: str = "sk-alpha") -> bytes:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    url = server.client_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


async def scraped(server: RouterServer, name: str, ready: Callable[[Samples], bool]) -> Samples:
    """`name`'s samples from /metrics once `ready` says they are (the tallies reach it at the next tick)."""
    for _ in range(500):
        found = samples(await scrape(server), name)
        if ready(found):
            return found
        # A poll of /metrics, which the tallies reach at the usage tick (real time).
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} never got there: {found}")


def label(tenant: str, kind: str, model: str = "m") -> tuple[tuple[str, str], ...]:
    return (("kind", kind), ("model", model), ("tenant", tenant))


def unknown(tenant: str, model: str = "m") -> tuple[tuple[str, str], ...]:
    return (("model", model), ("tenant", tenant))


async def router_with(start_fake: StartFake, start_router: StartRouter, tmp_path: Path, **behaviour: Any) -> Any:
    fake = await start_fake("m", behaviour=Behaviour(**behaviour))
    server = await start_router(
        [replica_entry("r0", fake)],
        api_keys=KEYS,
        tick_seconds=0.05,
        access_log=str(tmp_path / "access.log"),
        count_tokens=True,
    )
    return fake, server


async def test_whole_answers_and_streams_asking_for_usage_count_per_tenant_and_kind(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    _, server = await router_with(start_fake, start_router, tmp_path, tokens=16)
    await send(server, chat())
    await send(server, chat(stream=True, usage=True, max_tokens=5), key="sk-beta")
    found = await scraped(server, "router_tokens_total", lambda s: s.get(label("b", "completion")) == 5)
    # The fake counts 4 prompt tokens without a prefix cache, and says nothing of its cache.
    assert found == {
        label("a", "prompt"): 4,
        label("a", "cached"): 0,
        label("a", "completion"): 16,
        label("b", "prompt"): 4,
        label("b", "cached"): 0,
        label("b", "completion"): 5,
    }
    await wait_for(lambda: len(access_log_lines(tmp_path / "access.log")) == 2)
    lines = access_log_lines(tmp_path / "access.log")
    assert [(x["tenant"], x["prompt_tokens"], x["completion_tokens"], x["cached_tokens"]) for x in lines] == [
        ("a", 4, 16, None),
        ("b", 4, 5, None),
    ]


async def test_cached_tokens_come_from_the_engines_prefix_cache_report(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake, server = await router_with(start_fake, start_router, tmp_path, prefix_cache_blocks=64, cache_block_chars=16)
    prompt = "a long shared system prompt, the same each time " * 4
    await send(server, chat(content=prompt))
    await send(server, chat(content=prompt))
    found = await scraped(server, "router_tokens_total", lambda s: s.get(label("a", "completion")) == 32)
    # What the engine counted, as it said it in each answer's usage.
    assert found[label("a", "prompt")] == fake.prompt_tokens
    assert found[label("a", "cached")] == fake.cached_tokens > 0
    await wait_for(lambda: len(access_log_lines(tmp_path / "access.log")) == 2)
    first, second = access_log_lines(tmp_path / "access.log")
    assert first["cached_tokens"] is None
    assert second["cached_tokens"] == found[label("a", "cached")]


async def test_a_stream_that_did_not_ask_for_usage_is_unknown_and_gets_no_usage_chunk(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake, server = await router_with(start_fake, start_router, tmp_path, tokens=3)
    body = await send(server, chat(stream=True))
    assert b'"usage"' not in body
    assert body.endswith(b"data: [DONE]\n\n")
    # The replica got the client's bytes: the router asked nothing on its behalf.
    assert fake.seen[-1].body == chat(stream=True)
    found = await scraped(server, "router_tokens_unknown_requests_total", lambda s: s.get(unknown("a")) == 1)
    assert found == {unknown("a"): 1}
    assert samples(await scrape(server), "router_tokens_total") == {}
    await wait_for(lambda: len(access_log_lines(tmp_path / "access.log")) == 1)
    (line,) = access_log_lines(tmp_path / "access.log")
    assert (line["prompt_tokens"], line["completion_tokens"], line["cached_tokens"]) == (None, None, None)


async def test_a_replica_that_volunteers_usage_has_its_unasked_streams_counted(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    _, server = await router_with(start_fake, start_router, tmp_path, tokens=3, force_include_usage=True)
    for _ in range(3):
        body = await send(server, chat(stream=True))
        # The engine's usage chunk, as it sent it: the router neither asked for it nor removes it.
        assert b'"usage":{"prompt_tokens":4,"completion_tokens":3' in body
    found = await scraped(server, "router_tokens_total", lambda s: s.get(label("a", "completion")) == 9)
    assert found[label("a", "prompt")] == 12
    assert samples(await scrape(server), "router_tokens_unknown_requests_total") == {}


async def test_a_replica_not_seen_to_volunteer_usage_has_one_unasked_stream_in_64_searched(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake, server = await router_with(start_fake, start_router, tmp_path, tokens=3)
    # The first unasked stream is searched and has nothing: unknown.
    await send(server, chat(stream=True))
    # Its engine starts volunteering usage: the next 63 unasked streams are not searched, so they
    # stay unknown although they carry it; the 64th after the first is searched and finds it, and
    # from then on every unasked stream of the replica is read.
    fake.behaviour.force_include_usage = True
    for _ in range(63):
        assert b'"usage":{' in await send(server, chat(stream=True))
    await send(server, chat(stream=True))
    await send(server, chat(stream=True))
    # A stream that asks is read whatever the replica was seen to do.
    await send(server, chat(stream=True, usage=True))
    found = await scraped(server, "router_tokens_total", lambda s: s.get(label("a", "completion")) == 9)
    assert found[label("a", "completion")] == 9
    assert samples(await scrape(server), "router_tokens_unknown_requests_total") == {unknown("a"): 64}


USAGE = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n'
)
CONTENT = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'


async def test_a_usage_chunk_split_across_reads_is_read_and_every_byte_passes_as_sent(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    pieces = [CONTENT, USAGE[:90], USAGE[90:] + b"data: [DONE]\n\n"]
    fake, server = await router_with(start_fake, start_router, tmp_path, raw_stream=pieces)
    assert await send(server, chat(stream=True, usage=True)) == b"".join(pieces)
    # [DONE] in a read of its own, as vLLM writes it.
    fake.behaviour.raw_stream = pieces = [CONTENT, USAGE, b"data: [DONE]\n\n"]
    assert await send(server, chat(stream=True, usage=True)) == b"".join(pieces)
    found = await scraped(server, "router_tokens_total", lambda s: s.get(label("a", "completion")) == 4)
    assert found[label("a", "prompt")] == 14
    # Split over more reads than the tail keeps (unless the network joined some): read whole, or
    # unknown, never a guess from a part.
    fake.behaviour.raw_stream = pieces = [CONTENT, USAGE[:40], USAGE[40:90], USAGE[90:], b"data: [DONE]\n\n"]
    assert await send(server, chat(stream=True, usage=True)) == b"".join(pieces)
    await wait_for(lambda: len(access_log_lines(tmp_path / "access.log")) == 3)
    last = access_log_lines(tmp_path / "access.log")[-1]
    assert (last["prompt_tokens"], last["completion_tokens"]) in {(7, 2), (None, None)}


async def test_hostile_usage_is_unknown_never_a_500_nor_a_changed_byte(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    hostile = [
        b'data: {"choices":[],"usage":{"prompt_tokens":"7","completion_tokens":2}}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7.5,"completion_tokens":-2}}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7,' + b" " * 70_000 + b'"completion_tokens":2}}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2\n\n',
        b'data: {"choices":[],"usage":{{{{{[[[\xff\xfe}}}\n\n',
        b'data: {"choices":[],"usage":' + b'{"a":' * 500 + b"1" + b"}" * 500 + b"}\n\n",
    ]
    fake, server = await router_with(start_fake, start_router, tmp_path)
    for event in hostile:
        fake.behaviour.raw_stream = pieces = [CONTENT, event, b"data: [DONE]\n\n"]
        assert await send(server, chat(stream=True, usage=True)) == b"".join(pieces)
    found = await scraped(server, "router_tokens_unknown_requests_total", lambda s: s.get(unknown("a")) == 6)
    assert found == {unknown("a"): 6}
    assert samples(await scrape(server), "router_tokens_total") == {}


async def test_a_whole_answer_with_garbage_usage_passes_untouched_and_is_unknown(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    garbage = b'{"id":"x","choices":[],"usage":{"prompt_tokens":1e400,"completion_tokens":[1]}}'
    _, server = await router_with(start_fake, start_router, tmp_path, fail_status=200, fail_body=garbage)
    assert await send(server, chat()) == garbage
    found = await scraped(server, "router_tokens_unknown_requests_total", lambda s: s.get(unknown("a")) == 1)
    assert found == {unknown("a"): 1}


async def test_streams_observe_time_to_first_token_and_per_output_token(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    _, server = await router_with(start_fake, start_router, tmp_path, token_delay=0.01, first_token_delay=0.05)
    await send(server, chat(stream=True, usage=True, max_tokens=6))
    await send(server, chat(stream=True, max_tokens=6))
    text = await scrape(server)
    first = samples(text, "router_time_to_first_token_seconds_count")
    per_token = samples(text, "router_time_per_output_token_seconds_count")
    # Both streams had a first token; only the one that said its tokens gives a time per token.
    assert first == {(("model", "m"),): 2}
    assert per_token == {(("model", "m"),): 1}
    assert samples(text, "router_time_to_first_token_seconds_sum")[(("model", "m"),)] >= 2 * 0.05
    mean = samples(text, "router_time_per_output_token_seconds_sum")[(("model", "m"),)]
    assert 0.005 <= mean < 1.0


async def test_status_shows_each_tenants_tokens_and_unknown_answers(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    _, server = await router_with(start_fake, start_router, tmp_path, tokens=16)
    await send(server, chat())
    await send(server, chat(stream=True), key="sk-beta")
    await scraped(server, "router_tokens_unknown_requests_total", lambda s: s.get(unknown("b")) == 1)
    status = await get_json(server.admin_url + "/api/v1/status")
    assert status["tenants"] == [
        {"tenant": "a", "prompt_tokens": 4, "cached_tokens": 0, "completion_tokens": 16, "unknown_requests": 0},
        {"tenant": "b", "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "unknown_requests": 1},
    ]


async def test_nothing_is_read_nor_counted_unless_count_tokens_is_on(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], tick_seconds=0.05, access_log=str(tmp_path / "a.log"))
    await send(server, chat())
    await send(server, chat(stream=True, usage=True))
    await wait_for(lambda: len(access_log_lines(tmp_path / "a.log")) == 2)
    assert {line["prompt_tokens"] for line in access_log_lines(tmp_path / "a.log")} == {None}
    await wait_for(lambda: server.latest.snapshot is not None and server.latest.snapshot.generated_at > 0)
    text = await scrape(server)
    assert samples(text, "router_tokens_total") == {}
    assert samples(text, "router_tokens_unknown_requests_total") == {}
    assert samples(text, "router_time_to_first_token_seconds_count") == {}


async def test_a_stored_response_read_again_is_not_counted_a_second_time(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    _, server = await router_with(start_fake, start_router, tmp_path, tokens=3)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-alpha"}
    async with aiohttp.ClientSession(headers=headers) as session:
        body = orjson.dumps({"model": "m", "input": "hi", "max_output_tokens": 3})
        async with session.post(server.client_url + "/v1/responses", data=body) as resp:
            assert resp.status == 200
            made = await resp.json()
        async with session.get(server.client_url + f"/v1/responses/{made['id']}") as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["output_tokens"] == 3
    await wait_for(lambda: len(access_log_lines(tmp_path / "access.log")) == 2)
    # Both requests have ended: the tallies they wrote are whole.
    assert server.pool.tallies.token_counts() == {
        ("m", "a", "prompt"): 4,
        ("m", "a", "cached"): 0,
        ("m", "a", "completion"): 3,
    }
    assert server.pool.tallies.unknown_counts() == {}
    made_line, read_line = access_log_lines(tmp_path / "access.log")
    assert (made_line["prompt_tokens"], made_line["completion_tokens"]) == (4, 3)
    assert (read_line["prompt_tokens"], read_line["completion_tokens"]) == (None, None)
