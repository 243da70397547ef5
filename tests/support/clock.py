"""A clock that moves only when the test moves it: router.core.clock's `Clock` on fake time.

The pool, its holds and the wake calls read time and set their timers
through one `Clock`; given this one, a test decides when a deadline passes or a probe's
pause is over, and waits no real time for it. Calls due at once (a delay of
0) still go through the event loop, in a later turn, as the real clock's do.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from router.core.clock import Timer


class FakeTimer:
    """A call FakeClock will make at `when`, unless cancelled first."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """The core's `Clock` on fake time: `advance` moves it, making every call due on the way."""

    def __init__(self, now: float = 1000.0) -> None:
        self.time = now
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.time

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        if when <= self.time:
            return asyncio.get_running_loop().call_soon(callback)
        timer = FakeTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move on by `seconds`: every call due by then is made, in the order of its time, at its time."""
        end = self.time + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self.time = max(self.time, when)
                timer.callback()
        self.time = end

    def next_call(self) -> float | None:
        """When the soonest call still to be made is due, or None when none is."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None
