"""The requests waiting now (held for a cold model, queued at the limits), read at scrape time.

`router_held_requests` and `router_queued_requests` say "now": a scrape must
not show the figures of the last usage tick (seconds old during a flood).
The admin port reads them from the pool on the event loop just before it
renders /metrics (the registry renders off the loop, where the pool's dicts
may not be read); with `--workers` the supervisor reads them from the
workers' reports it asks for at that same scrape. Either way the collector
shows whichever reading is newer: this one or the usage snapshot's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from router.core.pool.pool import Pool
from router.core.usage.snapshots import UsageSnapshot

QueueKey = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class WaitingNow:
    """Requests held per model and queued per (model, class, tenant), as of `taken_at` (Unix seconds).

    Every model held and every (model, class, tenant) queued since the start
    is there, at 0 once empty: an empty queue is a fact, not a missing series.
    """

    taken_at: float
    held: Mapping[str, int]
    queued: Mapping[QueueKey, int]


def waiting_now(pool: Pool, wall: float) -> WaitingNow:
    """What `pool` holds and queues now (on its event loop: it reads the pool's own dicts)."""
    cold = pool.cold_start
    held = {model: 0 for model, _ in pool.tallies.hold_outcomes}
    for model in cold.held_models():
        held[model] = cold.held(model)
    queued = {key: figures.queued for key, figures in pool.queues.figures().items()}
    return WaitingNow(wall, MappingProxyType(held), MappingProxyType(queued))


def waiting_of(snapshot: UsageSnapshot) -> WaitingNow:
    """What `snapshot` says was held and queued when it was taken."""
    held = {model: 0 for model, _ in snapshot.hold_outcomes}
    for model, demand in snapshot.demand.items():
        # A model only asked for (held 0, never held) has no series, as waiting_now() gives none.
        if demand.held:
            held[model] = demand.held
    queued = {key: figures.queued for key, figures in snapshot.queues.items()}
    return WaitingNow(snapshot.generated_at, MappingProxyType(held), MappingProxyType(queued))
