"""Scale from zero: tell the control plane that a model's requests are held, once per cooldown.

When a request is held for a cold model, the router POSTs
`{"router", "model", "held", "since"}` to `wake_url` (with the admin token
as a bearer if one is set) so that something can start a replica. Calls are
de-duplicated per model: the first held request makes one call, and while
requests stay held another follows each `wake_cooldown_seconds`, never one
per request. A call never blocks the data path (its own task, a short
timeout); failures are counted (`router_wake_calls_total{model,result}`) and
logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from router.core.clock import Clock, LoopClock, Timer

log = logging.getLogger("router.gateway.wake")

CALL_TIMEOUT_SECONDS = 2.0
_LOG_EVERY_SECONDS = 60.0


class Waker:
    """The wake calls to wake_url for a model that holds requests: one per cooldown, off the request path."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        router: str,
        cooldown: float,
        token: str,
        registry: CollectorRegistry,
        held_now: Callable[[str], tuple[int, float | None]],
        clock: Clock | None = None,
    ) -> None:
        """`held_now(model)`: requests held for it now and since when (Unix seconds) the oldest waits.

        `clock`: the pool's, so that the cooldown runs on the same time as the holds.
        """
        self.session = session
        self.url = url
        self.router = router
        self.cooldown = cooldown
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.held_now = held_now
        self.clock = clock if clock is not None else LoopClock()
        self.calls = Counter(
            "router_wake_calls",
            "Calls to wake_url for a model with held requests, by result: ok, refused (not 2xx), unreachable.",
            ["model", "result"],
            registry=registry,
        )
        # Per model: when the last call went out, and the re-check while requests stay held.
        self._last_call: dict[str, float] = {}
        self._rechecks: dict[str, Timer] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_logged = float("-inf")

    def held(self, model: str) -> None:
        """A request for `model` was just held: call now unless a call went out within the cooldown."""
        last = self._last_call.get(model)
        now = self.clock.now()
        if last is not None and now - last < self.cooldown:
            return
        self._last_call[model] = now
        task = asyncio.get_running_loop().create_task(self._call(model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if model not in self._rechecks:
            self._rechecks[model] = self.clock.call_at(now + self.cooldown, lambda: self._recheck(model))

    def _recheck(self, model: str) -> None:
        del self._rechecks[model]
        if self.held_now(model)[0] > 0:
            self._last_call.pop(model, None)
            self.held(model)

    async def _call(self, model: str) -> None:
        held, since = self.held_now(model)
        body = {"router": self.router, "model": model, "held": held, "since": since}
        try:
            async with self.session.post(
                self.url,
                json=body,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_SECONDS),
            ) as resp:
                result = "ok" if 200 <= resp.status < 300 else "refused"
                detail = f"HTTP {resp.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            result, detail = "unreachable", str(exc) or type(exc).__name__
        self.calls.labels(model, result).inc()
        if result != "ok":
            now = self.clock.now()
            if now - self._last_logged >= _LOG_EVERY_SECONDS:
                self._last_logged = now
                log.warning("wake call for %s to %s failed: %s", model, self.url, detail)

    async def close(self) -> None:
        for handle in self._rechecks.values():
            handle.cancel()
        self._rechecks.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
