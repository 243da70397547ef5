"""`router serve` at SIGTERM: /readyz fails first while requests are still served, then the drain.

A Service (or any load balancer) keeps sending new connections to a pod for
a few seconds after it is told to stop: the router must not refuse them
meanwhile. These run the real process, as Kubernetes stops it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.deploy.balancer import Backend, Balancer
from tests.support.clients import CHAT
from tests.support.processes import Serve

pytestmark = pytest.mark.slow


async def status(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status


async def wait_ready_503(session: aiohttp.ClientSession, serve: Serve, within: float = 5.0) -> float:
    """Seconds from now until /readyz answers 503."""
    began = time.monotonic()
    while await status(session, serve.admin_url + "/readyz") != 503:
        assert time.monotonic() - began < within, "/readyz still 200"
        await asyncio.sleep(0.02)  # real time: the seconds until it fails are what is measured
    return time.monotonic() - began


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one-process", "workers"])
async def test_during_the_delay_readyz_fails_and_new_connections_are_still_served(
    serve: Serve, start_fake: StartFake, workers: tuple[str, ...]
) -> None:
    fake = await start_fake("m")
    # New connections are tried for 1.5 s of a 3 s delay: a loaded machine may stall a client
    # between its check of the time and its connect, and a margin of half a second was met.
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "shutdown_delay_seconds = 3")
    await serve.start(*workers)
    async with aiohttp.ClientSession() as session:
        signalled = time.monotonic()
        serve.signal(signal.SIGTERM)
        await wait_ready_503(session, serve)
        served = 0
        # A new connection each time, as a client the Service still sends here opens one.
        while time.monotonic() - signalled < 1.5:
            async with aiohttp.ClientSession() as fresh:
                async with fresh.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp:
                    assert resp.status == 200
                    await resp.read()
                served += 1
        assert served > 0
        assert serve.process is not None
        assert await asyncio.to_thread(serve.process.wait, 20) == 0
    # It waited the delay before it stopped accepting, and no longer.
    assert 3.0 <= time.monotonic() - signalled < 15
    assert "serving on for 3s" in serve.output()


async def test_sigint_stops_at_once_without_the_delay(serve: Serve, start_fake: StartFake) -> None:
    """Ctrl-C is a person at a terminal: no load balancer to wait for."""
    fake = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "shutdown_delay_seconds = 30")
    await serve.start()
    began = time.monotonic()
    serve.signal(signal.SIGINT)
    assert serve.process is not None
    assert await asyncio.to_thread(serve.process.wait, 20) == 0
    assert time.monotonic() - began < 10
    assert "serving on for" not in serve.output()


async def test_a_second_sigterm_ends_the_delay(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "shutdown_delay_seconds = 30")
    await serve.start()
    began = time.monotonic()
    async with aiohttp.ClientSession() as session:
        serve.signal(signal.SIGTERM)
        await wait_ready_503(session, serve)
    serve.signal(signal.SIGTERM)
    assert serve.process is not None
    assert await asyncio.to_thread(serve.process.wait, 20) == 0
    assert time.monotonic() - began < 10


async def test_a_client_pool_sending_through_a_router_that_gets_sigterm_sees_no_error(
    tmp_path: Path, start_fake: StartFake
) -> None:
    """Two routers behind a balancer that probes /readyz and takes the failing one out a second later:
    one gets SIGTERM mid-load, and every request of the pool succeeds. (With shutdown_delay_seconds = 0
    the requests sent to it in that second are refused.)"""
    fake = await start_fake("m", behaviour=Behaviour(tokens=8, token_delay=0.01))
    routers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        serve = Serve(tmp_path / name / "router.toml")
        serve.write([{"id": "r0", "model": "m", "url": fake.url}], "shutdown_delay_seconds = 2")
        await serve.start()
        routers.append(serve)
    a, b = routers
    balancer = Balancer([Backend(s.client_url, s.admin_url + "/readyz") for s in routers])
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:
            probing = asyncio.create_task(balancer.probe(stop))
            pool = [asyncio.create_task(balancer.client(session, CHAT, stop)) for _ in range(8)]
            # Real time: the pool's load runs a second on both routers before one is replaced.
            await asyncio.sleep(1.0)
            before = balancer.sent_to[a.client_url]
            a.signal(signal.SIGTERM)
            assert a.process is not None
            await asyncio.to_thread(a.process.wait, 20)
            await asyncio.sleep(0.5)  # real time: the pool keeps sending, to the router left, a while after
            stop.set()
            await asyncio.gather(probing, *pool)
    finally:
        for serve in routers:
            if serve.process is not None:
                serve.output()
    assert a.process.returncode == 0
    assert before > 0 and balancer.sent_to[b.client_url] > 0
    assert set(balancer.outcomes) == {"ok"}, balancer.outcomes
