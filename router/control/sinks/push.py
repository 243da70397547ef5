"""POSTs the usage document to `usage_push_url` once per tick.

Each push runs in its own task with a timeout shorter than the tick. A push
still in flight is never stacked with another: the newest snapshot waits in
one slot and goes out when the current push ends, older ones are dropped,
because a usage map only ever needs its latest version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from router.control.sinks.document import UsageDocument
from router.core.usage.snapshots import UsageSnapshot

log = logging.getLogger("router.push")


class PushSink:
    """POSTs each snapshot's usage document to usage_push_url, newest first, never queued without end."""

    name = "push"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        timeout_seconds: float,
        log_every_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        document: UsageDocument | None = None,
    ) -> None:
        """`document`: shared with the latest copy, so that the body is built once per tick for both."""
        self._document = document if document is not None else UsageDocument()
        self._session = session
        self.url = url
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._task: asyncio.Task[None] | None = None
        self._pending: bytes | None = None
        self.pushes = 0
        self.failures = 0
        self._log_every = log_every_seconds
        self._last_logged = -float("inf")
        self._unlogged = 0
        self._clock = clock

    @classmethod
    def every_tick(
        cls, session: aiohttp.ClientSession, url: str, tick_seconds: float, document: UsageDocument | None = None
    ) -> PushSink:
        # A timeout shorter than the tick, so that pushes never pile up behind each other.
        return cls(session, url, timeout_seconds=max(0.05, tick_seconds * 0.8), document=document)

    def publish(self, snapshot: UsageSnapshot) -> None:
        body = self._document.body(snapshot)
        if self._task is not None and not self._task.done():
            self._pending = body
            return
        self._task = asyncio.get_running_loop().create_task(self._drain(body))

    async def _drain(self, body: bytes) -> None:
        next_body: bytes | None = body
        while next_body is not None:
            await self.send(next_body)
            next_body, self._pending = self._pending, None

    async def send(self, body: bytes) -> bool:
        """One push; never raises but for cancellation. True if accepted (2xx)."""
        problem: str
        try:
            async with self._session.post(
                self.url,
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=self._timeout,
            ) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    self.pushes += 1
                    return True
                problem = f"answered {resp.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.failures += 1
        self._log_failure(problem)
        return False

    def _log_failure(self, problem: str) -> None:
        # A receiver that is down fails every tick: one line a minute is enough.
        now = self._clock()
        if now - self._last_logged < self._log_every:
            self._unlogged += 1
            return
        suppressed = f" ({self._unlogged} more failures since the last report)" if self._unlogged else ""
        log.warning("usage push to %s failed: %s%s", self.url, problem, suppressed)
        self._last_logged = now
        self._unlogged = 0

    async def flush(self, snapshot: UsageSnapshot) -> bool:
        """Push `snapshot` now and wait for it (the final push at shutdown)."""
        if self._task is not None and not self._task.done():
            self._pending = None
            await asyncio.wait([self._task])
        return await self.send(self._document.body(snapshot))

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])
