"""The one sweep over every upstream connection with a request in progress: late heads, silent bodies.

No timer per request, no clock read per request or chunk: a timer set and
cancelled per request costs the loop more than the rest of sending it. A
head's deadline is set by the sweep's clock (`now`, one sweep old at most
while the sweep runs), so that it is never early; a body's silence is told
by its connection's reads, unchanged from one sweep to the next. The sweep
runs only while a request is in progress, on the client's injected clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from router.core.clock import Clock, Timer
from router.http.client.exchange import ACTIVE, BODY, Exchange


class Watched(Protocol):
    """An upstream connection as the watch sees it: its exchange, its reads, and the two verdicts."""

    exchange: Exchange
    paused: bool
    reads: int
    # `reads` when last seen (-1: not seen yet, or paused), and since when it has not changed.
    seen_reads: int
    quiet_since: float

    def head_late(self) -> None: ...
    def went_quiet(self, seconds: float) -> None: ...


class Watch:
    """One timer for every connection's head deadline and body silence, running only while a request is."""

    __slots__ = ("_connections", "_every", "_head_timeout", "clock", "idle_timeout", "now", "timer", "watch_every")

    def __init__(self, connections: Iterable[Watched], clock: Clock, idle_timeout: float) -> None:
        self._connections = connections
        self.clock = clock
        # Longest silence of a replica in the middle of a body.
        self.idle_timeout = idle_timeout
        # The silence watch's period; the sweep's own is shorter for a head
        # deadline shorter than it (head_due).
        self.watch_every = min(max(idle_timeout / 4, 0.05), 5.0)
        self._every = self.watch_every
        self._head_timeout: float | None = None
        # The clock as of the last sweep (or its start): what deadlines are set by.
        self.now = 0.0
        # Set while the sweep is due to run.
        self.timer: Timer | None = None

    def head_due(self, timeout: float) -> float:
        """When a head asked for now is late, by the sweep's clock: `timeout` from now at least,
        and about a sweep more (checked every timeout / 4, within [0.05 s, 1 s])."""
        if timeout != self._head_timeout:
            self._head_timeout = timeout
            self._every = min(self.watch_every, max(0.05, min(1.0, timeout / 4)))
        if self.timer is None:
            self.start()
        return self.now + timeout + self._every

    def start(self) -> None:
        """Start the sweep, which is not running (`timer` is None): a request is in progress."""
        clock = self.clock
        self.now = now = clock.now()
        self.timer = clock.call_at(now + self._every, self._sweep)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _sweep(self) -> None:
        """Fail heads past their deadline, and end bodies whose replica went quiet.

        A connection in its body counts its reads; a count unchanged since the
        last sweep is silence, timed from the sweep that first saw it unchanged
        (so never cut before `idle_timeout`, at most two sweeps after). A
        paused connection is waiting for the proxy's client, not the replica:
        skipped, and its quiet time starts afresh once resumed.
        """
        self.timer = None
        busy = [
            c
            for c in self._connections
            if c.exchange.state is BODY or (c.exchange.head_due and c.exchange.state is ACTIVE)
        ]
        if not busy:
            return  # no timer while no request is in progress
        clock = self.clock
        self.now = now = clock.now()
        limit = self.idle_timeout
        late: list[Watched] = []
        quiet: list[Watched] = []
        for connection in busy:
            exchange = connection.exchange
            if exchange.state is ACTIVE:
                if exchange.head_due < now:
                    late.append(connection)
            elif connection.paused:
                connection.seen_reads = -1
            elif connection.reads != connection.seen_reads:
                connection.seen_reads = connection.reads
                connection.quiet_since = now
            elif now - connection.quiet_since > limit:
                quiet.append(connection)
        for connection in late:
            connection.head_late()
        for connection in quiet:
            connection.went_quiet(limit)
        self.timer = clock.call_at(now + self._every, self._sweep)
