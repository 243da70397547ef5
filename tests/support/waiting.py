"""Waiting for an event instead of for time: a condition, an async check, the router's next tick.

Each polls at a short interval under a deadline; none sleeps for the event's
sake. `until_cancelled` is what a stand-in that has fallen silent awaits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router.run.app import RouterServer

# How often the waits below look again: often enough to add little to a test, seldom enough
# to leave the loop its work (an async check is a request or a scrape: less often).
POLL_SECONDS = 0.01
CHECK_SECONDS = 0.05


async def wait_for(condition: Any, timeout: float = 5.0, *, every: float = POLL_SECONDS) -> None:
    """Until `condition()` is true, looking `every` seconds; AssertionError past `timeout`."""
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(every)


async def until(
    check: Callable[[], Awaitable[bool]], *, timeout: float = 5.0, what: str = "condition not met in time"
) -> None:
    """Until the async `check()` is true (a request's answer, a scrape); AssertionError(`what`) past `timeout`."""
    deadline = time.perf_counter() + timeout
    while not await check():
        if time.perf_counter() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(CHECK_SECONDS)


async def tick(server: RouterServer, ticks: int = 1) -> None:
    """Until the router's usage ticker has ticked `ticks` times more.

    A tick takes its snapshot and publishes it in one synchronous step, so
    what happened before the call is in every snapshot published after it:
    the usage document, the pushes, the metrics read from the snapshot.
    """
    ticker = server.ticker
    assert ticker is not None
    target = ticker.ticks + ticks
    await wait_for(lambda: ticker.ticks >= target)


async def until_cancelled() -> None:
    """What a stand-in that has fallen silent does: nothing, until its test ends it.

    Not a long sleep: a sleep's length would say something a test means never to end.
    """
    await asyncio.Event().wait()


def polled(check: Callable[[], bool], *, timeout: float, every: float = CHECK_SECONDS) -> bool:
    """Blocking, for what waits outside the loop: until `check()` is true (True) or `timeout` passes (False).

    For a program that signals nothing when it is ready (llama.cpp, a container's
    probe, a process whose readiness is an HTTP answer): `check` may raise to give up.
    """
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
