"""Usage snapshots, the tick that takes them, and the merge of several routers.

The data path only stamps `Replica.last_used` (a monotonic time) in acquire().
Once a tick, a `Snapshotter` turns the stamps into Unix seconds and freezes
them with everything an exporter may want; sinks read only the snapshot.

Unknown is not idle: a replica that no request has reached since this router
started (or since the replica was added) has `last_used is None`, and every
function here that answers "how long quiet" returns None for it, never 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, cast

from router.core.config import LabelValue
from router.core.picking import AFFINITY_OUTCOMES
from router.core.pool import Pool
from router.core.replicas import Replica, ReplicaState

log = logging.getLogger("router.core.usage")


class ReplicaUsage(NamedTuple):
    """One replica in a snapshot. A tuple: a tick builds thousands of these,
    and a tuple is built in C where a frozen dataclass sets each field in Python."""

    id: str
    model: str
    url: str
    state: str
    in_flight: int
    requests: int
    # Unix seconds of the last request sent there; None = unknown (never 0).
    last_used: float | None
    watching_since: float
    labels: Mapping[str, LabelValue]
    responses: Mapping[str, int]
    errors: Mapping[str, int]
    ejections: int
    recoveries: int = 0
    # Connections to the replica that failed (refused, timed out): nothing reached it, so none is in `requests`.
    connects_failed: int = 0

    def quiet_seconds(self, now: float) -> float | None:
        """Seconds since the last request, or None when no request is known."""
        if self.last_used is None:
            return None
        return max(0.0, now - self.last_used)


# The snapshot's per-model tallies keyed by a model name, those keyed by a
# pair, and a replica's fields that are mappings: the JSON codec's shape.
TALLIES_BY_MODEL = ("retries", "unserved", "stalled", "overloaded")
TALLIES_BY_PAIR = ("fallbacks", "hold_outcomes", "hold_probes", "affinity")
REPLICA_MAPPINGS = ("labels", "responses", "errors")


def _pairs(rows: list[list[Any]]) -> Mapping[tuple[str, str], int]:
    return MappingProxyType({(a, b): n for a, b, n in rows})


class Demand(NamedTuple):
    """A model that clients want and no replica serves now: held requests, or asked-for in vain."""

    held: int
    # Unix seconds the oldest held request began waiting; None with none held.
    oldest_held_since: float | None
    # Unix seconds of the last request that nothing could serve at once; None if none since the last tick.
    last_asked: float | None


@dataclass(frozen=True, slots=True)
class UsageSnapshot:
    router: str
    started_at: float
    generated_at: float
    tick_seconds: float
    replicas: tuple[ReplicaUsage, ...]
    retries: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    fallbacks: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    unserved: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    stalled: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    overloaded: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    hold_outcomes: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    # Held requests' tries of their model's replicas, by (model, outcome): refused, loading, answered.
    hold_probes: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    # Session and prefix routing's first picks, by (model, outcome): hit, spill, none.
    affinity: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    demand: Mapping[str, Demand] = field(default_factory=lambda: MappingProxyType({}))
    # Requests waiting now for a slot under the limits (max_in_flight, max_in_flight_per_replica), by model.
    queued: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def to_json(self) -> dict[str, Any]:
        """The whole snapshot as JSON (a worker's report to its supervisor); from_json() reads it back."""
        return {
            "router": self.router,
            "started_at": self.started_at,
            "generated_at": self.generated_at,
            "tick_seconds": self.tick_seconds,
            "replicas": [
                {**r._asdict(), **{name: dict(getattr(r, name)) for name in REPLICA_MAPPINGS}} for r in self.replicas
            ],
            **{name: [[a, b, n] for (a, b), n in getattr(self, name).items()] for name in TALLIES_BY_PAIR},
            **{name: dict(getattr(self, name)) for name in TALLIES_BY_MODEL},
            "demand": {model: list(d) for model, d in self.demand.items()},
            "queued": dict(self.queued),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> UsageSnapshot:
        return cls(
            router=doc["router"],
            started_at=doc["started_at"],
            generated_at=doc["generated_at"],
            tick_seconds=doc["tick_seconds"],
            replicas=tuple(
                ReplicaUsage(**{**r, **{name: MappingProxyType(r[name]) for name in REPLICA_MAPPINGS}})
                for r in doc["replicas"]
            ),
            fallbacks=_pairs(doc["fallbacks"]),
            hold_outcomes=_pairs(doc["hold_outcomes"]),
            hold_probes=_pairs(doc["hold_probes"]),
            affinity=_pairs(doc["affinity"]),
            **{name: MappingProxyType(doc[name]) for name in TALLIES_BY_MODEL},
            demand=MappingProxyType({model: Demand(*d) for model, d in doc["demand"].items()}),
            queued=MappingProxyType(doc["queued"]),
        )

    def report(self) -> RouterReport:
        """This snapshot as one router's report to the merge (what GET /api/v1/usage says)."""
        doc = self.usage_document()
        return RouterReport(
            server=self.router,
            last_used=cast(dict[str, float], doc["last_used"]),
            watching_since=cast(dict[str, float], doc["watching_since"]),
            generated_at=self.generated_at,
            held={model: d.held for model, d in self.demand.items()},
        )

    def quiet_for(self) -> Mapping[str, float | None]:
        """Per replica, how long it has provably been quiet as of this snapshot.

        The merge of `router ctl idle` over this one router: every view of
        idleness (status, replicas, /metrics) reads this, so none can say
        otherwise. No request reached the replica after
        max(last_used, watching_since), whether or not it ever had a stamp.
        """
        return merge_reports([self.report()], now=self.generated_at, idle_for=math.inf).quiet_for

    def usage_document(self) -> dict[str, object]:
        """The body of GET /api/v1/usage and of the usage push."""
        last_used: dict[str, float] = {}
        watching: dict[str, float] = {}
        for r in self.replicas:
            # A replica id being replaced (URL changed) may appear twice while
            # the old one drains: the newest stamp and the later watch win.
            if r.last_used is not None and r.last_used > last_used.get(r.id, -1.0):
                last_used[r.id] = r.last_used
            if r.id not in watching or r.watching_since > watching[r.id]:
                watching[r.id] = r.watching_since
        return {
            "router": self.router,
            "started_at": self.started_at,
            "generated_at": self.generated_at,
            "tick_seconds": self.tick_seconds,
            "last_used": last_used,
            "watching_since": watching,
            "demand": {
                model: {"held": d.held, "oldest_held_since": d.oldest_held_since, "last_asked": d.last_asked}
                for model, d in self.demand.items()
            },
        }


class Snapshotter:
    """Freezes the pool's state; monotonic stamps become Unix seconds here, once.

    A replica with requests in flight is in use right now, so its stamp is
    moved to this tick: a 20-minute generation never looks 20 minutes idle,
    and the stamp stays there after the request ends.

    A replica that nothing has touched since the last snapshot keeps its
    frozen record, so that a tick over a mostly quiet fleet of thousands
    costs a tuple comparison per replica. Every change that matters moves
    `requests` or `in_flight` (counters change only between acquire() and
    release()) or one of the state fields in the key.
    """

    def __init__(self, pool: Pool, *, router: str, started_at: float, tick_seconds: float) -> None:
        self.pool = pool
        self.router = router
        self.started_at = started_at
        self.tick_seconds = tick_seconds
        self._frozen: dict[Replica, tuple[tuple[object, ...], ReplicaUsage]] = {}
        # Monotonic time of the previous snapshot: demand asked since then is shown.
        self._previous = float("-inf")

    def take(self, *, wall: float, mono: float) -> UsageSnapshot:
        offset = wall - mono
        started_at = self.started_at
        previous = self._frozen
        frozen: dict[Replica, tuple[tuple[object, ...], ReplicaUsage]] = {}
        replicas: list[ReplicaUsage] = []
        append = replicas.append
        get = previous.get
        build = tuple.__new__
        draining, drained = ReplicaState.DRAINING.value, ReplicaState.DRAINED.value
        ejected, ready = ReplicaState.EJECTED.value, ReplicaState.READY.value
        for r in self.pool:
            in_flight = r.in_flight
            if in_flight > 0:
                r.last_used = mono
            last_used = r.last_used
            ejected_until = r.ejected_until
            key = (
                r.requests,
                in_flight,
                last_used,
                ejected_until,
                r.draining,
                r.removed,
                r.config,
                r.recoveries,
                r.connects_failed,
            )
            known = get(r)
            if known is not None and known[0] == key:
                usage = known[1]
            else:
                # Replica.state, inlined: this loop runs over every replica.
                if r.draining or r.removed:
                    state = draining if in_flight else drained
                else:
                    state = ready if ejected_until is None else ejected
                watching = r.added_at + offset
                usage = build(
                    ReplicaUsage,
                    (
                        r.id,
                        r.model,
                        r.base_url,
                        state,
                        in_flight,
                        r.requests,
                        None if last_used is None else last_used + offset,
                        watching if watching > started_at else started_at,
                        r.config.labels,
                        MappingProxyType(r.responses.copy()) if r.responses else _EMPTY,
                        MappingProxyType(r.errors.copy()) if r.errors else _EMPTY,
                        r.ejections,
                        r.recoveries,
                        r.connects_failed,
                    ),
                )
            frozen[r] = (key, usage)
            append(usage)
        self._frozen = frozen
        pool = self.pool
        tallies = pool.tallies
        demand: dict[str, Demand] = {}
        since = self._previous
        for model, asked in tallies.last_asked.items():
            if asked >= since:
                demand[model] = Demand(0, None, asked + offset)
        for model in pool.held_models():
            oldest = pool.oldest_held(model)
            asked_before = demand.get(model)
            demand[model] = Demand(
                pool.held(model),
                None if oldest is None else oldest + offset,
                asked_before.last_asked if asked_before is not None else None,
            )
        self._previous = mono
        return UsageSnapshot(
            router=self.router,
            started_at=started_at,
            generated_at=wall,
            tick_seconds=self.tick_seconds,
            replicas=tuple(replicas),
            retries=MappingProxyType(dict(tallies.retries)),
            fallbacks=MappingProxyType(dict(tallies.fallbacks)),
            unserved=MappingProxyType(dict(tallies.unserved)),
            stalled=MappingProxyType(dict(tallies.stalled)),
            overloaded=MappingProxyType(dict(tallies.overloaded)),
            hold_outcomes=MappingProxyType(dict(tallies.hold_outcomes)),
            hold_probes=MappingProxyType(dict(tallies.hold_probes)),
            affinity=MappingProxyType(
                {
                    (model, outcome): n
                    for model, counts in tallies.affinity.items()
                    for outcome, n in zip(AFFINITY_OUTCOMES, counts, strict=True)
                    if n
                }
            ),
            demand=MappingProxyType(demand),
            queued=MappingProxyType(pool.queued()),
        )


_EMPTY: Mapping[str, int] = MappingProxyType({})


class UsageSink(Protocol):
    """An exporter of usage snapshots. publish() must return at once: a sink
    that does I/O starts its own task and never makes the tick wait."""

    name: str

    def publish(self, snapshot: UsageSnapshot) -> None: ...


def publish(sinks: Iterable[UsageSink], snapshot: UsageSnapshot, failures: dict[str, int]) -> None:
    """Hand `snapshot` to every sink; a sink that raises is counted in `failures`."""
    for sink in sinks:
        try:
            sink.publish(snapshot)
        except Exception:
            # The root of a sink call: one broken exporter must not starve
            # the others or stop the tick. Logged and counted, then on.
            failures[sink.name] = failures.get(sink.name, 0) + 1
            log.exception("usage sink %s failed", sink.name)


class Ticker:
    """Takes a snapshot every `tick_seconds` and hands it to every sink."""

    def __init__(
        self,
        pool: Pool,
        sinks: Sequence[UsageSink],
        *,
        router: str,
        started_at: float,
        tick_seconds: float,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.sinks = list(sinks)
        self.router = router
        self.started_at = started_at
        self.tick_seconds = tick_seconds
        self._wall = wall
        self._mono = mono
        self.sink_failures: dict[str, int] = {sink.name: 0 for sink in sinks}
        self.ticks = 0
        self.last_tick_seconds = 0.0
        self.latest: UsageSnapshot | None = None
        self._snapshotter = Snapshotter(pool, router=router, started_at=started_at, tick_seconds=tick_seconds)

    def snapshot(self) -> UsageSnapshot:
        return self._snapshotter.take(wall=self._wall(), mono=self._mono())

    def tick(self) -> UsageSnapshot:
        began = time.perf_counter()
        snapshot = self.snapshot()
        self.latest = snapshot
        publish(self.sinks, snapshot, self.sink_failures)
        self.ticks += 1
        self.last_tick_seconds = time.perf_counter() - began
        return snapshot

    async def run(self) -> None:
        """Tick forever, at a fixed rate that does not drift with the tick's cost."""
        # The first snapshot is taken at start-up, before anyone can ask.
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.tick_seconds
            delay = next_at - loop.time()
            if delay < 0:
                next_at = loop.time()
                delay = 0
            await asyncio.sleep(delay)
            try:
                self.tick()
            except Exception:
                log.exception("usage tick failed")


# The merge of several routers' maps (router ctl idle) --------------------------


@dataclass(frozen=True, slots=True)
class RouterReport:
    """What one router said in GET /api/v1/usage, or None if it did not answer."""

    server: str
    last_used: Mapping[str, float]
    watching_since: Mapping[str, float]
    generated_at: float
    # Requests held now per model (a model with any is wanted: none of its replicas is idle).
    held: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class Candidate:
    id: str
    model: str | None
    quiet_for_seconds: float
    last_used: float | None


@dataclass(frozen=True, slots=True)
class MergedUsage:
    complete: bool
    candidates: tuple[Candidate, ...]
    unknown: tuple[str, ...]
    # Per replica: the proven quiet time, None where it cannot be proven.
    quiet_for: Mapping[str, float | None]
    last_used: Mapping[str, float | None]


def merge_reports(
    reports: Iterable[RouterReport | None],
    *,
    now: float,
    idle_for: float,
    models: Mapping[str, str] | None = None,
) -> MergedUsage:
    """Merge several routers' usage maps into a proven lower bound of quiet time.

    Router i says that no request reached replica r between
    max(last_used_i[r], watching_since_i[r]) and its snapshot's generated_at;
    after that it says nothing. So r has been quiet for at least the oldest
    snapshot's time minus the latest of those horizons (a tick less than
    `now - horizon` at worst: what arrived since a snapshot is not known).
    A replica that some router does not watch, or any router that did not
    answer (None), makes the bound unprovable: unknown.
    """
    answered: list[RouterReport] = []
    complete = True
    for report in reports:
        if report is None:
            complete = False
        else:
            answered.append(report)
    ids = sorted({rid for rep in answered for rid in (*rep.watching_since, *rep.last_used)})
    as_of = min([now, *(rep.generated_at for rep in answered)])
    quiet_for: dict[str, float | None] = {}
    newest: dict[str, float | None] = {}
    for rid in ids:
        stamps = [rep.last_used[rid] for rep in answered if rid in rep.last_used]
        newest[rid] = max(stamps) if stamps else None
        bound: float | None = None
        if complete and answered:
            horizons: list[float] = []
            for rep in answered:
                watching = rep.watching_since.get(rid)
                if watching is None:
                    horizons = []
                    break
                horizons.append(max(watching, rep.last_used.get(rid, watching)))
            if horizons:
                bound = max(0.0, as_of - max(horizons))
        quiet_for[rid] = bound
    # A model some router holds requests for is wanted now, however quiet its replicas look.
    wanted = {model for rep in answered for model, held in rep.held.items() if held > 0}
    candidates = tuple(
        Candidate(
            id=rid,
            model=(models or {}).get(rid),
            quiet_for_seconds=q,
            last_used=newest[rid],
        )
        for rid in ids
        if (q := quiet_for[rid]) is not None and q >= idle_for and (models or {}).get(rid) not in wanted
    )
    unknown = tuple(rid for rid in ids if quiet_for[rid] is None)
    return MergedUsage(
        complete=complete,
        candidates=candidates if complete else (),
        unknown=unknown,
        quiet_for=MappingProxyType(quiet_for),
        last_used=MappingProxyType(newest),
    )
