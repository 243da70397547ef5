"""The pool: acquire()/release(), last-used stamps, the limits, and each model's line of waiting requests.

Everything that the data path touches per request happens in `acquire()` and
`release()`, which are synchronous: on one event loop a function without an
`await` is a critical section, so choosing the replica, counting it in flight
and stamping its last use cannot interleave with another request or with the
usage tick. Everything else (views, snapshots, pushes) reads from here and
runs per tick or per admin call, never per request.

The pool is the one door to its parts, each in its own module: the replica
set and draining (router.core.pool.replicas), ejection (router.core.pool.ejection),
the cold-start holds (router.core.pool.coldstart), the queue at the limits
(router.core.pool.queues, in the order of router.core.pool.fairness), the requests
pinned to one replica (router.core.pool.pinned) and the tallies
(router.core.pool.tallies). It keeps its own reference to each collection that
acquire() and release() read, so the hot path reads no more attributes than
it would if the parts were one class. All of them read one injected clock
(router.core.clock).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Container, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from router.core.clock import Clock, LoopClock
from router.core.config.settings import ReplicaConfig
from router.core.config.tenants import Queueing
from router.core.pool.adapters import Adapters
from router.core.pool.coldstart import ColdStart
from router.core.pool.ejection import EjectionPolicy, Ejections
from router.core.pool.fairness import Lines
from router.core.pool.loads import LARGE_PROMPT_TOKENS, EngineView
from router.core.pool.picking import Routing
from router.core.pool.pinned import PinnedLines
from router.core.pool.policy import Policy
from router.core.pool.queues import Queues
from router.core.pool.replicas import Replica, ReplicaSet, ReplicaState, SetDiff
from router.core.pool.saturation import EngineLoads
from router.core.pool.tallies import Tallies

_NO_ROUTING: Mapping[str, Routing] = {}
_LOOP_CLOCK = LoopClock()
_DEFAULT_EJECTION = EjectionPolicy()
_DEFAULT_QUEUEING = Queueing()


@dataclass(frozen=True, slots=True)
class Limits:
    """Concurrency limits; 0 = none. Beyond them requests wait in a bounded queue."""

    per_replica: int = 0
    total: int = 0


class Pool:
    """The replicas of every model, as the data path takes and gives them back; the one door to its parts."""

    def __init__(
        self,
        replicas: Iterable[ReplicaConfig] = (),
        *,
        clock: Clock = _LOOP_CLOCK,
        rng: random.Random | None = None,
        ejection: EjectionPolicy = _DEFAULT_EJECTION,
        limits: Limits = Limits(),
        routing: Mapping[str, Routing] = _NO_ROUTING,
        queueing: Queueing = _DEFAULT_QUEUEING,
        engines: EngineView | None = None,
    ) -> None:
        """`routing`: the picking policy per model; least-loaded otherwise. `queueing`: the order of its queue.
        `engines`: how the engines' readings weigh in picks and saturate replicas; None: engine metrics are off."""
        self.clock = clock
        # The clock's reading itself, bound once: acquire() calls it per request.
        self._now = clock.now
        self.tallies = Tallies()
        self.limits = limits
        self.in_flight = 0
        # Requests waiting for a replica, per model (router.core.pool.fairness). A
        # slot that frees is handed straight to the waiter whose turn it is (no
        # wake-up to lose, no newcomer to overtake it); a waiter that leaves
        # is removed in O(1). Held requests wait in the same lines.
        self._waiting = Lines(queueing)
        self._seq = itertools.count()
        # Replicas whose usage may have changed since the usage tick last looked
        # (router.core.usage.snapshots): marked where they change, in the critical
        # sections that change them, so that a tick looks at these alone.
        self.touched: dict[Replica, None] = {}
        self._set = ReplicaSet(
            now=self._now,
            rng=rng or random.Random(),
            routing=routing,
            per_replica=limits.per_replica,
            affinity=self.tallies.affinity,
            changed=self._candidates_changed,
            touched=self.touched,
        )
        self._by_id = self._set.by_id
        self._leaving = self._set.leaving
        self._models = self._set.models
        self._candidates = self._set.candidates
        # Per model, how many of its replicas are asleep or waking (the sleep tier; empty: none).
        self.sleepy = self._set.sleepy
        # Every model that had a replica since start: known, so never 404.
        self.ever_served = self._set.ever_served
        self.engines = engines
        # The engines' readings as they come (router.core.pool.saturation); None: engine metrics are off.
        self.engine_loads: EngineLoads | None = None
        self.ejection = ejection
        self.ejections = Ejections(ejection, now=self._now, replicas=self._set)
        self._ejected = self.ejections.ejected
        self.queues = Queues(
            clock,
            self._waiting,
            seq=self._seq.__next__,
            acquire=self.acquire,
            release=self.release,
            saturated=self.saturated,
        )
        self.cold_start = ColdStart(
            clock,
            self.tallies,
            lines=self._waiting,
            seq=self._seq.__next__,
            acquire=self.acquire,
            release=self.release,
            hand_off=self._hand_off,
        )
        # Models whose held requests wait for a replica that answers.
        self._cold = self.cold_start.cold
        if engines is not None:
            self._set.read_by(engines)
            self.engine_loads = EngineLoads(
                engines, clock, self._candidates, self._waiting, self.touched, hand_off=self._hand_off
            )
        # The LoRA adapters the replicas list, and which replicas list each (router.control.cards learns them).
        self.adapters = Adapters()
        self.pinned = PinnedLines(clock, self._by_id, self._seq.__next__, self.acquire_this, self.release)
        self._pinned = self.pinned.lines
        self.set_replicas(replicas)

    # The hot path -----------------------------------------------------------

    def acquire(
        self,
        model: str,
        avoid: Replica | None = None,
        exclude: Container[Replica] = (),
        key: Hashable | None = None,
        tokens: int = 0,
    ) -> Replica | None:
        """Pick a ready replica of `model` by its policy, count it, stamp it.

        `key` is the request's affinity key (a session, a prompt prefix) for
        the policies that use one; least-loaded ignores it.

        On a retry, `avoid` is the replica that just failed: chosen again only
        when no other can serve (a stale keep-alive connection deserves a
        second try). `exclude` are replicas that this request must not reach
        again (they refused the connection or answered 503). `tokens`: about
        how many prompt tokens the request carries (a large prompt weighs in
        the next picks while its prefill runs, router.core.pool.loads).
        """
        if self._ejected and self._now() >= self.ejections.next_readmit:
            self.ejections.readmit_expired()
        candidates = self._candidates.get(model)
        if candidates is None:
            return None
        retry = avoid is not None or exclude
        replica = candidates.pick_avoiding(avoid, exclude, key) if retry else candidates.pick(key)
        if replica is None:
            return None
        limits = self.limits
        if limits.per_replica and replica.in_flight >= limits.per_replica:
            return None
        if limits.total and self.in_flight >= limits.total:
            return None
        self.in_flight += 1
        candidates.increment(replica)
        replica.in_flight += 1
        replica.last_used = self._now()
        self.touched[replica] = None
        # (A large prompt only: the test written out, as this runs on every request.)
        if tokens >= LARGE_PROMPT_TOKENS and self.engines is not None:
            self.engines.sent(replica, tokens)
        return replica

    def acquire_this(self, replica_id: str) -> Replica | None:
        """acquire() of one given replica (the one that keeps a response), limits and all: None unless it is ready."""
        replica = self._by_id.get(replica_id)
        if replica is None or replica.state is not ReplicaState.READY:
            return None
        limits = self.limits
        if (limits.per_replica and replica.in_flight >= limits.per_replica) or (
            limits.total and self.in_flight >= limits.total
        ):
            return None
        candidates = self._candidates.get(replica.model)
        if candidates is not None:
            candidates.increment(replica)
        self.in_flight += 1
        replica.in_flight += 1
        replica.last_used = self._now()
        self.touched[replica] = None
        return replica

    def release(self, replica: Replica) -> None:
        """Always called once per acquire(), in a `finally`."""
        replica.in_flight -= 1
        self.in_flight -= 1
        candidates = self._candidates.get(replica.model)
        # (decrement() says whether it is a candidate: no `in` asked first, on every request.)
        if (candidates is None or not candidates.decrement(replica)) and replica.removed and replica.in_flight == 0:
            self._leaving.discard(replica)
        if self._pinned:  # first those that this replica alone may serve: the others may take any
            self.pinned.released(replica, bool(self.limits.total))
        if self._waiting:
            self._hand_off(replica.model)
            if self.limits.total:
                # A slot under the router-wide limit frees for every model.
                for model in sorted(self._waiting, key=self.queues.oldest_seq):
                    self._hand_off(model)

    # Waiting (router.core.pool.queues) ------------------------------------------------

    def queued(self) -> dict[str, int]:
        """Requests waiting now, by model: in the queue at the limits and for a pinned replica."""
        counts = self.queues.queued()
        self.pinned.count_into(counts)
        return counts

    def _hand_off(self, model: str) -> None:
        """Give what `model` can serve now to its waiters, in their order."""
        probing = self._cold.get(model)
        if probing is not None:
            # A cold model's waiters go one probe at a time, never all at once.
            if self._waiting.get(model):
                self.cold_start.probe_soon(model, probing, 0.0)
            return
        self.queues.serve(model)

    def _candidates_changed(self, model: str) -> None:
        if self._waiting:
            self._hand_off(model)

    def saturated(self, model: str) -> bool:
        """True when `model` could serve but every candidate is at a limit, or its engine saturated."""
        return self.why_saturated(model) is not None

    def why_saturated(self, model: str) -> str | None:
        """Why `model` cannot serve now though it has candidates: "limit" (max_in_flight, or every
        candidate at max_in_flight_per_replica) or "engines" (every engine at its bounds); None: it can."""
        candidates = self._candidates.get(model)
        if candidates is None or not len(candidates):
            return None
        if self.limits.total and self.in_flight >= self.limits.total:
            return "limit"
        lowest = candidates.lowest_load
        if bool(self.limits.per_replica) and lowest is not None and lowest >= self.limits.per_replica:
            return "limit"
        if self.engine_loads is not None and self.engine_loads.saturated(model, candidates):
            return "engines"
        return None

    # Counters, demand and health -------------------------------------------------

    def asked(self, model: str) -> None:
        """A request for `model` found nothing to serve it now: demand the control plane should see."""
        self.tallies.asked(model, self._now())

    # The replica's own counters, changed through the pool like every replica field.
    def count_response(self, replica: Replica, status: int) -> None:
        replica.count_response(status)

    def count_failure(self, replica: Replica, reason: str) -> None:
        replica.count_failure(reason)

    def record_success(self, replica: Replica) -> None:
        if self._cold and replica.model in self._cold:
            self.cold_start.warm(replica.model)
        replica.failures_in_row = 0
        if replica.ejected_until is None:
            replica.ejections_in_row = 0

    def record_failure(self, replica: Replica) -> bool:
        """Count a failure that says the replica is unwell; True if it was ejected."""
        replica.failures_in_row += 1
        if replica.failures_in_row < self.ejection.consecutive_failures:
            return False
        return self.ejections.try_eject(replica, f"{replica.failures_in_row} failures in a row")

    # The desired set (router.core.pool.replicas) -------------------------------------

    def set_replicas(self, configs: Iterable[ReplicaConfig]) -> SetDiff:
        """Make `configs` the desired set, atomically (no await in here); removed replicas drain."""
        diff = self._set.set_replicas(configs)
        self.ejections.forget_removed()
        return diff

    def watch_joins(self) -> dict[Replica, None]:
        """The replicas that become ready from now on (added, readmitted, undrained), in order,
        starting with every replica ready now: the caller takes them out as it deals with them.

        For a reader that acts on a replica's arrival (the model cards), at the cost
        of the arrivals alone: no scan of the fleet to find them.
        """
        joined = self._set.joined
        if joined is None:
            joined = self._set.joined = {r: None for r in self._by_id.values() if r.state is ReplicaState.READY}
        return joined

    def set_draining(self, replica_id: str, draining: bool) -> Replica | None:
        """Drain a replica by hand (no new requests; those in flight finish), or make it ready again."""
        return self._set.set_draining(replica_id, draining)

    def set_sleep(self, replica: Replica, level: int | None, *, waking: bool = False) -> None:
        """Asleep at `level` (not a candidate; the drain that led there ends), waking, or awake (None): ready."""
        self._set.set_sleep(replica, level, waking=waking)

    def replicas_of(self, model: str) -> list[Replica]:
        """`model`'s replicas in the desired set, in its order."""
        return self._models.get(model, [])

    def configs(self) -> list[ReplicaConfig]:
        """The desired set, as configured."""
        return self._set.configs()

    def get(self, replica_id: str) -> Replica | None:
        return self._by_id.get(replica_id)

    def __iter__(self) -> Iterator[Replica]:
        """Every replica the router knows, the leaving ones included."""
        yield from self._by_id.values()
        yield from self._leaving

    def __len__(self) -> int:
        return len(self._by_id)

    def models(self) -> list[str]:
        """Models with at least one replica in the desired set."""
        return list(self._models)

    def candidates_by_model(self) -> list[tuple[str, Policy[Replica]]]:
        """Each model with ready replicas, and its policy over them (what the engines' reader walks)."""
        return list(self._candidates.items())

    def lacking(self, model: str, adapter: str) -> set[Replica]:
        """The ready replicas of `model` that do not list `adapter`: where a request for it must not go."""
        candidates = self._candidates.get(model)
        return set() if candidates is None else self.adapters.lacking(adapter, candidates)

    def serves(self, model: str) -> bool:
        return model in self._models
