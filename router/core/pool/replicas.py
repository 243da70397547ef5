"""The replica set: each replica as the data path sees it, the desired set, draining, and who may be picked.

A replica changes set only here: added, changed, removed (it drains: no new
request, and it is forgotten once its last one ends), drained by hand. Per
model the set keeps the picking policy (router.core.pool.picking) told of every
ready replica, so that the pool's acquire() finds its candidates in one
lookup. The pool owns the counts in flight and the waiters; it is told when
a model's candidates change in a way its waiters care about.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.core.config.settings import ReplicaConfig
from router.core.pool.learned import LearnedPrefixes
from router.core.pool.loads import EngineLoad, EngineView, Prefills
from router.core.pool.picking import POLICIES, PolicySettings, Routing
from router.core.pool.policy import Policy


class ReplicaState(enum.Enum):
    """A replica's state, as the admin API and the usage map show it."""

    READY = "ready"
    EJECTED = "ejected"
    DRAINING = "draining"
    DRAINED = "drained"
    # Put to sleep by its engine's sleep call (router.core.pool.sleep), and being woken: neither takes requests.
    ASLEEP = "asleep"
    WAKING = "waking"


SLEEPING = frozenset({ReplicaState.ASLEEP.value, ReplicaState.WAKING.value})


def sleep_state(states: Iterable[str]) -> str:
    """One id's sleep state from its records' states: "waking" if one wakes, "asleep" if one sleeps, else ""."""
    found = set(states)
    if ReplicaState.WAKING.value in found:
        return ReplicaState.WAKING.value
    return ReplicaState.ASLEEP.value if ReplicaState.ASLEEP.value in found else ""


class Replica:
    """One replica as the data path sees it. Mutated only by the pool and its parts."""

    __slots__ = (
        "config",
        "id",
        "model",
        "base_url",
        "in_flight",
        "requests",
        "connects_failed",
        "last_used",
        "added_at",
        "draining",
        "removed",
        "ejected_until",
        "failures_in_row",
        "ejections_in_row",
        "ejections",
        "recoveries",
        "responses",
        "errors",
        "engine",
        "load",
        "prefills",
        "adapters",
        "serves_model",
        "asleep",
        "waking",
        "volunteers_usage",
        "unasked_skips",
    )

    def __init__(self, config: ReplicaConfig, added_at: float) -> None:
        self.config = config
        self.id = config.id
        self.model = config.model
        self.base_url = config.url
        self.in_flight = 0
        # Requests that reached the replica (counted once connected), and connections to it that failed.
        self.requests = 0
        self.connects_failed = 0
        # Monotonic time of the last request sent here; None until the first one.
        self.last_used: float | None = None
        self.added_at = added_at
        self.draining = False
        # Gone from the desired set; forgotten once nothing is in flight.
        self.removed = False
        self.ejected_until: float | None = None
        self.failures_in_row = 0
        self.ejections_in_row = 0
        self.ejections = 0
        self.recoveries = 0
        # Upstream answers by status class ("2xx", ...) and failures by reason.
        self.responses: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        # The engine it runs, as configured or recognised from its metrics; None: not known (yet).
        self.engine = config.engine
        # Its engine's last reading of its load, and its large prompts still prefilling (router.core.pool.loads).
        self.load: EngineLoad | None = None
        self.prefills: Prefills | None = None
        # The LoRA adapters its engine lists in /v1/models (router.core.pool.adapters).
        self.adapters: frozenset[str] = frozenset()
        # Whether its /v1/models lists `model`, the name requests are sent under (router.core.config.cards,
        # lists_model); None: not read, or its engine answers under any name.
        self.serves_model: bool | None = None
        # The level its engine was put to sleep at (None: awake), and whether a wake is under way.
        self.asleep: int | None = None
        self.waking = False
        # With count_tokens: whether its engine was seen to send a stream's usage unasked (vLLM's
        # --enable-force-include-usage), and its unasked streams since the last one searched for
        # it (router.gateway.tokens, UNASKED_SAMPLE). Never unlearned: a search costs, a miss loses a count.
        self.volunteers_usage = False
        self.unasked_skips = 0

    @property
    def state(self) -> ReplicaState:
        if self.draining or self.removed:
            return ReplicaState.DRAINING if self.in_flight else ReplicaState.DRAINED
        if self.asleep is not None:
            return ReplicaState.WAKING if self.waking else ReplicaState.ASLEEP
        if self.ejected_until is not None:
            return ReplicaState.EJECTED
        return ReplicaState.READY

    def __repr__(self) -> str:
        return f"Replica({self.id!r}, model={self.model!r}, in_flight={self.in_flight})"

    def count_response(self, status: int) -> None:
        """An answer of this replica's, by status class ("2xx", ...)."""
        index = status // 100 - 1
        status_class = _STATUS_CLASSES[index] if 0 <= index < 5 else "other"
        self.responses[status_class] = self.responses.get(status_class, 0) + 1

    def count_failure(self, reason: str) -> None:
        """A failed attempt on this replica, by reason ("connect", "reset", "timeout", "status")."""
        self.errors[reason] = self.errors.get(reason, 0) + 1


_STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")


@dataclass(frozen=True, slots=True)
class SetDiff:
    """What a new desired set changed: the ids added, removed, changed and kept."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    unchanged: tuple[str, ...]


_LEAST_LOADED = Routing()


class _Batch:
    """One set_replicas(): the policies holding their changes, and the models to tell of them."""

    __slots__ = ("changed", "held")

    def __init__(self) -> None:
        self.held: dict[Policy[Replica], None] = {}
        self.changed: dict[str, None] = {}


def _replica_name(replica: Replica) -> str:
    return replica.id


class ReplicaSet:
    """The desired set, the replicas still leaving it, and per model the policy that picks among the ready ones.

    The pool reads `models`, `candidates` and `leaving` on its hot path: they
    are made once here and never replaced, only changed in place.
    """

    __slots__ = (
        "by_id",
        "candidates",
        "ever_served",
        "joined",
        "holds",
        "judge",
        "takes",
        "least",
        "leaving",
        "models",
        "sleepy",
        "_affinity",
        "_batch",
        "_changed",
        "_now",
        "_per_replica",
        "_rng",
        "_routing",
        "_touched",
    )

    def __init__(
        self,
        *,
        now: Callable[[], float],
        rng: random.Random,
        routing: Mapping[str, Routing],
        per_replica: int,
        affinity: dict[str, list[int]],
        changed: Callable[[str], None],
        touched: dict[Replica, None],
    ) -> None:
        """`changed(model)`: the model gained a candidate, or lost its last one (its waiters may go).

        `affinity`: where each model's policy counts its first picks (Tallies.affinity).
        `touched`: where a replica whose state or labels change is marked for the usage tick.
        """
        self._touched = touched
        self._now = now
        self._rng = rng
        self._routing = routing
        self._per_replica = per_replica
        self._affinity = affinity
        self._changed = changed
        self.by_id: dict[str, Replica] = {}
        # Removed from the desired set but still finishing requests.
        self.leaving: set[Replica] = set()
        self.models: dict[str, list[Replica]] = {}
        self.candidates: dict[str, Policy[Replica]] = {}
        # Per model, its replicas asleep or waking: the request path asks this alone (empty: nothing sleeps).
        self.sleepy: dict[str, int] = {}
        # Every model that had a replica since start: known, so never 404.
        self.ever_served: set[str] = set()
        # Replicas that became ready (added, readmitted, undrained), for a reader that
        # takes them out (Pool.watch_joins); None while no one watches, and nothing is kept.
        self.joined: dict[Replica, None] | None = None
        # The engine-aware score each model's policy picks by (router.core.pool.loads); None: off.
        self.judge: Callable[[Replica], float] | None = None
        # ... and its pick over a model's candidates in one pass (EngineView.least).
        self.least: Callable[[Iterable[Replica], Replica | None, Container[Replica], random.Random], Any] | None = None
        # ... and whether a fresh reading says a replica's engine takes requests in as they come (EngineView.holds).
        self.holds: Callable[[Replica], bool] | None = None
        # ... and whether a fresh reading says nothing waits there (EngineView.takes).
        self.takes: Callable[[Replica], bool] | None = None
        # While a whole set is applied: the policies holding their changes, and
        # the models whose waiters are told once it is in.
        self._batch: _Batch | None = None

    def set_replicas(self, configs: Iterable[ReplicaConfig]) -> SetDiff:
        """Make `configs` the desired set, atomically (no await in here).

        A replica whose URL or model changed is a removal plus an addition; a
        removed one drains: it takes no new request and is forgotten when its
        last request ends. Labels alone change in place.

        The policies lay out what depends on the whole set (a hash ring) once
        for the batch, and the pool's waiters are told of it once it is whole:
        no pick can come between the parts of one set.
        """
        self._batch = batch = _Batch()
        try:
            return self._apply(configs)
        finally:
            self._batch = None
            for policy in batch.held:
                policy.settle()
            for model in batch.changed:
                self._changed(model)

    def _apply(self, configs: Iterable[ReplicaConfig]) -> SetDiff:
        desired = {c.id: c for c in configs}
        by_id = self.by_id
        added: list[str] = []
        removed: list[str] = []
        changed: list[str] = []
        unchanged: list[str] = []
        leaving: list[Replica] = []
        for replica_id, replica in by_id.items():
            config = desired.get(replica_id)
            if config is replica.config:
                # The very config it has (a push's unchanged entry): nothing to compare.
                unchanged.append(replica_id)
            elif config is None:
                removed.append(replica_id)
                leaving.append(replica)
            elif (config.url, config.model) != (replica.base_url, replica.model):
                changed.append(replica_id)
                leaving.append(replica)
            elif config != replica.config:
                changed.append(replica_id)
                replica.config = config
                self._touched[replica] = None
            else:
                # Equal: kept as this object, which the next push of the same entry gives
                # again (and looked at by the next tick, should equal values differ in type).
                replica.config = config
                self._touched[replica] = None
                unchanged.append(replica_id)
        for replica in leaving:
            self._remove(replica)
        if len(by_id) < len(desired):
            now = self._now()
            replaced = set(changed)
            for replica_id, config in desired.items():
                if replica_id in by_id:
                    continue
                if replica_id not in replaced:
                    added.append(replica_id)
                replica = Replica(config, added_at=now)
                self.ever_served.add(replica.model)
                by_id[replica_id] = replica
                self.models.setdefault(replica.model, []).append(replica)
                self.refresh(replica)
        return SetDiff(tuple(added), tuple(removed), tuple(changed), tuple(unchanged))

    def set_draining(self, replica_id: str, draining: bool) -> Replica | None:
        replica = self.by_id.get(replica_id)
        if replica is None:
            return None
        replica.draining = draining
        self.refresh(replica)
        return replica

    def set_sleep(self, replica: Replica, level: int | None, *, waking: bool = False) -> None:
        """Asleep at `level` (its drain ends with it), waking from it, or awake and ready again (None)."""
        if replica.removed:
            # Gone from the pool (a sleep call or a 503 "sleeping" that came back after it left):
            # counted nowhere, or its model would stay one sleepy replica short of the truth.
            return
        if (replica.asleep is None) != (level is None):
            self._count_sleepy(replica.model, 1 if level is not None else -1)
        replica.asleep = level
        replica.waking = waking and level is not None
        if level is not None:
            replica.draining = False
        self.refresh(replica)

    def _count_sleepy(self, model: str, change: int) -> None:
        count = self.sleepy.get(model, 0) + change
        if count > 0:
            self.sleepy[model] = count
        else:
            self.sleepy.pop(model, None)

    def _remove(self, replica: Replica) -> None:
        if replica.asleep is not None:
            self._count_sleepy(replica.model, -1)
            replica.asleep = None
            replica.waking = False
        replica.removed = True
        del self.by_id[replica.id]
        siblings = self.models[replica.model]
        siblings.remove(replica)
        self.refresh(replica)
        if not siblings:
            del self.models[replica.model]
            del self.candidates[replica.model]
            self._tell(replica.model)
        if replica.in_flight:
            self.leaving.add(replica)

    def read_by(self, engines: EngineView) -> None:
        """Policies made from now on pick by the engines' readings (router.core.pool.loads)."""
        self.judge, self.least, self.holds, self.takes = engines.judge, engines.least, engines.holds, engines.takes

    def refresh(self, replica: Replica) -> None:
        """Make `replica` a candidate of its model's policy if it is ready, and no longer one if not.

        Every change of a replica's state comes through here (added, removed,
        drained, ejected, back): marked for the usage tick.
        """
        self._touched[replica] = None
        candidates = self.candidates.get(replica.model)
        if candidates is None:
            if replica.removed:
                return
            routing = self._routing.get(replica.model, _LEAST_LOADED)
            settings = PolicySettings(
                replica.model,
                routing.balance_factor,
                self._per_replica,
                _replica_name,
                self._affinity.setdefault(replica.model, [0, 0, 0]),
                self.judge,
                self.least,
                self.holds,
                routing.policy == "session",
                routing.prefix_replicas,
                routing.policy == "prefix",
                self.takes,
            )
            # prefix_placement = "learned": a prefix's replicas learned, not hashed (router.core.pool.learned).
            policy = LearnedPrefixes if routing.prefix_placement == "learned" else POLICIES[routing.policy]
            candidates = self.candidates[replica.model] = policy(self._rng, settings)
        batch = self._batch
        if batch is not None and candidates not in batch.held:
            candidates.hold()
            batch.held[candidates] = None
        serving = replica.state is ReplicaState.READY
        if serving and replica not in candidates:
            candidates.add(replica, replica.in_flight)
            if self.joined is not None:
                self.joined[replica] = None
            # A new, readmitted or undrained replica: the model's waiters first.
            self._tell(replica.model)
        elif not serving:
            candidates.discard(replica)
            if not len(candidates):
                # The model's last candidate left: its waiters wait for nothing now.
                self._tell(replica.model)

    def _tell(self, model: str) -> None:
        """The pool's waiters for `model` may go: now, or once the batch is whole."""
        if self._batch is not None:
            self._batch.changed[model] = None
        else:
            self._changed(model)

    # Views --------------------------------------------------------------------

    def configs(self) -> list[ReplicaConfig]:
        return [r.config for r in self.by_id.values()]
