"""The client port through the router, fuzzed against h11 (tests/support/differential.py): what reaches the replica.

The same streams and the same verdict as the server's own fuzz
(tests/http/server/test_differential.py), with a router in front of a fake
replica: every request h11 accepts also reaches the replica as the router
forwards it, with no hop-by-hop or framing header of the client's, a Host and
a Content-Length of the router's own, and no trailer field merged into its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from prometheus_client import CollectorRegistry

from router.core.config.settings import parse_config
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica, Seen
from tests.conftest import replica_entry
from tests.support.differential import check
from tests.support.h11_reference import HOP_BY_HOP, MAX_BODY, Parsed
from tests.support.streams import PINNED, streams
from tests.support.waiting import wait_for

T = TypeVar("T")


# The router, started once for the module ------------------------------------------------


class Live:
    """A fake replica and a router on their own event loop, in a thread, for blocking sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="differential-router", daemon=True)
        self.thread.start()
        self.fake: FakeReplica | None = None
        self.server: RouterServer | None = None
        self._refusals_before = 0

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def start(self) -> None:
        self.fake = FakeReplica(models=("m",), name="fake", behaviour=Behaviour(tokens=2))
        await self.fake.start()
        config = parse_config(
            {
                "listen": "127.0.0.1:0",
                "admin_listen": "127.0.0.1:0",
                "router_name": "differential",
                "connect_timeout_seconds": 2.0,
                "max_body_bytes": MAX_BODY,
                "replicas": [replica_entry("r0", self.fake)],
            },
            "<test>",
            environ={},
        )
        self.server = RouterServer(config, registry=CollectorRegistry())
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.fake is not None:
            await self.fake.stop()
        rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None and self.server.client_address is not None
        return self.server.client_address

    @property
    def fake_host(self) -> str:
        assert self.fake is not None
        return self.fake.url.removeprefix("http://")

    def _refusals(self) -> int:
        assert self.server is not None and self.server._client_server is not None
        return sum(self.server._client_server.protocol_errors.counts.values())

    async def _reset(self) -> None:
        assert self.fake is not None
        self.fake.seen.clear()
        self._refusals_before = self._refusals()

    def reset(self) -> None:
        self.call(self._reset())

    async def _settled(self) -> tuple[list[Seen], int]:
        """What the replica received and what the router refused, once the connection is gone."""
        assert self.fake is not None and self.server is not None and self.server._client_server is not None
        client_server = self.server._client_server
        fake = self.fake
        # The router notices the close at once; the replica may still be reading a forwarded request.
        # Settled is no event either side signals, and may not come: then what was seen at the deadline.
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: not (client_server.connections or fake.active), every=0.002)
        return list(self.fake.seen), self._refusals() - self._refusals_before

    def settled(self) -> tuple[list[Seen], int]:
        return self.call(self._settled())

    def forwarding(self, p: Parsed, seen: Seen) -> list[str]:
        return _forwarding(p, seen, self.fake_host)

    def close(self) -> None:
        try:
            self.call(self.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    # Module-scoped: Hypothesis runs every example against one router, which a
    # function-scoped async fixture could not give it.
    router = Live()
    try:
        router.call(router.start())
        yield router
    finally:
        router.close()


def _forwarding(p: Parsed, seen: Seen, seen_host: str) -> list[str]:
    problems: list[str] = []
    target = p.origin_form.decode("latin-1")
    if seen.path != target:
        problems.append(f"path {seen.path!r}, expected {target!r}")
    if seen.body != p.body:
        problems.append(f"body {seen.body!r}, expected {p.body!r}")
    names = {name.lower(): value for name, value in seen.headers.items()}
    named = {option.decode("latin-1") for option in p.connection_options()}
    for name in names:
        folded = name.replace("_", "-")
        if (
            folded in HOP_BY_HOP
            or folded in named
            or folded.startswith("proxy-")
            or (name != folded and folded in ("content-length", "host"))
        ):
            problems.append(f"header {name!r} leaked to the replica")
    head_names = {name.lower() for name, _ in p.headers}
    for trailer, _ in p.trailers:
        if trailer.lower() not in head_names and trailer.decode("latin-1").lower() in names:
            problems.append(f"trailer field {trailer!r} was merged into the forwarded head")
    if names.get("content-length") != str(len(p.body)):
        problems.append(f"Content-Length {names.get('content-length')!r} for a body of {len(p.body)}")
    if names.get("host") != seen_host:
        problems.append(f"Host {names.get('host')!r}, expected the replica's {seen_host!r}")
    marks = p.values(b"x-req")
    if len(marks) == 1 and names.get("x-req") != marks[0].decode("latin-1"):
        problems.append(f"X-Req {names.get('x-req')!r}, expected {marks[0]!r}")
    return problems


# About 10 s of streams; over the 60 s default only when a failure is being
# shrunk, one exchange with the router per step. Derandomized so that CI runs
# the same streams every time: a disagreement found is pinned in PINNED.
@pytest.mark.timeout(180)
@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
)
@given(stream=streams())
def test_the_router_forwards_what_h11_reads(live: Live, stream: bytes) -> None:
    check(live, stream)


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned_streams_through_the_router(live: Live, name: str) -> None:
    check(live, PINNED[name])
