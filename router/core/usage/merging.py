"""Several workers' usage snapshots as one router's (`router serve --workers N`).

Each worker process has its own pool; the supervisor asks every worker for
its snapshot (as JSON over the worker's private socket) and combines them
the way `merge_reports()` combines routers: the newest stamp wins, counts
and requests in flight add up, and a replica counts as watched since the
latest of its workers' watches, since any worker may have sent it a request
before it started watching.

A worker answers with what changed since the report the supervisor last
took from it (router.core.usage.records), or with everything when that cannot be
told (a new worker, one restarted); `Combiner` keeps each worker's records
and combines again only the replicas some worker reported changed. So the
supervisor's tick costs what the workers did, not the fleet's size.
`combine()` is the same rule over whole snapshots at once.

What a worker knew dies with it, except what the supervisor already holds:
`Memory` keeps the newest stamps and the totals of workers that have died,
so that a worker restart neither makes a replica look unused nor makes a
counter go backwards.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from router.core.pool.replicas import ReplicaState
from router.core.pool.tallies import bounded_unserved
from router.core.usage.records import Changes, Follower, RecordBook
from router.core.usage.snapshots import Demand, Queued, ReplicaUsage, UsageSnapshot, record_from_json, record_json

Key = tuple[str, str, str]  # (id, url, model): one replica; an id whose URL changed is another


@dataclass
class _Totals:
    """Counters that only grow: per replica, and per model for the tallies."""

    requests: int = 0
    connects_failed: int = 0
    ejections: int = 0
    recoveries: int = 0
    responses: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, r: ReplicaUsage | _Totals) -> None:
        self.requests += r.requests
        self.connects_failed += r.connects_failed
        self.ejections += r.ejections
        self.recoveries += r.recoveries
        _add_into(self.responses, r.responses)
        _add_into(self.errors, r.errors)


@dataclass
class Memory:
    """What outlives a worker: the newest stamps seen, and the dead workers' totals."""

    last_used: dict[Key, float] = field(default_factory=dict)
    retired: dict[Key, _Totals] = field(default_factory=dict)
    retired_tallies: dict[str, dict[Any, int]] = field(default_factory=dict)
    # The unserved model names shown, in the order they were first merged (tallies.bounded_unserved).
    unserved_names: dict[str, None] = field(default_factory=dict)

    def retire(self, snapshot: UsageSnapshot, records: Iterable[ReplicaUsage] | None = None) -> None:
        """A worker died: its last known totals stay in the sums from now on.

        `records`: its replicas' last records, when the snapshot holds only its tallies.
        """
        for r in snapshot.replicas if records is None else records:
            self.retired.setdefault(_key(r), _Totals()).add(r)
        for name in _TALLIES:
            _add_into(self.retired_tallies.setdefault(name, {}), getattr(snapshot, name))
        # Bounded as it is kept: workers that keep dying would each leave their names.
        self.retired_tallies["unserved"] = bounded_unserved(self.retired_tallies["unserved"], self.unserved_names)

    def forget(self, key: Key) -> None:
        """A replica no worker knows any more leaves the memory too."""
        self.last_used.pop(key, None)
        self.retired.pop(key, None)

    def forget_except(self, keys: set[Key]) -> None:
        for store in (self.last_used, self.retired):
            for key in [k for k in store if k not in keys]:
                del store[key]


_TALLIES = (
    "retries",
    "fallbacks",
    "unserved",
    "stalled",
    "overloaded",
    "hold_outcomes",
    "hold_probes",
    "affinity",
    "tokens",
    "usage_unknown",
)


def _key(r: ReplicaUsage) -> Key:
    return (r.id, r.url, r.model)


def _add_into(total: dict[Any, int], more: Mapping[Any, int]) -> None:
    for name, count in more.items():
        total[name] = total.get(name, 0) + count


def merged_state(states: list[str], in_flight: int) -> str:
    draining = {ReplicaState.DRAINING.value, ReplicaState.DRAINED.value}
    if any(state in draining for state in states):
        # Drained only when every worker holds it out and none has it in flight:
        # the fence that says the replica is safe to stop.
        if all(state in draining for state in states) and in_flight == 0:
            return ReplicaState.DRAINED.value
        return ReplicaState.DRAINING.value
    if ReplicaState.EJECTED.value in states:
        return ReplicaState.EJECTED.value
    return ReplicaState.READY.value


def _combined(key: Key, parts: list[ReplicaUsage], memory: Memory) -> ReplicaUsage:
    """One replica's record from its workers' records (in the workers' order) and what the memory holds."""
    first = parts[0]
    totals = _Totals()
    retired = memory.retired.get(key)
    if retired is not None:
        totals.add(retired)
    stamps = [r.last_used for r in parts if r.last_used is not None]
    remembered = memory.last_used.get(key)
    if remembered is not None:
        stamps.append(remembered)
    last_used = max(stamps) if stamps else None
    if last_used is not None:
        memory.last_used[key] = last_used
    in_flight = 0
    for r in parts:
        totals.add(r)
        in_flight += r.in_flight
    return ReplicaUsage(
        id=first.id,
        model=first.model,
        url=first.url,
        state=merged_state([r.state for r in parts], in_flight),
        in_flight=in_flight,
        requests=totals.requests,
        last_used=last_used,
        watching_since=max(r.watching_since for r in parts),
        labels=first.labels,
        responses=MappingProxyType(totals.responses),
        errors=MappingProxyType(totals.errors),
        ejections=totals.ejections,
        recoveries=totals.recoveries,
        connects_failed=totals.connects_failed,
        engine=next((r.engine for r in parts if r.engine is not None), None),
        # Each worker reads the engine itself: the freshest reading stands for all.
        engine_load=max(
            (r.engine_load for r in parts if r.engine_load is not None), key=lambda e: e.read_at, default=None
        ),
        saturated=any(r.saturated for r in parts),
        # Each worker reads the cards itself: one that found the model missing says so for all.
        serves_model=_serves(parts),
        # Every worker has the same set: the node and fabric are its config's.
        node=first.node,
        fabric=first.fabric,
    )


def _serves(parts: list[ReplicaUsage]) -> bool | None:
    said = [r.serves_model for r in parts if r.serves_model is not None]
    return None if not said else all(said)


# The router's tallies, demand and queues, as combined from its workers'.
Figures = tuple[
    dict[str, dict[Any, int]], dict[str, Demand], dict[str, int], dict[tuple[str, str, str], Queued], dict[str, float]
]


def _figures(snapshots: Iterable[UsageSnapshot], memory: Memory) -> Figures:
    """The router's tallies (the dead workers' in the sums), demand and queues, from its workers' snapshots."""
    tallies: dict[str, dict[Any, int]] = {name: dict(memory.retired_tallies.get(name, {})) for name in _TALLIES}
    demand: dict[str, Demand] = {}
    # A gauge: the live workers' queues add up, and a dead worker's queue is gone with it.
    queued: dict[str, int] = {}
    queues: dict[tuple[str, str, str], Queued] = {}
    # Each worker sees the engines itself: the router's view of a model is its most saturated worker's.
    saturation: dict[str, float] = {}
    for snapshot in snapshots:
        _add_into(queued, snapshot.queued)
        for model, share in snapshot.saturation.items():
            saturation[model] = max(share, saturation.get(model, 0.0))
        for key, figures in snapshot.queues.items():
            so_far = queues.get(key)
            queues[key] = (
                figures
                if so_far is None
                else Queued(so_far.queued + figures.queued, _least(so_far.oldest_since, figures.oldest_since))
            )
        for model, d in snapshot.demand.items():
            # Held requests add up; the oldest wait and the latest ask win.
            known = demand.get(model)
            demand[model] = (
                d
                if known is None
                else Demand(
                    known.held + d.held,
                    _least(known.oldest_held_since, d.oldest_held_since),
                    _most(known.last_asked, d.last_asked),
                )
            )
        for name in _TALLIES:
            _add_into(tallies[name], getattr(snapshot, name))
    # The workers count every name; the bound on names is the router's, applied to the sums.
    tallies["unserved"] = bounded_unserved(tallies["unserved"], memory.unserved_names)
    return tallies, demand, queued, queues, saturation


def _snapshot(
    records: Iterable[ReplicaUsage],
    figures: Figures,
    *,
    router: str,
    started_at: float,
    generated_at: float,
    tick_seconds: float,
    **book: Any,
) -> UsageSnapshot:
    tallies, demand, queued, queues, saturation = figures
    return UsageSnapshot(
        router=router,
        started_at=started_at,
        generated_at=generated_at,
        tick_seconds=tick_seconds,
        replicas=tuple(records),
        retries=MappingProxyType(tallies["retries"]),
        fallbacks=MappingProxyType(tallies["fallbacks"]),
        unserved=MappingProxyType(tallies["unserved"]),
        stalled=MappingProxyType(tallies["stalled"]),
        overloaded=MappingProxyType(tallies["overloaded"]),
        hold_outcomes=MappingProxyType(tallies["hold_outcomes"]),
        hold_probes=MappingProxyType(tallies["hold_probes"]),
        affinity=MappingProxyType(tallies["affinity"]),
        tokens=MappingProxyType(tallies["tokens"]),
        usage_unknown=MappingProxyType(tallies["usage_unknown"]),
        demand=MappingProxyType(demand),
        queued=MappingProxyType(queued),
        queues=MappingProxyType(queues),
        saturation=MappingProxyType(saturation),
        **book,
    )


def combine(
    snapshots: Iterable[UsageSnapshot],
    memory: Memory,
    *,
    router: str,
    started_at: float,
    generated_at: float,
    tick_seconds: float,
) -> UsageSnapshot:
    """One router's snapshot from its workers' (every live worker's, taken just now), whole."""
    snapshots = list(snapshots)
    grouped: dict[Key, list[ReplicaUsage]] = {}
    for snapshot in snapshots:
        for r in snapshot.replicas:
            grouped.setdefault(_key(r), []).append(r)
    records = [_combined(key, parts, memory) for key, parts in grouped.items()]
    memory.forget_except(set(grouped))
    return _snapshot(
        records,
        _figures(snapshots, memory),
        router=router,
        started_at=started_at,
        generated_at=generated_at,
        tick_seconds=tick_seconds,
    )


# What a worker reports at a collection, and the supervisor's copy of it ------------


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker's answer: its figures (a snapshot without records), and its records or what changed in them."""

    figures: UsageSnapshot
    # Everything, by the worker's keys; or None, and then what changed since the report asked about.
    records: tuple[tuple[Hashable, ReplicaUsage], ...] | None
    changes: Changes[ReplicaUsage] | None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> WorkerReport:
        if "changed" in doc:
            figures = UsageSnapshot.from_json({**doc, "replicas": ()})
            changes = Changes(
                figures.book,
                doc["since"],
                tuple((key, record_from_json(r)) for key, r in doc["changed"]),
                tuple(doc["gone"]),
            )
            return cls(figures, None, changes)
        whole = UsageSnapshot.from_json(doc)
        return cls(whole, tuple(whole.keyed()), None)


def report_json(snapshot: UsageSnapshot) -> dict[str, Any]:
    """A worker's snapshot as its report: what changed since the one asked about, else everything."""
    changes = snapshot.changes
    if changes is None:
        return snapshot.to_json()
    return {
        **snapshot.header_json(),
        "since": changes.since,
        "changed": [[key, record_json(r)] for key, r in changes.changed],
        "gone": list(changes.gone),
    }


class _Mirror:
    """The supervisor's copy of one worker's records, and its figures at its last report."""

    __slots__ = ("figures", "records", "whole")

    def __init__(self) -> None:
        self.records: Follower[ReplicaUsage] = Follower()
        self.figures: UsageSnapshot | None = None
        # Ask for everything next time (a report could not be followed).
        self.whole = True


class Combiner:
    """The workers' reports combined as they come, replica by replica changed."""

    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self.book: RecordBook[ReplicaUsage] = RecordBook()
        self._mirrors: dict[int, _Mirror] = {}
        # Per replica, each worker's record of it: by (worker, the worker's key).
        self._parts: dict[Key, dict[tuple[int, Hashable], ReplicaUsage]] = {}
        # Replicas to combine again at the next snapshot.
        self._pending: set[Key] = set()

    def since(self, worker: int) -> tuple[int, int] | None:
        """(book, seq) of the worker's last report taken: what it may answer from; None for everything."""
        mirror = self._mirrors.get(worker)
        if mirror is None or mirror.whole:
            return None
        return mirror.records.book, mirror.records.seq

    def update(self, worker: int, report: WorkerReport) -> None:
        """Take a worker's report.

        Collections may overlap (a tick, a scrape, an admin view): a report
        older than the one taken is passed over, and one of the changes since
        an older one than the one taken holds every change since that one too.
        """
        mirror = self._mirrors.get(worker)
        if mirror is None:
            mirror = self._mirrors[worker] = _Mirror()
        figures, held = report.figures, mirror.records
        if held.book == figures.book and figures.seq <= held.seq:
            return
        changes = report.changes
        if changes is not None:
            if changes.book != held.book or changes.since > held.seq:
                # Not from what is held (cannot be, when asked as since() says): everything next time.
                mirror.whole = True
                return
            changes = replace(changes, since=held.seq)
        taken = held.follow(figures.book, figures.seq, changes, report.records or ())
        mirror.figures = figures
        mirror.whole = False
        parts, pending = self._parts, self._pending
        for worker_key, before, after in taken:
            record = after if after is not None else before
            assert record is not None
            key = _key(record)
            if after is None:
                owned = parts.get(key)
                if owned is not None:
                    owned.pop((worker, worker_key), None)
            else:
                parts.setdefault(key, {})[worker, worker_key] = after
            pending.add(key)

    def in_flight(self, worker: int) -> int | None:
        """Requests in flight on the worker at its last report; None before its first."""
        mirror = self._mirrors.get(worker)
        if mirror is None or mirror.figures is None:
            return None
        return sum(r.in_flight for r in mirror.records.records.values())

    def drop(self, worker: int) -> None:
        """The worker died: its last totals into the memory, its records out of the combination."""
        mirror = self._mirrors.pop(worker, None)
        if mirror is None:
            return
        if mirror.figures is not None:
            self.memory.retire(mirror.figures, mirror.records.records.values())
        for worker_key, record in mirror.records.records.items():
            key = _key(record)
            owned = self._parts.get(key)
            if owned is not None:
                owned.pop((worker, worker_key), None)
            self._pending.add(key)

    def snapshot(
        self, *, router: str, started_at: float, generated_at: float, tick_seconds: float, since: int | None = None
    ) -> UsageSnapshot:
        """The router's snapshot now; with `since` (an earlier one's seq), what changed after that one."""
        book, memory, parts = self.book, self.memory, self._parts
        book.advance()
        for key in self._pending:
            owned = parts.get(key)
            if not owned:
                parts.pop(key, None)
                book.remove(key)
                memory.forget(key)
                continue
            # In the workers' order, as combine() has them.
            book.put(key, _combined(key, [owned[part] for part in sorted(owned, key=_worker_of)], memory))
        self._pending = set()
        records = book.records
        return _snapshot(
            records.values(),
            _figures((m.figures for m in self._mirrors.values() if m.figures is not None), memory),
            router=router,
            started_at=started_at,
            generated_at=generated_at,
            tick_seconds=tick_seconds,
            book=book.number,
            seq=book.seq,
            keys=tuple(records.keys()),
            changes=book.changes_since(since) if since is not None else None,
        )


def _worker_of(part: tuple[int, Hashable]) -> int:
    return part[0]


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
