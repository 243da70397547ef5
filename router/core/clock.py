"""The one clock of the pool and its holds: what time it is, and a call at a time.

Everything in the core that reads the time or waits for one (last-used
stamps, ejections, queue and hold deadlines, a cold model's probes) reads
the same injected `Clock`, so that a test can run it on fake time: nothing
here calls `time` or the event loop's own timers directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final, Protocol

# The request path's stopwatch (its durations, times to first byte and token): the builtin
# under a Final name, which the compiled build keeps in a static, where `time.perf_counter`
# is an attribute looked up on the module at each read (about 150 instructions, and a
# request makes several).
perf_counter: Final = time.perf_counter


class Timer(Protocol):
    """A call the clock will make; cancel() before it is made, and it is not."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Where the pool, its holds and the wake calls read the time and set timers: the loop's, or a fake one."""

    def now(self) -> float:
        """Monotonic seconds: comparable with each other, never with the wall clock."""
        ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        """Call `callback` once `now()` has reached `when` (at once, in a later turn, if it has)."""
        ...


class LoopClock:
    """The real clock: `time.monotonic`, and timers on the running event loop."""

    __slots__ = ()

    # The builtin itself, not a method that calls it: the pool reads it in
    # acquire(), per request, and a Python frame there would cost.
    now = staticmethod(time.monotonic)

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        loop = asyncio.get_running_loop()
        # The loop keeps its own time (uvloop's is cached per turn, in
        # milliseconds): the delay is what carries over, not the instant.
        return loop.call_at(loop.time() + (when - time.monotonic()), callback)
