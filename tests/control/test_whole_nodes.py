"""Whole nodes, per fabric, through `router serve`: replicas pushed with their node and fabric, used, drained.

`GET /api/v1/status`'s `fabrics` and `router ctl status`'s table say which
whole nodes could be freed now; one process and `--workers 2` alike.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from router.tools.fake import FakeReplica
from tests.conftest import StartFake
from tests.support.clients import run_ctl
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for

pytestmark = pytest.mark.slow


def entry(rid: str, fake: FakeReplica, gpus: int, node: str | None = None, fabric: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": rid, "model": fake.models[0], "url": fake.url, "labels": {"gpus": gpus}}
    if node is not None:
        doc["node"] = node
    if fabric is not None:
        doc["fabric"] = fabric
    return doc


async def push(session: aiohttp.ClientSession, serve: Serve, replicas: list[dict[str, Any]]) -> tuple[int, Any]:
    async with session.put(serve.admin_url + "/api/v1/endpoints", json={"replicas": replicas}) as resp:
        return resp.status, await resp.json()


async def status(session: aiohttp.ClientSession, serve: Serve, idle_for: float) -> Any:
    async with session.get(serve.admin_url + f"/api/v1/status?idle_for={idle_for:g}") as resp:
        assert resp.status == 200
        return await resp.json()


def free(doc: Any) -> dict[str | None, list[tuple[str, int, list[str]]]]:
    """Per fabric, its free whole nodes: (node, GPUs, replicas)."""
    return {f["fabric"]: [(n["node"], n["gpus"], n["replicas"]) for n in f["free_nodes"]] for f in doc["fabrics"]}


async def ask(serve: Serve, model: str) -> Any:
    async with openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key="x", max_retries=0) as client:
        return await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one-process", "workers"])
async def test_pushed_nodes_and_fabrics_give_the_whole_nodes_that_could_be_freed(
    serve: Serve, start_fake: StartFake, workers: tuple[str, ...]
) -> None:
    f = {name: await start_fake(name) for name in ("m1", "m2", "m3", "m4", "m5")}
    serve.write([])
    await serve.start(*workers)
    replicas = [
        entry("r1", f["m1"], 4, "n1", "ib-a"),
        entry("r2", f["m2"], 4, "n1", "ib-a"),
        entry("r3", f["m3"], 8, "n2", "ib-a"),
        # Never asked for: unknown, so its node is never free.
        entry("r4", f["m4"], 8, "n3", "ib-b"),
        # No node: counted apart.
        entry("r5", f["m5"], 2),
    ]
    async with aiohttp.ClientSession() as session:
        assert (await push(session, serve, replicas))[0] == 200
        for model in ("m1", "m2", "m3", "m5"):
            await ask(serve, model)
        doc = await status(session, serve, 0)
        assert free(doc) == {"ib-a": [("n1", 8, ["r1", "r2"]), ("n2", 8, ["r3"])], "ib-b": []}
        assert [(x["fabric"], x["nodes"], x["gpus"], x["free_gpus"]) for x in doc["fabrics"]] == [
            ("ib-a", 2, 16, 16),
            ("ib-b", 1, 8, 0),
        ]
        assert doc["no_node"] == {"replicas": 1, "gpus": 2}
        assert doc["node_conflicts"] == []
        rows = {
            r["id"]: (r["node"], r["fabric"])
            for r in await (await session.get(serve.admin_url + "/api/v1/replicas")).json()
        }
        assert rows == {
            "r1": ("n1", "ib-a"),
            "r2": ("n1", "ib-a"),
            "r3": ("n2", "ib-a"),
            "r4": ("n3", "ib-b"),
            "r5": (None, None),
        }
        # A request in flight on r3 holds n2 back.
        f["m3"].behaviour.stall = True
        in_flight = asyncio.create_task(ask(serve, "m3"))
        await wait_for(lambda: len(f["m3"].seen) == 2, timeout=20)
        assert free(await status(session, serve, 0))["ib-a"] == [("n1", 8, ["r1", "r2"])]
        in_flight.cancel()
        await asyncio.gather(in_flight, return_exceptions=True)
        f["m3"].behaviour.stall = False

        # Used a moment ago, so not idle for an hour: no node is free, until its replicas are drained.
        hour = await status(session, serve, 3600)
        assert free(hour)["ib-a"] == []
        for rid in ("r1", "r2", "r4"):
            async with session.post(serve.admin_url + f"/api/v1/replicas/{rid}/state", json={"state": "draining"}) as r:
                assert r.status == 200

        async def n1_free() -> bool:
            return free(await status(session, serve, 3600))["ib-a"] == [("n1", 8, ["r1", "r2"])]

        await until(n1_free, timeout=20, what="n1 never free once its replicas drained")
        # Drained but never used: still unknown, and n3 still not free.
        assert free(await status(session, serve, 3600))["ib-b"] == []

        # r2 pushed onto another fabric: n1 is on two, said, and counted on neither.
        replicas[1] = entry("r2", f["m2"], 4, "n1", "ib-c")
        assert (await push(session, serve, replicas))[0] == 200
        doc = await status(session, serve, 0)
        assert doc["node_conflicts"] == [{"node": "n1", "fabrics": ["ib-a", "ib-c"], "replicas": ["r1", "r2"]}]
        assert [x["nodes"] for x in doc["fabrics"]] == [1, 1]
        code, text = await asyncio.to_thread(run_ctl, "status", "--server", serve.admin_url, "--idle-for", "0")
        assert code == 0, text
        lines = text.splitlines()
        head = lines.index("whole nodes that could be freed now:")
        assert lines[head + 2].split() == ["ib-a", "n2", "8", "r3"]
        table = next(i for i, line in enumerate(lines) if line.startswith("FABRIC ") and "NODES" in line)
        assert lines[table + 1].split() == ["ib-a", "1", "8", "1", "8", "0"]
        assert "replicas naming no node: 1 (2 GPUs), on no node above" in lines
        assert "node n1 is on fabrics ib-a, ib-c (replicas r1, r2): counted on none" in lines


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("node", "", "replicas[0].node: must not be empty"),
        ("node", 7, "replicas[0].node: must be a string, got an integer"),
        ("fabric", "x" * 254, "replicas[0].fabric: must be at most 253 characters, got 254"),
        ("fabric", "a\nb", "replicas[0].fabric: must not contain CR, LF or NUL"),
        ("nodes", "n1", "replicas[0].nodes: unknown key (did you mean 'node'?)"),
    ],
)
async def test_a_push_with_a_bad_node_or_fabric_is_refused_naming_it(
    serve: Serve, start_fake: StartFake, field: str, value: object, says: str
) -> None:
    fake = await start_fake("m1")
    serve.write([])
    await serve.start()
    async with aiohttp.ClientSession() as session:
        status_code, body = await push(session, serve, [{**entry("r1", fake, 1), field: value}])
        assert status_code == 400
        assert says in body["error"]["message"]
        async with session.get(serve.admin_url + "/api/v1/endpoints") as resp:
            assert (await resp.json())["replicas"] == []
