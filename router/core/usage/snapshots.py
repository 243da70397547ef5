"""Usage snapshots, the tick that takes them, and the merge of several routers.

The data path only stamps `Replica.last_used` (a monotonic time) in acquire(),
and marks the replica in the pool's `touched`. Once a tick, a `Snapshotter`
turns the stamps of the replicas marked since (and of those still in flight)
into Unix seconds and freezes them with everything an exporter may want;
sinks read only the snapshot. A tick costs what changed since the last one,
not what the fleet holds: each snapshot carries what changed since the one
published before it (router.core.usage.records), and the sinks update from that.

Unknown is not idle: a replica that no request has reached since this router
started (or since the replica was added) has `last_used is None`, and every
function here that answers "how long quiet" returns None for it, never 0.
The merge of several routers' maps is router.core.usage.quiet's, named here too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from router.core.config.settings import LabelValue
from router.core.pool.picking import AFFINITY_OUTCOMES
from router.core.pool.pool import Pool
from router.core.pool.replicas import SLEEPING, Replica, ReplicaState, sleep_state
from router.core.usage.quiet import Candidate, MergedUsage, RouterReport, merge_reports, quiet_bounds
from router.core.usage.records import Changes, RecordBook

__all__ = [
    "REPLICA_MAPPINGS",
    "TALLIES_BY_MODEL",
    "TALLIES_BY_PAIR",
    "Candidate",
    "Demand",
    "MergedUsage",
    "ReplicaUsage",
    "RouterReport",
    "Snapshotter",
    "Ticker",
    "UsageSink",
    "UsageSnapshot",
    "merge_reports",
    "publish",
]

log = logging.getLogger("router.core.usage.snapshots")


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
    # The engine it runs (configured or recognised; None: not known), and its last reading of its load
    # (router.core.pool.loads): waiting, running (None: not said), KV use (None: not said), when it was
    # read (Unix seconds) and how; None: none read. `saturated`: at its model's bounds as of the snapshot.
    engine: str | None = None
    engine_load: EngineReading | None = None
    saturated: bool = False
    # Whether its /v1/models lists the model the router sends it (Replica.serves_model); None: not said.
    serves_model: bool | None = None
    # The node it runs on and that node's fabric, as configured, pushed or discovered; None: not said.
    node: str | None = None
    fabric: str | None = None

    def quiet_seconds(self, now: float) -> float | None:
        """Seconds since the last request, or None when no request is known."""
        if self.last_used is None:
            return None
        return max(0.0, now - self.last_used)


# The snapshot's per-model tallies keyed by a model name, those keyed by a
# pair, and a replica's fields that are mappings: the JSON codec's shape.
TALLIES_BY_MODEL = ("retries", "unserved", "stalled", "overloaded")
TALLIES_BY_PAIR = ("fallbacks", "hold_outcomes", "hold_probes", "affinity", "usage_unknown")
REPLICA_MAPPINGS = ("labels", "responses", "errors")


def _pairs(rows: list[list[Any]]) -> Mapping[tuple[str, str], int]:
    return MappingProxyType({(a, b): n for a, b, n in rows})


def _triples(rows: list[list[Any]]) -> Mapping[tuple[str, str, str], int]:
    return MappingProxyType({(a, b, c): n for a, b, c, n in rows})


class EngineReading(NamedTuple):
    """A replica's engine load as the snapshot shows it."""

    waiting: float
    running: float | None
    kv: float | None
    read_at: float
    source: str


class Demand(NamedTuple):
    """A model that clients want and no replica serves now: held requests, or asked-for in vain."""

    held: int
    # Unix seconds the oldest held request began waiting; None with none held.
    oldest_held_since: float | None
    # Unix seconds of the last request that nothing could serve at once; None if none since the last tick.
    last_asked: float | None


class Queued(NamedTuple):
    """One tenant's requests queued for a model in one priority class."""

    queued: int
    # Unix seconds the oldest of them began waiting; None with none queued.
    oldest_since: float | None


@dataclass(frozen=True, slots=True)
class UsageSnapshot:
    """One tick's frozen view of the pool, and what changed since the one before it: what every exporter reads."""

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
    # Tokens the answers said they took, by (model, tenant, kind): prompt, cached, completion.
    tokens: Mapping[tuple[str, str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    # Answers that said nothing readable of their tokens, by (model, tenant).
    usage_unknown: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    demand: Mapping[str, Demand] = field(default_factory=lambda: MappingProxyType({}))
    # Requests waiting now for a slot under the limits (max_in_flight, max_in_flight_per_replica), by model.
    queued: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The same by (model, priority class, tenant): each that ever queued, at 0 once empty.
    queues: Mapping[tuple[str, str, str], Queued] = field(default_factory=lambda: MappingProxyType({}))
    # Per model whose engines report their load: the share of its ready replicas saturated (0..1; 1:
    # requests wait in the router for one to fall below its bounds).
    saturation: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # The record book behind the replicas (router.core.usage.records): its number,
    # this snapshot's seq in it, each record's key (beside `replicas`), and
    # what changed since the seq the taker asked about (None: not asked, or
    # not known). A snapshot made by hand has none: its readers compare whole.
    book: int = 0
    seq: int = 0
    keys: tuple[Hashable, ...] = ()
    changes: Changes[ReplicaUsage] | None = None

    def keyed(self) -> Iterable[tuple[Hashable, ReplicaUsage]]:
        """Every record with its key in the book; for a snapshot without one, (id, url, model).

        (A second record of one (id, url, model), a replica pushed back while
        its old self still drains, is told apart by its place among them.)
        """
        if self.keys:
            return zip(self.keys, self.replicas, strict=True)
        keyed: list[tuple[Hashable, ReplicaUsage]] = []
        seen: dict[tuple[str, str, str], int] = {}
        for r in self.replicas:
            key = (r.id, r.url, r.model)
            count = seen.get(key, 0)
            seen[key] = count + 1
            keyed.append((key if not count else (*key, count), r))
        return keyed

    def to_json(self) -> dict[str, Any]:
        """The whole snapshot as JSON (a worker's report to its supervisor); from_json() reads it back."""
        return {
            **self.header_json(),
            "replicas": [record_json(r) for r in self.replicas],
            "keys": list(self.keys),
        }

    def header_json(self) -> dict[str, Any]:
        """All but the records, as JSON: the router's figures that are not per replica."""
        return {
            "router": self.router,
            "started_at": self.started_at,
            "generated_at": self.generated_at,
            "tick_seconds": self.tick_seconds,
            "book": self.book,
            "seq": self.seq,
            **{name: [[a, b, n] for (a, b), n in getattr(self, name).items()] for name in TALLIES_BY_PAIR},
            **{name: dict(getattr(self, name)) for name in TALLIES_BY_MODEL},
            "tokens": [[*key, n] for key, n in self.tokens.items()],
            "demand": {model: list(d) for model, d in self.demand.items()},
            "queued": dict(self.queued),
            "queues": [[*key, *figures] for key, figures in self.queues.items()],
            "saturation": dict(self.saturation),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> UsageSnapshot:
        replicas = tuple(record_from_json(r) for r in doc.get("replicas", ()))
        keys = doc.get("keys")
        return cls(
            router=doc["router"],
            started_at=doc["started_at"],
            generated_at=doc["generated_at"],
            tick_seconds=doc["tick_seconds"],
            replicas=replicas,
            fallbacks=_pairs(doc["fallbacks"]),
            hold_outcomes=_pairs(doc["hold_outcomes"]),
            hold_probes=_pairs(doc["hold_probes"]),
            affinity=_pairs(doc["affinity"]),
            tokens=_triples(doc.get("tokens", [])),
            usage_unknown=_pairs(doc.get("usage_unknown", [])),
            retries=MappingProxyType(doc["retries"]),
            unserved=MappingProxyType(doc["unserved"]),
            stalled=MappingProxyType(doc["stalled"]),
            overloaded=MappingProxyType(doc["overloaded"]),
            demand=MappingProxyType({model: Demand(*d) for model, d in doc["demand"].items()}),
            queued=MappingProxyType(doc["queued"]),
            queues=MappingProxyType({(m, p, t): Queued(n, since) for m, p, t, n, since in doc["queues"]}),
            saturation=MappingProxyType(doc.get("saturation", {})),
            book=doc.get("book", 0),
            seq=doc.get("seq", 0),
            keys=tuple(keys) if keys and len(keys) == len(replicas) else (),
        )

    def report(self) -> RouterReport:
        """This snapshot as one router's report to the merge (what GET /api/v1/usage says)."""
        last_used, watching, _ = self.maps()
        return RouterReport(
            server=self.router,
            last_used=last_used,
            watching_since=watching,
            generated_at=self.generated_at,
            held={model: d.held for model, d in self.demand.items()},
        )

    def quiet_for(self) -> Mapping[str, float | None]:
        """Per replica, how long it has provably been quiet as of this snapshot.

        The merge of `router ctl idle` over this one router (quiet_bounds(),
        checked against merge_reports() by a test): every view of idleness
        (status, replicas, /metrics) reads this, so none can say otherwise.
        No request reached the replica after max(last_used, watching_since),
        whether or not it ever had a stamp.
        """
        last_used, watching, _ = self.maps()
        bounds: dict[str, float | None] = dict(quiet_bounds(last_used, watching, self.generated_at))
        return MappingProxyType(bounds)

    def maps(self) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
        """Per replica id: the last use, the watch, and the model (the usage map's three maps).

        A replica id being replaced (URL or model changed) may appear twice
        while the old one drains: the newest stamp and the later watch win,
        and the model is the one watched since then.
        """
        last_used: dict[str, float] = {}
        watching: dict[str, float] = {}
        models: dict[str, str] = {}
        for r in self.replicas:
            rid = r.id
            if r.last_used is not None and r.last_used > last_used.get(rid, -1.0):
                last_used[rid] = r.last_used
            if rid not in watching or r.watching_since > watching[rid]:
                watching[rid] = r.watching_since
                models[rid] = r.model
        return last_used, watching, models

    def asleep_map(self) -> dict[str, str]:
        """Per replica id asleep or waking (the sleep tier), which: "waking" if any of its records is."""
        states: dict[str, list[str]] = {}
        for r in (r for r in self.replicas if r.state in SLEEPING):
            states.setdefault(r.id, []).append(r.state)
        return {rid: sleep_state(found) for rid, found in states.items()}

    def usage_document(self) -> dict[str, object]:
        """The body of GET /api/v1/usage and of the usage push."""
        last_used, watching, models = self.maps()
        return {
            "router": self.router,
            "started_at": self.started_at,
            "generated_at": self.generated_at,
            "tick_seconds": self.tick_seconds,
            "last_used": last_used,
            "watching_since": watching,
            "model": models,
            "asleep": self.asleep_map(),  # their own map: never in use, never unknown
            "demand": demand_json(self.demand),
        }


def demand_json(demand: Mapping[str, Demand]) -> dict[str, dict[str, float | int | None]]:
    return {
        model: {"held": d.held, "oldest_held_since": d.oldest_held_since, "last_asked": d.last_asked}
        for model, d in demand.items()
    }


def record_json(r: ReplicaUsage) -> dict[str, Any]:
    """One record as JSON, its mappings as objects."""
    return {**r._asdict(), **{name: dict(getattr(r, name)) for name in REPLICA_MAPPINGS}}


def record_from_json(doc: Mapping[str, Any]) -> ReplicaUsage:
    load = doc.get("engine_load")
    return ReplicaUsage(
        **{
            **doc,
            **{name: MappingProxyType(doc[name]) for name in REPLICA_MAPPINGS},
            "engine_load": None if load is None else EngineReading(*load),
        }
    )


class Snapshotter:
    """Freezes the pool's state; monotonic stamps become Unix seconds here, once.

    A replica with requests in flight is in use right now, so its stamp is
    moved to this tick: a 20-minute generation never looks 20 minutes idle,
    and the stamp stays there after the request ends.

    Only the replicas the pool marked since the last snapshot (its
    `touched`: every acquire, every change of state or labels) and those in
    flight at the last one are looked at; every other replica keeps its
    frozen record. Counters change only between acquire() and release(), so
    a replica whose counters moved was either acquired since the last look
    or in flight at it. The records live in a RecordBook, which tells what
    changed since any earlier snapshot.
    """

    def __init__(self, pool: Pool, *, router: str, started_at: float, tick_seconds: float) -> None:
        self.pool = pool
        self.router = router
        self.started_at = started_at
        self.tick_seconds = tick_seconds
        self.book: RecordBook[ReplicaUsage] = RecordBook()
        # Each replica's key in the book (a replica replaced under the same id is
        # another) and its watch in Unix seconds, converted once: a record that
        # changes keeps it to the microsecond.
        self._keys: dict[Replica, tuple[int, float]] = {}
        self._new_key = itertools.count().__next__
        # In flight at the last look: looked at again at the next.
        self._busy: dict[Replica, None] = {}
        # How many replicas the last snapshot looked at (what a tick costs).
        self.looked_at = 0
        # Monotonic time of the previous snapshot: demand asked since then is shown.
        self._previous = float("-inf")

    def take(self, *, wall: float, mono: float, since: int | None = None) -> UsageSnapshot:
        """A snapshot now; with `since` (an earlier snapshot's seq), it carries what changed after that one."""
        offset = wall - mono
        started_at = self.started_at
        book = self.book
        book.advance()
        put = book.put
        keys = self._keys
        touched = self.pool.touched
        # Those in flight at the last look may have changed without a mark (a release).
        touched.update(self._busy)
        busy: dict[Replica, None] = {}
        build = tuple.__new__
        draining, drained = ReplicaState.DRAINING.value, ReplicaState.DRAINED.value
        ejected, ready = ReplicaState.EJECTED.value, ReplicaState.READY.value
        asleep, waking = ReplicaState.ASLEEP.value, ReplicaState.WAKING.value
        engines = self.pool.engines
        for r in touched:
            in_flight = r.in_flight
            if r.removed and not in_flight:
                # Gone from the pool (removed, its last request ended): gone from the map.
                known = keys.pop(r, None)
                if known is not None:
                    book.remove(known[0])
                continue
            known = keys.get(r)
            if known is None:
                watching = r.added_at + offset
                known = keys[r] = (self._new_key(), watching if watching > started_at else started_at)
            if in_flight > 0:
                r.last_used = mono
                busy[r] = None
            last_used = r.last_used
            ejected_until = r.ejected_until
            # Replica.state, inlined: this loop runs over every replica that changed.
            if r.draining or r.removed:
                state = draining if in_flight else drained
            elif r.asleep is not None:
                state = waking if r.waking else asleep
            else:
                state = ready if ejected_until is None else ejected
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
                    known[1],
                    (config := r.config).labels,
                    MappingProxyType(r.responses.copy()) if r.responses else _EMPTY,
                    MappingProxyType(r.errors.copy()) if r.errors else _EMPTY,
                    r.ejections,
                    r.recoveries,
                    r.connects_failed,
                    r.engine,
                    None
                    if (load := r.load) is None
                    else EngineReading(load.waiting, load.running, load.kv, load.at + offset, load.source),
                    engines is not None and engines.saturated(r),
                    r.serves_model,
                    config.node,
                    config.fabric,
                ),
            )
            put(known[0], usage)
        self.looked_at = len(touched)
        touched.clear()
        self._busy = busy
        records = book.records
        return self._snapshot(
            wall,
            offset,
            mono,
            replicas=tuple(records.values()),
            keys=tuple(records.keys()),
            changes=book.changes_since(since) if since is not None else None,
        )

    def _snapshot(
        self,
        wall: float,
        offset: float,
        mono: float,
        *,
        replicas: tuple[ReplicaUsage, ...],
        keys: tuple[Hashable, ...],
        changes: Changes[ReplicaUsage] | None,
    ) -> UsageSnapshot:
        pool = self.pool
        tallies = pool.tallies
        demand: dict[str, Demand] = {}
        since = self._previous
        for model, asked in tallies.last_asked.items():
            if asked >= since:
                demand[model] = Demand(0, None, asked + offset)
        for model in pool.cold_start.held_models():
            oldest = pool.cold_start.oldest_held(model)
            asked_before = demand.get(model)
            demand[model] = Demand(
                pool.cold_start.held(model),
                None if oldest is None else oldest + offset,
                asked_before.last_asked if asked_before is not None else None,
            )
        self._previous = mono
        return UsageSnapshot(
            router=self.router,
            started_at=self.started_at,
            generated_at=wall,
            tick_seconds=self.tick_seconds,
            replicas=replicas,
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
            tokens=MappingProxyType(tallies.token_counts()),
            usage_unknown=MappingProxyType(tallies.unknown_counts()),
            demand=MappingProxyType(demand),
            queued=MappingProxyType(pool.queued()),
            queues=MappingProxyType(
                {
                    key: Queued(n, None if since is None else since + offset)
                    for key, (n, since) in pool.queues.figures().items()
                }
            ),
            saturation=MappingProxyType(pool.engine_loads.shares() if pool.engine_loads is not None else {}),
            book=self.book.number,
            seq=self.book.seq,
            keys=keys,
            changes=changes,
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
        self.snapshotter = Snapshotter(pool, router=router, started_at=started_at, tick_seconds=tick_seconds)

    def snapshot(self, since: int | None = None) -> UsageSnapshot:
        """A snapshot now (for a view that answers at once); `since`: see Snapshotter.take()."""
        return self.snapshotter.take(wall=self._wall(), mono=self._mono(), since=since)

    def tick(self) -> UsageSnapshot:
        began = time.perf_counter()
        # What changed since the last published snapshot: the sinks saw that one.
        latest = self.latest
        snapshot = self.snapshot(since=latest.seq if latest is not None else None)
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
