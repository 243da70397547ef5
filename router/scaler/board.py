"""The newest round's view, the routers' wake calls, and the changes that streams wait for.

A wake call (a router's `wake_url` pointed at the scaler) says that router
R holds a request for model M since `since`. R's usage map shows it only
from its next tick on, so the call itself makes M active at once, until a
round brings a snapshot of R taken at or after `since` (from then on the
map tells: held, served and in flight, or gone), or for `WAKE_SECONDS` when
no such snapshot comes (a router the scaler does not poll; it calls again
each `wake_cooldown_seconds` while requests stay held).

A view older than `stale_after` (rounds that break, a polling task that
stopped) proves nothing any more: every model is active until a round
renews it, and streams are woken to say so.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from router.scaler.view import Decision, FleetView, Query, decide

WAKE_SECONDS = 60.0
# Wake calls held at once, one per (model, router); POST /wake is open when no token is set.
MAX_WAKES = 10_000
# ScaledObjects whose last answer is kept for /healthz (KEDA names them; the oldest go first).
MAX_TOLD = 10_000


@dataclass(frozen=True, slots=True)
class Told:
    """What a ScaledObject was last told, and why."""

    model: str
    active: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Wake:
    """A wake call a router made for a model, as the scaler keeps it."""

    router: str
    # The router's Unix seconds of its oldest held request; None if it did not say.
    since: float | None
    # Monotonic time after which the call is forgotten unless a round confirmed it first.
    until: float


class Board:
    """What the scaler knows now: the merged usage, the wake calls, and the streams that wait on changes."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        stale_after: float = math.inf,
        max_wakes: int = MAX_WAKES,
    ) -> None:
        self._clock = clock
        self._stale_after = stale_after
        self._max_wakes = max_wakes
        self.view: FleetView | None = None
        # Monotonic time the newest view's round ended.
        self.taken_at: float | None = None
        # model -> router -> its newest call: a router calling again replaces its call.
        self._wakes: dict[str, dict[str, Wake]] = {}
        self._wake_count = 0
        # Wake calls received per model, ever: a stream pushes true again after each (service.py).
        self._calls: dict[str, int] = {}
        # "namespace/name" -> its last answer.
        self.told: dict[str, Told] = {}
        # model -> its ScaledObject's sleepAfter, as KEDA last sent it.
        self.sleep_after: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._closed = asyncio.Event()
        self.streams = 0

    def publish(self, view: FleetView) -> None:
        self.view = view
        self.taken_at = self._clock()
        now = self.taken_at
        for model in list(self._wakes):
            left = {r: w for r, w in self._wakes[model].items() if w.until > now and not _confirmed(w, view)}
            self._wake_count -= len(self._wakes[model]) - len(left)
            if left:
                self._wakes[model] = left
            else:
                del self._wakes[model]
        self._notify()

    def wake(self, model: str, router: str, since: float | None) -> bool:
        """A router holds a request for `model`; False when the board holds as many calls as it may."""
        calls = self._wakes.get(model, {})
        if router not in calls:
            if self._wake_count >= self._max_wakes:
                return False
            self._wake_count += 1
        self._wakes[model] = calls
        calls[router] = Wake(router, since, self._clock() + WAKE_SECONDS)
        if model in self._calls or len(self._calls) < self._max_wakes:
            self._calls[model] = self._calls.get(model, 0) + 1
        self._notify()
        return True

    def wake_calls(self, model: str) -> int:
        """Wake calls received for `model` so far."""
        return self._calls.get(model, 0)

    def woken(self, model: str) -> bool:
        now = self._clock()
        return any(w.until > now for w in self._wakes.get(model, {}).values())

    def tell(self, scaled_object: str, query: Query) -> tuple[Decision, bool]:
        """The decision for a ScaledObject, kept for /healthz; and whether it differs from what it was told last."""
        if query.sleep_after is not None:
            # Its replicas sleep once proven quiet this long (poller.py puts them to sleep).
            if query.model in self.sleep_after or len(self.sleep_after) < MAX_TOLD:
                self.sleep_after[query.model] = query.sleep_after
        else:
            self.sleep_after.pop(query.model, None)
        decision = self.decide(query)
        last = self.told.pop(scaled_object, None)
        if last is None and len(self.told) >= MAX_TOLD:
            del self.told[next(iter(self.told))]
        self.told[scaled_object] = Told(query.model, decision.active, decision.reason)
        return decision, last is None or last.active != decision.active or last.model != query.model

    def pending_wakes(self) -> int:
        """Wake calls held: one per model and router until a round settles it or it expires."""
        return self._wake_count

    def decide(self, query: Query) -> Decision:
        if self.taken_at is not None and (age := self._clock() - self.taken_at) > self._stale_after:
            return Decision(True, f"the newest finished round is {age:.0f} s old (rounds are failing: see the log)")
        return decide(self.view, query, woken=self.woken(query.model))

    async def changes(self) -> AsyncIterator[None]:
        """Yields at once, then after each new round or wake call, until close(): the caller reads the board."""
        timeout = None if math.isinf(self._stale_after) else self._stale_after
        while not self._closed.is_set():
            # Taken before the yield, so that a change while the caller works is not missed.
            changed = self._changed
            yield
            # No change for that long: the view may have gone stale, which is a change too.
            try:
                async with asyncio.timeout(timeout):
                    await changed.wait()
            except TimeoutError:
                pass

    def close(self) -> None:
        """The scaler stops: every stream waiting for a change ends."""
        self._closed.set()
        self._notify()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _confirmed(wake: Wake, view: FleetView) -> bool:
    taken = view.snapshots.get(wake.router)
    return wake.since is not None and taken is not None and taken >= wake.since
