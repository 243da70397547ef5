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

from router.control.sleeping import Sleeper, SleepRefused
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

    async def sleep(self, replica_id: str, level: int, *, call_engine: bool, wait: float) -> dict[str, Any]:
        """Drain the replica, then put its engine to sleep (router.control.sleeping); SleepRefused says why not."""
        ...

    async def woken(self, replica_id: str) -> dict[str, Any]:
        """An asleep replica woken elsewhere: ready again here, no engine call made."""
        ...

    async def metrics(self) -> bytes: ...


def diff_json(diff: SetDiff) -> dict[str, Any]:
    return {
        "added": list(diff.added),
        "removed": list(diff.removed),
        "changed": list(diff.changed),
        "unchanged": len(diff.unchanged),
    }


def sleep_under_way(replica_id: str) -> SleepRefused:
    """Ready asked of a replica being put to sleep: it would take requests while its engine goes to sleep."""
    return SleepRefused(
        409,
        "sleep_under_way",
        f"Replica {replica_id!r} is being put to sleep now (draining, or its engine's sleep call under way); "
        "it cannot be made ready until that ends. Wake it once it is asleep, or retry once the sleep failed.",
    )


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
        sleeper: Sleeper | None = None,
    ) -> None:
        """`exposition`: the per-replica series, rendered as they change (Sinks.exposition);
        `before_scrape`: reads on the event loop what the scrape shows as of now (sinks/waiting.py);
        `sleeper`: the sleeps and wakes of its replicas (None: refused, 409)."""
        self.pool = pool
        self.sleeper = sleeper
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
        if not draining and self.sleeper is not None and self.sleeper.putting_to_sleep(replica_id):
            raise sleep_under_way(replica_id)
        asleep = self.pool.get(replica_id)
        if not draining and asleep is not None and asleep.asleep is not None:
            # Ready again, from asleep: its engine is woken first.
            return await self._sleeper().wake(replica_id)
        replica = self.pool.set_draining(replica_id, draining)
        if replica is None:
            return None
        return {"id": replica.id, "state": replica.state.value, "in_flight": replica.in_flight}

    def _sleeper(self) -> Sleeper:
        if self.sleeper is None:
            raise SleepRefused(409, "cannot_sleep", "This router does not put replicas to sleep.")
        return self.sleeper

    async def sleep(self, replica_id: str, level: int, *, call_engine: bool, wait: float) -> dict[str, Any]:
        return await self._sleeper().sleep(replica_id, level, call_engine=call_engine, wait=wait)

    async def woken(self, replica_id: str) -> dict[str, Any]:
        return self._sleeper().woken(replica_id)

    async def metrics(self) -> bytes:
        self._before_scrape()
        # The registry's families off the event loop, as they were when they
        # held every replica's series; those are bytes rendered at the tick now.
        own = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
        return own + self._exposition()
