"""`router ctl top` reads one snapshot per frame: its header and its model rows always agree."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import aiohttp
import orjson

from router.run.app import RouterServer
from router.tools.ctl import Client
from router.tools.fake import Behaviour
from router.tools.top import Sampler, render
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, get_json, post


@contextlib.asynccontextmanager
async def flood(server: RouterServer, clients: int = 8) -> AsyncIterator[None]:
    """`clients` loops of requests to models m and n, each request streaming for a while, until the block ends."""
    stop = asyncio.Event()

    async def run(model: str) -> None:
        for _ in range(500):
            if stop.is_set():
                return
            await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": model}))

    tasks = [asyncio.create_task(run("mn"[i % 2])) for i in range(clients)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def header_and_rows(lines: list[str]) -> tuple[int, int]:
    """The header's "in flight" and the sum of the MODEL table's IN-FLIGHT column, as printed."""
    match = re.search(r"in flight (\d+)", lines[2])
    assert match is not None, lines
    start = next(i for i, line in enumerate(lines) if line.startswith("MODEL "))
    total = 0
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        total += int(line.split()[2])
    return int(match.group(1)), total


async def test_every_frame_under_load_has_a_header_equal_to_the_sum_of_its_model_rows(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    slow = Behaviour(tokens=6, token_delay=0.01)
    m, n = await start_fake("m", behaviour=slow), await start_fake("n", behaviour=slow)
    server = await start_router([replica_entry("m0", m), replica_entry("n0", n)], tick_seconds=0.05)
    sampler = Sampler(Client(server.admin_url), idle_for=1800)
    busy_frames = frames = 0
    async with flood(server):
        # Frames until five were taken under load, not between requests (a loaded machine leaves
        # gaps between a client's requests): each one checked, at most a hundred.
        while busy_frames < 5 and frames < 100:
            frame = await asyncio.to_thread(sampler.sample)
            header, rows = header_and_rows(render(frame, width=120))
            assert header == rows == sum(r.in_flight for r in frame.replicas)
            busy_frames += header > 0
            frames += 1
    assert busy_frames >= 5


async def test_status_with_replicas_carries_the_replicas_rows_of_the_same_snapshot(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    doc = await get_json(server.admin_url + "/api/v1/status?replicas=true")
    rows = await get_json(server.admin_url + "/api/v1/replicas")
    assert [r["id"] for r in doc["replicas"]] == [r["id"] for r in rows] == ["r0"]
    assert set(doc["replicas"][0]) == set(rows[0])
    # Without it, the summary alone, as before.
    assert "replicas" not in await get_json(server.admin_url + "/api/v1/status")


async def test_status_refuses_a_replicas_flag_that_is_neither_true_nor_false(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.admin_url + "/api/v1/status?replicas=yes") as resp,
    ):
        assert resp.status == 400
        assert "replicas must be true or false, got 'yes'" in (await resp.json())["error"]["message"]
