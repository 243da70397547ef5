"""What a held request leaves behind: its access-log line, its probes, and what the replica was really sent.

Every way a hold ends (served, timeout, overflow, client_gone, shutdown)
shows in the request's access-log line as it does in
`router_hold_outcomes_total`, with the wait. The tries of a cold model's
replica that find it still loading are probes, counted in
`router_hold_probes_total`: not attempts of the request, not requests of the
replica, not upstream errors. Through the real server with the official
`openai` SDK, on a fake clock where the pauses and the deadline decide.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from router.core.pool.waiters import PROBE_CAP_SECONDS
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry
from tests.gateway.test_cold_start import ask, held, push, refused_tries, scrape
from tests.support.clients import CHAT, access_log_lines, get_json, samples
from tests.support.clock import FakeClock
from tests.support.waiting import wait_for


async def the_line(path: Path) -> dict[str, Any]:
    """The one access-log line the test's one request leaves (the log is written in batches)."""
    await wait_for(lambda: len(access_log_lines(path)) == 1)
    return access_log_lines(path)[0]


def hold_outcomes(text: str) -> dict[str, float]:
    return {dict(k)["outcome"]: v for k, v in samples(text, "router_hold_outcomes_total").items()}


def probes(text: str) -> dict[str, float]:
    return {dict(k)["outcome"]: v for k, v in samples(text, "router_hold_probes_total").items()}


def upstream_errors(text: str) -> dict[str, float]:
    return {dict(k)["reason"]: v for k, v in samples(text, "router_upstream_errors_total").items()}


async def replica_row(server: RouterServer, rid: str) -> dict[str, Any]:
    assert server.ticker is not None
    rows = await get_json(server.admin_url + "/api/v1/replicas")
    return next(row for row in rows if row["id"] == rid)


async def test_a_held_request_served_logs_its_wait_and_the_hold_served(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    fake = await start_fake("m")
    clock = FakeClock()
    server = await start_router([], models={"m": {"cold_start_seconds": 10}}, access_log=str(log), clock=clock)
    waiting = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    clock.advance(2.5)
    await push(server, [replica_entry("r0", fake)])
    raw = await waiting
    assert raw.headers["x-router-held-seconds"] == "2.500"
    line = await the_line(log)
    assert (line["hold"], line["held_seconds"], line["outcome"], line["status"]) == ("served", 2.5, "ok", 200)
    assert (line["attempts"], line["replica"]) == (1, "r0")
    assert hold_outcomes(await scrape(server)) == {"served": 1}


async def test_a_held_request_that_times_out_logs_its_wait_and_the_timeout(
    start_router: StartRouter, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    clock = FakeClock()
    server = await start_router([], models={"m": {"cold_start_seconds": 4}}, access_log=str(log), clock=clock)
    asking = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    clock.advance(4)
    with pytest.raises(openai.APIStatusError):
        await asking
    line = await the_line(log)
    assert (line["hold"], line["held_seconds"], line["outcome"], line["status"]) == ("timeout", 4.0, "timeout", 503)
    assert (line["attempts"], line["replica"]) == (0, None)
    assert hold_outcomes(await scrape(server)) == {"timeout": 1}


async def test_one_more_than_max_held_logs_the_overflow(start_router: StartRouter, tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    server = await start_router(
        [], models={"m": {"cold_start_seconds": 10, "max_held": 1}}, access_log=str(log), clock=FakeClock()
    )
    first = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + "/v1/chat/completions", json=CHAT) as resp,
    ):
        body = await resp.json()
    assert resp.status == 503
    # One held: "1 request already waits", not "1 requests".
    assert "1 request already waits" in body["error"]["message"]
    line = await the_line(log)
    assert (line["hold"], line["held_seconds"], line["outcome"], line["status"]) == ("overflow", 0.0, "overflow", 503)
    assert hold_outcomes(await scrape(server)) == {"overflow": 1}
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def test_a_client_that_leaves_while_held_logs_client_gone_and_its_wait(
    start_router: StartRouter, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    clock = FakeClock()
    server = await start_router([], models={"m": {"cold_start_seconds": 10}}, access_log=str(log), clock=clock)
    async with aiohttp.ClientSession() as session:
        asking = asyncio.create_task(session.post(server.client_url + "/v1/chat/completions", json=CHAT))
        await wait_for(lambda: held(server) == 1)
        clock.advance(1.25)
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
    line = await the_line(log)
    assert (line["hold"], line["held_seconds"], line["outcome"]) == ("client_gone", 1.25, "client_gone")
    assert hold_outcomes(await scrape(server)) == {"client_gone": 1}


async def test_a_request_held_at_shutdown_logs_the_shutdown(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from router.core.config.settings import parse_config

    log = tmp_path / "access.log"
    clock = FakeClock()
    raw = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "access_log": str(log),
        "models": {"m": {"cold_start_seconds": 10}},
    }
    server = RouterServer(parse_config(raw, "<test>", environ={}), registry=CollectorRegistry(), clock=clock)
    await server.start()
    try:
        asking = asyncio.create_task(ask(server))
        await wait_for(lambda: held(server) == 1)
        clock.advance(3)
        tallies = server.pool.tallies
    finally:
        await server.stop()
    with pytest.raises(openai.APIStatusError):
        await asking
    line = await the_line(log)
    assert (line["hold"], line["held_seconds"], line["outcome"], line["status"]) == ("shutdown", 3.0, "shutdown", 503)
    assert tallies.hold_outcomes == {("m", "shutdown"): 1}


async def test_a_held_request_whose_replica_refused_connections_counts_probes_not_attempts_nor_errors(
    start_router: StartRouter, tmp_path: Path
) -> None:
    """Refused while the engine loads, then served: one attempt, one request of the replica, no upstream error."""
    log = tmp_path / "access.log"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    clock = FakeClock()
    server = await start_router(
        [{"id": "r0", "model": "m", "url": url}],
        models={"m": {"cold_start_seconds": 10}},
        access_log=str(log),
        clock=clock,
    )
    fake = FakeReplica(models=("m",), name="loading")
    try:
        waiting = asyncio.create_task(ask(server))
        await wait_for(lambda: held(server) == 1)
        await refused_tries(server, clock, 3)
        await fake.start(sock=sock)  # the engine starts to answer
        clock.advance(PROBE_CAP_SECONDS)
        await waiting
        line = await the_line(log)
        text = await scrape(server)
        row = await replica_row(server, "r0")
    finally:
        await fake.stop()
    assert len(fake.seen) == 1
    assert (line["attempts"], line["replica"], line["hold"]) == (1, "r0", "served")
    refused = probes(text)["refused"]
    # The request's first try, before it was held, is a probe too: it found the engine loading.
    assert refused >= 3 and probes(text)["answered"] == 1
    assert (row["requests"], row["connects_failed"], row["errors"]) == (1, refused, 0)
    assert "connect" not in upstream_errors(text)


async def test_a_held_request_whose_replica_answered_503_counts_probes_not_attempts_nor_errors(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    """A 503 while loading reached the replica (its `requests`), but is neither an attempt nor an upstream error."""
    log = tmp_path / "access.log"
    loading = await start_fake("m", behaviour=Behaviour(fail_status=503, fail_body=b'{"message": "Loading model"}'))
    clock = FakeClock()
    server = await start_router(
        [replica_entry("r0", loading)], models={"m": {"cold_start_seconds": 10}}, access_log=str(log), clock=clock
    )
    waiting = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    await refused_tries(server, clock, 3)
    loading.behaviour.fail_status = None
    clock.advance(PROBE_CAP_SECONDS)
    await waiting
    line = await the_line(log)
    text = await scrape(server)
    row = await replica_row(server, "r0")
    assert (line["attempts"], line["replica"], line["hold"]) == (1, "r0", "served")
    loads = probes(text)["loading"]
    assert loads >= 3 and probes(text) == {"loading": loads, "answered": 1}
    # Every 503 reached the replica: its requests are what it received, as it counts them.
    assert row["requests"] == len(loading.seen) == loads + 1
    assert (row["connects_failed"], row["errors"]) == (0, 0)
    assert "status" not in upstream_errors(text)


async def test_a_request_for_a_model_whose_held_requests_probe_waits_behind_them_without_a_try_of_its_own(
    start_router: StartRouter, refused_url: RefusedUrl
) -> None:
    clock = FakeClock()
    server = await start_router(
        [{"id": "r0", "model": "m", "url": refused_url()}], models={"m": {"cold_start_seconds": 10}}, clock=clock
    )
    first = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    await refused_tries(server, clock, 2)
    tried = server.pool.get("r0")
    assert tried is not None
    before = tried.connects_failed
    second = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 2)
    # The newcomer tried nothing: only the probes, when the clock lets them, reach the replica.
    assert tried.connects_failed == before
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


async def test_the_replicas_requests_count_what_reached_it_and_failed_connections_apart(
    start_fake: StartFake, start_router: StartRouter, refused_url: RefusedUrl
) -> None:
    good = await start_fake("m")
    server = await start_router([{"id": "dead", "model": "m", "url": refused_url()}, replica_entry("good", good)])
    statuses = []
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            async with session.post(server.client_url + "/v1/chat/completions", json=CHAT) as resp:
                statuses.append(resp.status)
    assert statuses == [200] * 20
    dead, alive = await replica_row(server, "dead"), await replica_row(server, "good")
    assert dead["requests"] == 0
    assert alive["requests"] == len(good.seen) == 20
    assert dead["connects_failed"] >= 1 and alive["connects_failed"] == 0
    # Outside a hold, a failed connection is an upstream error, as it always was.
    assert upstream_errors(await scrape(server))["connect"] == dead["connects_failed"]
