"""What the admin API and the replica-set sources steer: one process's pool, or every worker's.

`Fleet` is the one door through which the replica set changes, whoever
changes it (an endpoint push, a config reload, discovery): `LocalFleet` is
this process's pool; with `--workers` the supervisor's fleet fans each
change out to every worker (router/run/workers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool
from router.core.pool.replicas import SetDiff
from router.core.usage.snapshots import UsageSnapshot


class FleetUnavailable(Exception):
    """A worker did not take a change; the message names it."""


class Fleet(Protocol):
    """The replica set and its views, for the admin API and the sources."""

    async def snapshot(self) -> UsageSnapshot: ...

    async def configs(self) -> tuple[ReplicaConfig, ...]: ...

    async def set_replicas(self, configs: tuple[ReplicaConfig, ...]) -> dict[str, Any]:
        """Make `configs` the desired set; the diff as PUT /api/v1/endpoints answers it."""
        ...

    async def set_draining(self, replica_id: str, draining: bool) -> dict[str, Any] | None:
        """The replica's new {"id", "state", "in_flight"}, or None if there is no such replica."""
        ...

    async def metrics(self) -> bytes: ...


def diff_json(diff: SetDiff) -> dict[str, Any]:
    return {
        "added": list(diff.added),
        "removed": list(diff.removed),
        "changed": list(diff.changed),
        "unchanged": len(diff.unchanged),
    }


class LocalFleet:
    """The pool of this process."""

    def __init__(
        self,
        pool: Pool,
        registry: CollectorRegistry,
        snapshot: Callable[[], UsageSnapshot],
        *,
        exposition: Callable[[], bytes] = bytes,
        before_scrape: Callable[[], None] = lambda: None,
    ) -> None:
        """`exposition`: the per-replica series, rendered as they change (Sinks.exposition);
        `before_scrape`: reads on the event loop what the scrape shows as of now (sinks/waiting.py)."""
        self.pool = pool
        self.registry = registry
        self._snapshot = snapshot
        self._exposition = exposition
        self._before_scrape = before_scrape

    async def snapshot(self) -> UsageSnapshot:
        return self._snapshot()

    async def configs(self) -> tuple[ReplicaConfig, ...]:
        return tuple(self.pool.configs())

    async def set_replicas(self, configs: tuple[ReplicaConfig, ...]) -> dict[str, Any]:
        return diff_json(self.pool.set_replicas(configs))

    async def set_draining(self, replica_id: str, draining: bool) -> dict[str, Any] | None:
        replica = self.pool.set_draining(replica_id, draining)
        if replica is None:
            return None
        return {"id": replica.id, "state": replica.state.value, "in_flight": replica.in_flight}

    async def metrics(self) -> bytes:
        self._before_scrape()
        # The registry's families off the event loop, as they were when they
        # held every replica's series; those are bytes rendered at the tick now.
        own = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
        return own + self._exposition()
