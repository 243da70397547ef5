"""The upstream client's tests' parts: a client made per test and closed after it, and a sink that records."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from router.http.client import Client
from router.http.origin import Origin
from tests.support.raw_server import HEAD, RawServer

MakeClient = Callable[..., Client]


async def clients_made() -> AsyncIterator[MakeClient]:
    """Clients made with the tests' defaults (any overridden), each closed after the test."""
    clients: list[Client] = []

    def make(**kwargs: Any) -> Client:
        c = Client(**{"connect_timeout": 2.0, "keepalive_seconds": 5.0, **kwargs})
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


async def ok_once(client: Client, raw: RawServer) -> None:
    await ok_once_at(client, raw.origin)


async def ok_once_at(client: Client, origin: Origin) -> None:
    resp = await client.request(origin, HEAD, b"{}")
    assert await resp.read() == b"hello"
    resp.release()


class Recorder:
    """A pipe() sink that keeps every piece it is handed."""

    def __init__(self, *, full: bool = False) -> None:
        self.pieces: list[bytes] = []
        self.full = full

    def __call__(self, piece: bytes) -> bool:
        self.pieces.append(piece)
        return self.full


async def never_drained() -> None:
    raise AssertionError("a sink that is never full is never drained")
