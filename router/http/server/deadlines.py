"""Every client connection's deadlines, checked by one sweep: no timer per request, no clock read per request.

A head must arrive whole within `header_timeout` of its first byte
(slowloris), a body within `body_timeout` of its head (408), an idle
keep-alive connection is closed after `keepalive_timeout`, a refused body is
read and dropped for a short while, and an answer the client does not read
for `write_stall_timeout` is cut off (whole answers and streams alike). A
connection holds one read deadline (ReadDeadline: when, and its Deadline
says what for) and one write deadline (flow.py); what it does when one
passes is its own (Connection.check).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterable
from typing import Final, Protocol


class Deadline(enum.IntEnum):
    """What a connection's read deadline is for."""

    NONE = 0
    HEAD = 1
    BODY = 2
    IDLE = 3
    DISCARD = 4


# Module-level names (Final: a compiled module reads them as constants).
D_NONE: Final = Deadline.NONE
D_HEAD: Final = Deadline.HEAD
D_BODY: Final = Deadline.BODY
D_IDLE: Final = Deadline.IDLE
D_DISCARD: Final = Deadline.DISCARD


class Watched(Protocol):
    """A connection as the sweep sees it."""

    @property
    def waiting(self) -> bool:
        """Whether any deadline of its is armed."""

    def check(self, now: float) -> None:
        """Act on a deadline that passed."""


class Sweep:
    """One timer for every connection's deadlines, running only while one of them waits."""

    __slots__ = ("_connections", "every", "now", "timer")

    def __init__(self, connections: Iterable[Watched], every: float) -> None:
        self._connections = connections
        # Deadlines are checked this often: a few times per the shortest of them.
        self.every = every
        # Monotonic time as of the last sweep (or the start of one): the clock deadlines are set by.
        self.now = time.monotonic()
        # Set while the sweep is due to run.
        self.timer: asyncio.TimerHandle | None = None

    def watch(self) -> None:
        """Make sure the sweep runs while any connection waits on a deadline."""
        if self.timer is None:
            self.now = time.monotonic()
            self.timer = asyncio.get_running_loop().call_later(self.every, self._sweep)

    def _sweep(self) -> None:
        self.timer = None
        self.now = now = time.monotonic()
        waiting = False
        for connection in list(self._connections):
            connection.check(now)
            waiting = waiting or connection.waiting
        if waiting:
            self.watch()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ReadDeadline:
    """A connection's one read deadline: when it passes (the sweep's clock; 0: none), and what for."""

    __slots__ = ("due", "kind", "sweep")

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep
        self.due = 0.0
        self.kind = D_NONE

    def arm(self, seconds: float, kind: Deadline) -> None:
        sweep = self.sweep
        if sweep.timer is None:
            sweep.watch()
        # By the sweep's clock, at most one sweep old: never early, and no clock read per request.
        self.due = sweep.now + seconds + sweep.every
        self.kind = kind

    def disarm(self) -> None:
        self.due = 0.0
        self.kind = D_NONE
