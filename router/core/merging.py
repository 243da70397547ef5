"""Several workers' usage snapshots as one router's (`router serve --workers N`).

Each worker process has its own pool; the supervisor asks every worker for
its snapshot (as JSON over the worker's private socket) and combines them
the way `merge_reports()` combines routers: the newest stamp wins, counts
and requests in flight add up, and a replica counts as watched since the
latest of its workers' watches, since any worker may have sent it a request
before it started watching.

What a worker knew dies with it, except what the supervisor already holds:
`Memory` keeps the newest stamps and the totals of workers that have died,
so that a worker restart neither makes a replica look unused nor makes a
counter go backwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from router.core.replicas import ReplicaState
from router.core.tallies import bounded_unserved
from router.core.usage import Demand, ReplicaUsage, UsageSnapshot

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

    def retire(self, snapshot: UsageSnapshot) -> None:
        """A worker died: its last known totals stay in the sums from now on."""
        for r in snapshot.replicas:
            self.retired.setdefault(_key(r), _Totals()).add(r)
        for name in _TALLIES:
            _add_into(self.retired_tallies.setdefault(name, {}), getattr(snapshot, name))
        # Bounded as it is kept: workers that keep dying would each leave their names.
        self.retired_tallies["unserved"] = bounded_unserved(self.retired_tallies["unserved"], self.unserved_names)

    def forget_except(self, keys: set[Key]) -> None:
        """Replicas no worker knows any more leave the memory too."""
        for store in (self.last_used, self.retired):
            for key in [k for k in store if k not in keys]:
                del store[key]


_TALLIES = ("retries", "fallbacks", "unserved", "stalled", "overloaded", "hold_outcomes", "hold_probes", "affinity")


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


def combine(
    snapshots: Iterable[UsageSnapshot],
    memory: Memory,
    *,
    router: str,
    started_at: float,
    generated_at: float,
    tick_seconds: float,
) -> UsageSnapshot:
    """One router's snapshot from its workers' (every live worker's, taken just now)."""
    grouped: dict[Key, list[ReplicaUsage]] = {}
    tallies: dict[str, dict[Any, int]] = {name: dict(memory.retired_tallies.get(name, {})) for name in _TALLIES}
    demand: dict[str, Demand] = {}
    # A gauge: the live workers' queues add up, and a dead worker's queue is gone with it.
    queued: dict[str, int] = {}
    for snapshot in snapshots:
        _add_into(queued, snapshot.queued)
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
        for r in snapshot.replicas:
            grouped.setdefault(_key(r), []).append(r)
        for name in _TALLIES:
            _add_into(tallies[name], getattr(snapshot, name))
    replicas = []
    for key, parts in grouped.items():
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
        replicas.append(
            ReplicaUsage(
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
            )
        )
    memory.forget_except(set(grouped))
    return UsageSnapshot(
        router=router,
        started_at=started_at,
        generated_at=generated_at,
        tick_seconds=tick_seconds,
        replicas=tuple(replicas),
        retries=MappingProxyType(tallies["retries"]),
        fallbacks=MappingProxyType(tallies["fallbacks"]),
        # The workers count every name; the bound on names is the router's, applied to the sums.
        unserved=MappingProxyType(bounded_unserved(tallies["unserved"], memory.unserved_names)),
        stalled=MappingProxyType(tallies["stalled"]),
        overloaded=MappingProxyType(tallies["overloaded"]),
        hold_outcomes=MappingProxyType(tallies["hold_outcomes"]),
        hold_probes=MappingProxyType(tallies["hold_probes"]),
        affinity=MappingProxyType(tallies["affinity"]),
        demand=MappingProxyType(demand),
        queued=MappingProxyType(queued),
    )


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
