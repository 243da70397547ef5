"""The sleep tier on the request path: a request that finds nothing ready wakes a sleeping replica of its model.

A request for a model whose ready replicas are all gone or saturated, while
one of its replicas sleeps, is held as a cold model's is (hold.py: the same
bounds, order and Retry-After; `cold_start_seconds`, or `wake_timeout_seconds`
for a model without one) or waits in the queue at the limits, and the router
wakes a sleeping replica itself: one wake per replica however many wait
(router.core.pool.sleep.Wakes; across `--workers` by a claim in the runtime
directory). Once awake the replica is ready: the pool hands it to the held
and queued requests in their order. While requests keep arriving faster than
the replicas being woken could take them (more waiting than `per_wake` for
each), another is woken. A wake that fails or takes longer than
`wake_timeout_seconds` ejects that replica and the next is tried; with none
left to wake, `wake_url` is told as for a cold model. The replica whose wake
failed stays asleep (its engine sleeps still: it is never handed a request)
and is woken again, by a request that needs it, once its ejection is over.

An engine that answers a request 503 "sleeping" (router.core.pool.sleep,
says_sleeping) is marked asleep here, not counted as a failure of its.
"""

from __future__ import annotations

import asyncio
import logging

from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.pool.sleep import EngineCallFailed, Wakes, says_sleeping
from router.gateway.wake import Waker

log = logging.getLogger("router.gateway.sleepers")

# Requests a replica being woken is counted on taking, when no limit per replica says otherwise.
DEFAULT_PER_WAKE = 8


class Sleepers:
    """Which sleeping replica to wake for a model that waits, and what a failed wake leads to."""

    def __init__(self, pool: Pool, wakes: Wakes, *, wake_timeout: float) -> None:
        self.pool = pool
        self.wakes = wakes
        self.wake_timeout = wake_timeout
        self.per_wake = pool.limits.per_replica or DEFAULT_PER_WAKE
        # wake_url, told when no sleeping replica is left to wake (None: not configured).
        self.waker: Waker | None = None

    def sleepy(self, model: str) -> bool:
        """Whether `model` has a replica asleep or waking: its requests wait for a wake."""
        return model in self.pool.sleepy

    def wanted(self, model: str) -> None:
        """Requests for `model` wait: wake a sleeping replica unless enough are waking for them."""
        pool = self.pool
        replicas = pool.replicas_of(model)
        waking = sum(1 for r in replicas if self.wakes.under_way(r))
        if waking:
            waiting = pool.cold_start.held(model) + pool.queued().get(model, 0)
            if waiting <= waking * self.per_wake:
                return
        for replica in replicas:
            if self._wakeable(replica):
                self._wake(replica)
                return
        if not waking and self.waker is not None:
            # Every sleeper's wake failed a moment ago (or none is left): the control plane's turn.
            self.waker.held(model)

    def _wakeable(self, replica: Replica) -> bool:
        """Asleep and not being woken; one whose wake failed waits out its ejection before it is tried again."""
        if replica.asleep is None or replica.removed or self.wakes.under_way(replica):
            return False
        until = replica.ejected_until
        return until is None or until <= self.pool.clock.now()

    def _wake(self, replica: Replica) -> None:
        task = self.wakes.wake(replica, self.wake_timeout)
        task.add_done_callback(lambda done: self._woken(replica, done))

    def _woken(self, replica: Replica, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        # Failed or too slow: its engine still sleeps, so it stays asleep (Wakes put it back), never ready,
        # until a wake succeeds. The ejection counts the failure and keeps it from being woken again
        # for an ejection's time (doubling in a row); the next sleeper is tried meanwhile.
        log.warning("replica %s (%s) did not wake: %s", replica.id, replica.model, error)
        if not isinstance(error, EngineCallFailed):
            log.error("waking replica %s failed unexpectedly", replica.id, exc_info=error)
        pool = self.pool
        if not replica.removed and replica.ejected_until is None:
            ejections = pool.ejections
            policy = ejections.policy
            ejections.eject(replica, min(policy.base_seconds * 2**replica.ejections_in_row, policy.max_seconds))
        model = replica.model
        if pool.cold_start.held(model) + pool.queued().get(model, 0) == 0:
            return
        # wanted() wakes the next sleeper, or with none left tells wake_url, as for a cold model.
        self.wanted(model)

    def found_asleep(self, replica: Replica, body: bytes) -> bool:
        """Whether its 503 `body` says it sleeps; if so it is asleep from now (its level not known: 1)."""
        if not says_sleeping(503, body):
            return False
        if replica.asleep is None and not self.wakes.under_way(replica):
            self.pool.set_sleep(replica, 1)
            self.wakes.count("found_asleep", "ok")
        return True
