"""The pool's queue: requests that wait while every replica of their model is at its limits.

A slot that frees is handed straight to the request whose turn it is
(router.core.pool.fairness: by class, aged, then the tenants in proportion to
their weights), so there is no wake-up to lose and no newcomer to overtake
it. A request leaves at its class's deadline (the caller answers 503
server_overloaded), or when its client goes. A tenant with
`max_queued_per_tenant` requests queued for a model gets 429 for one more,
so that its flood cannot fill the queue for the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Hashable
from typing import NamedTuple

from router.core.clock import Clock
from router.core.config.tenants import ANYONE, Caller
from router.core.errors import RateLimited
from router.core.pool.fairness import Lines
from router.core.pool.replicas import Replica
from router.core.pool.waiters import Charge, Waiter, handed


class QueueFigures(NamedTuple):
    """One tenant's requests queued for a model in one class."""

    queued: int
    # Monotonic time the oldest of them began waiting; None when none waits.
    oldest_since: float | None


class Queues:
    """Every model's queued requests: how they wait, and who gets a slot that frees."""

    __slots__ = ("_acquire", "_clock", "_lines", "_release", "_saturated", "_seen", "_seq")

    def __init__(
        self,
        clock: Clock,
        lines: Lines,
        *,
        seq: Callable[[], int],
        acquire: Callable[[str, Replica | None, Container[Replica], Hashable | None], Replica | None],
        release: Callable[[Replica], None],
        saturated: Callable[[str], bool],
    ) -> None:
        """The pool's: its lines, its arrival numbers, and its acquire(), release() and saturated()."""
        self._clock = clock
        self._lines = lines
        self._seq = seq
        self._acquire = acquire
        self._release = release
        self._saturated = saturated
        # (model, class rank, tenant) that ever queued: their series stay, at 0 once empty.
        self._seen: set[tuple[str, int, str]] = set()

    async def acquire_or_wait(
        self,
        model: str,
        avoid: Replica | None = None,
        exclude: Container[Replica] = (),
        *,
        wait_seconds: float,
        key: Hashable | None = None,
        caller: Caller = ANYONE,
        priority: int | None = None,
        charge: Charge | None = None,
    ) -> tuple[Replica | None, bool]:
        """acquire(), or wait up to `wait_seconds` in `model`'s queue while it is saturated.

        `caller` is whose request it is; `priority` the rank of its class
        (default: the caller's); `charge` its cost in tokens, when the shares
        count tokens. Returns (replica, timed_out): a replica; or
        None and False when no replica can take the request (none ready, or
        all excluded); or None and True when every candidate stayed at its
        limit until the deadline. Raises RateLimited when the caller's tenant
        has max_queued_per_tenant requests queued for `model` already.
        """
        replica = self._acquire(model, avoid, exclude, key)
        if replica is not None or not self._saturated(model):
            return replica, False
        lines = self._lines
        bound = lines.queueing.max_queued_per_tenant
        line = lines.get(model)
        if bound and line is not None and line.queued_of(caller.tenant) >= bound:
            raise RateLimited(
                f"Tenant '{caller.tenant}' has {bound} requests waiting for '{model}' already, its bound "
                "(max_queued_per_tenant); retry once some are served.",
                retry_after=1,
            )
        rank = caller.priority if priority is None else priority
        now = self._clock.now()
        waiter = Waiter(
            asyncio.get_running_loop().create_future(),
            model,
            avoid,
            exclude,
            self._seq(),
            since=now,
            key=key,
            caller=caller,
            priority=rank,
            charge=charge,
        )
        self._seen.add((model, rank, caller.tenant))
        return await self._wait(waiter, now + wait_seconds)

    async def _wait(self, waiter: Waiter, deadline: float) -> tuple[Replica | None, bool]:
        model = waiter.model
        future = waiter.future
        line = self._lines.open(model)
        line.add(waiter)
        timer = self._clock.call_at(deadline, lambda: _expire(waiter))
        try:
            replica = await handed(future, self._release)
        finally:
            timer.cancel()
            line.discard(waiter)
            self._lines.close(model, line)
        return replica, waiter.expired

    def serve(self, model: str) -> None:
        """Give what `model` can serve now to its waiters, each slot to the one whose turn it is."""
        # An emptied line may stay until its last waiter's own cleanup: next() finds nobody there.
        line = self._lines.get(model)
        if line is None:
            return
        now = self._clock.now
        saturated = self._saturated
        # Saturated: every candidate at a limit, so no waiter could be served;
        # asked first, it spares a pick and a try for each slot handed over.
        while not saturated(model) and (waiter := line.next(now)) is not None:
            replica = self._acquire(model, waiter.avoid, waiter.exclude, waiter.key)
            if replica is None and waiter.hold:
                # A held request waits for a replica, never for None; those behind it wait their turn.
                return
            line.take(waiter, served=replica is not None)
            # A replica, or None: nothing left that this waiter may use.
            waiter.future.set_result(replica)

    def waiting(self, model: str) -> int:
        """Requests waiting for a replica of `model` now."""
        line = self._lines.get(model)
        return len(line) if line else 0

    def queued(self) -> dict[str, int]:
        """Requests waiting now, by model (only models with some)."""
        return {model: len(line) for model, line in self._lines.items() if line}

    def oldest_seq(self, model: str) -> int:
        """The arrival number of `model`'s oldest waiting request (the router-wide limit serves the oldest first)."""
        line = self._lines.get(model)
        return line.oldest_seq() if line else -1

    def figures(self) -> dict[tuple[str, str, str], QueueFigures]:
        """Queued requests by (model, class, tenant): every one that ever queued, at 0 once empty."""
        names = [c.name for c in self._lines.queueing.classes]
        out = {(model, names[rank], tenant): QueueFigures(0, None) for model, rank, tenant in self._seen}
        for model, line in self._lines.items():
            for flow in line.flows():
                out[(model, names[flow.band], flow.tenant)] = QueueFigures(
                    len(flow.waiters), next(iter(flow.waiters)).since
                )
        return out


def _expire(waiter: Waiter) -> None:
    """A queued request's deadline passed before a replica was handed over: it gets None, and timed out."""
    if not waiter.future.done():
        waiter.expired = True
        waiter.future.set_result(None)
