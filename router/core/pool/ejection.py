"""Ejection: a replica that fails in a row is out of rotation for a while, then tried again.

The pool counts failures in a row per replica (record_failure(), on the data
path); past the policy's threshold, or when a health check fails, the
replica is ejected here: out of its model's candidates for a time that
doubles with each ejection in a row, never more than half of a model's
replicas at once and never its last one. It comes back when its time is up
(the pool notices in acquire(), without a timer) or when a health check
sees it healthy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.core.pool.replicas import Replica, ReplicaSet

log = logging.getLogger("router.core.pool.ejection")


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """When a replica is ejected (failures in a row) and for how long (doubling from base to max)."""

    consecutive_failures: int = 5
    base_seconds: float = 10.0
    max_seconds: float = 300.0


class Ejections:
    """The replicas out of rotation now, and the soonest end of their ejections."""

    __slots__ = ("ejected", "next_readmit", "policy", "_now", "_replicas")

    def __init__(self, policy: EjectionPolicy, *, now: Callable[[], float], replicas: ReplicaSet) -> None:
        self.policy = policy
        self._now = now
        self._replicas = replicas
        # The pool reads both in acquire(): the list is made once and changed in place.
        self.ejected: list[Replica] = []
        self.next_readmit = float("inf")

    def try_eject(self, replica: Replica, why: str) -> bool:
        """Eject `replica` unless that would take out more than half of its model."""
        if replica.ejected_until is not None or replica.removed or replica.draining:
            return False
        siblings = self._replicas.models.get(replica.model, [])
        ejected = sum(1 for r in siblings if r.ejected_until is not None)
        # Never more than half of a model's replicas, never the last one.
        if ejected + 1 > len(siblings) // 2:
            return False
        seconds = min(self.policy.base_seconds * 2**replica.ejections_in_row, self.policy.max_seconds)
        self.eject(replica, seconds)
        log.warning("ejected replica %s (%s) for %gs: %s", replica.id, replica.model, seconds, why)
        return True

    def eject(self, replica: Replica, seconds: float) -> None:
        replica.ejected_until = self._now() + seconds
        replica.ejections_in_row += 1
        replica.ejections += 1
        replica.failures_in_row = 0
        self.ejected.append(replica)
        self.next_readmit = min(self.next_readmit, replica.ejected_until)
        self._replicas.refresh(replica)

    def readmit(self, replica: Replica, why: str = "ejection time is up") -> None:
        """End an ejection (its time is up, or a health check saw it healthy)."""
        if replica.ejected_until is None:
            return
        replica.ejected_until = None
        replica.recoveries += 1
        log.info("replica %s (%s) back in rotation: %s", replica.id, replica.model, why)
        if replica in self.ejected:
            self.ejected.remove(replica)
        self.next_readmit = min((r.ejected_until or float("inf") for r in self.ejected), default=float("inf"))
        self._replicas.refresh(replica)

    def readmit_expired(self) -> None:
        now = self._now()
        for replica in [r for r in self.ejected if (r.ejected_until or 0.0) <= now]:
            self.readmit(replica)

    def forget_removed(self) -> None:
        """Replicas gone from the desired set are no longer waited for."""
        self.ejected[:] = [r for r in self.ejected if not r.removed]

    def retry_after(self, models: Iterable[str]) -> int:
        """Seconds after which a request for `models`, refused now, may find a replica (Retry-After).

        The soonest end of an ejection among their replicas; else 1 where they
        have replicas (draining ones, or ones that refused: a moment's trouble);
        else 10: none at all, so one must be started first.
        """
        replicas = [r for model in models for r in self._replicas.models.get(model, ())]
        ends = [r.ejected_until for r in replicas if r.ejected_until is not None]
        if ends:
            return max(1, min(60, math.ceil(min(ends) - self._now())))
        return 1 if replicas else 10
