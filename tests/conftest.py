"""Fixtures: real fake replicas on 127.0.0.1 port 0, and a real router in front."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from router.core.clock import Clock
from router.core.config.settings import parse_config
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.support.http_harness import Handler, Harness, StartServer, Stub, serving

# Each test on the loop its code runs on in production, under a deadline of its own (tests/support/loops.py).
from tests.support.loops import no_loop_errors, pytest_asyncio_loop_factories, pytest_runtest_call  # noqa: F401
from tests.support.processes import Serve
from tests.support.raw_server import Answer, RawServer
from tests.support.raw_server import StartRaw as StartRawServer
from tests.support.wire import StartRaw, ending_quietly, raw_replicas

StartFake = Callable[..., Awaitable[FakeReplica]]


StartRouter = Callable[..., Awaitable[RouterServer]]


@pytest.fixture
async def start_fake() -> AsyncIterator[StartFake]:
    fakes: list[FakeReplica] = []

    async def start(
        model: str = "m", *, name: str = "", behaviour: Behaviour | None = None, **kwargs: Any
    ) -> FakeReplica:
        fake = FakeReplica(models=(model,), name=name or f"fake-{len(fakes)}", **kwargs)
        if behaviour is not None:
            fake.behaviour = behaviour
        await fake.start()
        fakes.append(fake)
        return fake

    yield start
    for fake in fakes:
        await fake.stop()


def replica_entry(rid: str, fake: FakeReplica, model: str | None = None, **labels: Any) -> dict[str, Any]:
    return {"id": rid, "model": model or fake.models[0], "url": fake.url, "labels": labels}


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    """The client port's server alone, with a stub handler (tests/support/http_harness.py): no router, no replica."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(handler: Handler | None = None, **settings: Any) -> Harness:
            return await stack.enter_async_context(serving(handler or Stub(), **settings))

        yield start


@pytest.fixture
async def raw_server() -> AsyncIterator[StartRawServer]:
    """Raw HTTP servers standing in for replicas (tests/support/raw_server.py), for the upstream client's tests."""
    servers: list[RawServer] = []

    async def start(answer: Answer) -> RawServer:
        raw = RawServer(answer)
        raw.server = await asyncio.start_server(ending_quietly(raw.handle), "127.0.0.1", 0)
        servers.append(raw)
        return raw

    yield start
    for raw in servers:
        assert raw.server is not None
        raw.server.close()
        await raw.server.wait_closed()


@pytest.fixture
async def start_raw() -> AsyncIterator[StartRaw]:
    """Misbehaving replicas, each written for its test, on 127.0.0.1 port 0 (tests/support/wire.py)."""
    async with raw_replicas() as start:
        yield start


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """`router serve` as a real process on port 0 (tests/support/processes.py's Serve); killed at the end."""
    process = Serve(tmp_path / "router.toml")
    yield process
    if process.process is not None:
        process.output()


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    servers: list[RouterServer] = []

    async def start(
        replicas: Sequence[dict[str, Any]] = (), *, clock: Clock | None = None, **settings: Any
    ) -> RouterServer:
        """A router on 127.0.0.1 port 0 with `settings`; `clock`: a fake one for its pool (tests/support/clock.py)."""
        raw: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "router_name": "test",
            "connect_timeout_seconds": 2.0,
            # The cards' reads are requests a replica sees: only the tests of cards read them.
            "model_cards": False,
            **settings,
            "replicas": list(replicas),
        }
        config = parse_config(raw, "<test>", environ={})
        server = RouterServer(config, registry=CollectorRegistry(), clock=clock)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


RefusedUrl = Callable[[], str]


@pytest.fixture
def refused_url() -> Iterator[RefusedUrl]:
    """URLs on which connections are refused, reserved for the whole test.

    A socket bound but never listening refuses connections, and holding it
    keeps the port from going to any other listener (the router's own
    included) while the test runs.
    """
    held: list[socket.socket] = []

    def make() -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        held.append(sock)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield make
    for sock in held:
        sock.close()


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    received: list[dict[str, Any]] = []
    switches: dict[str, Any] = {"status": 200, "delay": 0.0, "active": 0, "most_active": 0}

    async def handle(request: web.Request) -> web.Response:
        switches["active"] += 1
        switches["most_active"] = max(switches["most_active"], switches["active"])
        try:
            received.append(await request.json())
            # Real time: a slow receiver is slow by the clock the pushes' timeouts count on.
            await asyncio.sleep(switches["delay"])
            return web.Response(status=switches["status"])
        finally:
            switches["active"] -= 1

    app = web.Application()
    app.router.add_post("/usage", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}/usage", received, switches
    await runner.cleanup()
