"""Flow control both ways: answers a client does not take, and request bodies the router holds.

Out: a handler that writes faster than its client reads is told so by write()
(True: full), and awaits drain(); an answer the client takes nothing of for
`write_stall_timeout` is cut off (the sweep checks `stall_deadline`), so that
no answer is kept forever for a client that stopped reading.

In: bodies are bounded per request (`max_body_bytes`: 413) and across all
connections together (`max_buffered_body_bytes`: 503 at once beyond it); a
connection's share of that Budget is its Holding.
"""

from __future__ import annotations

import asyncio
import time

from router.http.server.deadlines import Sweep
from router.http.server.head import Refusal


class Flow:
    """One connection's write side: paused or not, and the drain waiting on it."""

    __slots__ = ("_drained", "paused", "stall_deadline")

    def __init__(self) -> None:
        self.paused = False
        # When the client must have taken some of its answer (monotonic; 0: no one waits).
        self.stall_deadline = 0.0
        self._drained: asyncio.Future[None] | None = None

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.stall_deadline = 0.0
        self._wake(None)

    async def wait(self, sweep: Sweep, stall_timeout: float) -> None:
        """Until the transport resumes writing; `fail()`'s error when the client took nothing in time."""
        self.stall_deadline = time.monotonic() + stall_timeout
        sweep.watch()
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await self._drained
        finally:
            self._drained = None

    def fail(self, error: Exception) -> None:
        self._wake(error)

    def _wake(self, error: Exception | None) -> None:
        drained = self._drained
        if drained is None or drained.done():
            return
        if error is None:
            drained.set_result(None)
        else:
            drained.set_exception(error)
            # Retrieved or not, never logged as unretrieved.
            drained.exception()


class Budget:
    """Request bodies held by every connection together: at most `limit` bytes, and `max_body` per request.

    Counted as bytes arrive, never as announced (reader.py): a head that
    promises 32 MiB and sends nothing takes no one's share. A request's bytes
    are let go when its handler returns; the body being read, when it is
    refused; all of a connection's, when it is lost.
    """

    __slots__ = ("held", "limit", "max_body")

    def __init__(self, max_body: int, limit: int) -> None:
        self.max_body = max_body
        self.limit = limit
        self.held = 0


class Holding:
    """One connection's share of the Budget: the body bytes it holds, all of them and the request's being read."""

    __slots__ = ("budget", "current", "held")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.held = 0
        self.current = 0

    def release(self, size: int) -> None:
        """Body bytes this connection held, let go."""
        # Never below zero: a request cancelled after its connection was lost
        # was already counted out with the rest of the connection.
        size = min(size, self.held)
        if size:
            self.held -= size
            self.budget.held -= size

    def drop_current(self) -> None:
        """The request being read is refused: its bytes are let go."""
        self.release(self.current)
        self.current = 0


def buffers_full() -> Refusal:
    return Refusal(
        503, "buffers_full", "The router holds too many request bodies at once; retry shortly.", "server_overloaded"
    )
