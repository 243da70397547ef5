"""The fleet of `--workers`: each change to the replica set written down, then sent to every worker.

The supervisor's answer to the one door for changing the set (`Fleet`):
a change goes first into the state file that a (re)starting worker loads,
then to every worker that is up; the call answers once each has taken it,
or raises `FleetUnavailable` naming those that did not. A worker that is
starting has its admin socket up before it reads the state file, so it
either gets the call or reads the new state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import orjson

from router.control.fleet import FleetUnavailable, sleep_under_way
from router.core.config.settings import ReplicaConfig
from router.core.usage.merging import merged_state
from router.core.usage.snapshots import UsageSnapshot
from router.run.workers.processes import WorkerProcesses
from router.run.workers.sleeps import SupervisedSleeps
from router.run.workers.state import set_json, write_state

log = logging.getLogger("router.run.workers")


class SupervisedFleet:
    """The replica set of every worker at once, and the supervisor's combined view of them."""

    def __init__(
        self,
        processes: WorkerProcesses,
        initial: tuple[ReplicaConfig, ...],
        *,
        collect: Callable[[], Awaitable[UsageSnapshot | None]],
        metrics: Callable[[], Awaitable[bytes]],
        sleeps: SupervisedSleeps,
    ) -> None:
        self.processes = processes
        self.sleeps = sleeps
        # desired: what a (re)starting worker loads; current: what every live
        # worker has acknowledged, which GET /api/v1/endpoints answers.
        self.desired = initial
        self.current = initial
        self.draining: set[str] = set()
        # Replicas the supervisor put to sleep, and their level: a (re)starting worker loads them asleep.
        self.asleep: dict[str, int] = {}
        self._collect = collect
        self._metrics = metrics
        self._changes = asyncio.Lock()
        # Each config of the last set written, as JSON (by the config object's identity).
        self._json: dict[int, tuple[ReplicaConfig, bytes]] = {}

    def write_state(self, entries: list[bytes] | None = None) -> None:
        """The set (`entries`: its JSON, when made already) and drains into the workers' state file."""
        assert self.processes.runtime is not None, "the runtime directory first"
        write_state(self.processes.runtime, entries or self._entries(self.desired), self.draining, self.asleep)

    def _entries(self, configs: tuple[ReplicaConfig, ...]) -> list[bytes]:
        """Each replica as JSON, serialized once per config: a push's unchanged entries are the
        same objects again (router/control/endpoints.py), so 10,000 of them cost a lookup each,
        and reach the workers byte for byte as before, which lets them read only what changed."""
        known = self._json
        fresh: dict[int, tuple[ReplicaConfig, bytes]] = {}
        entries = []
        for config in configs:
            entry = known.get(id(config))
            if entry is None or entry[0] is not config:
                entry = (config, orjson.dumps(config.as_json()))
            fresh[id(config)] = entry
            entries.append(entry[1])
        self._json = fresh
        return entries

    async def snapshot(self) -> UsageSnapshot:
        snapshot = await self._collect()
        if snapshot is None:
            raise FleetUnavailable("Not every worker reported its usage; try again.")
        return snapshot

    async def configs(self) -> tuple[ReplicaConfig, ...]:
        return self.current

    async def metrics(self) -> bytes:
        return await self._metrics()

    async def set_replicas(self, configs: tuple[ReplicaConfig, ...]) -> dict[str, Any]:
        async with self._changes:
            self.desired = configs
            self.draining &= {c.id for c in configs}
            kept = {c.id for c in configs}
            self.asleep = {rid: level for rid, level in self.asleep.items() if rid in kept}
            entries = self._entries(configs)
            self.write_state(entries)
            body = set_json(entries)
            try:
                answers = await self.everywhere("PUT", "/api/v1/endpoints", body)
            finally:
                # Those that answered have it; one that did not restarts with it.
                self.current = configs
        diff: dict[str, Any] = orjson.loads(answers[0][1])
        log.info(
            "replica set applied by %d workers: %d added, %d removed, %d changed",
            len(answers),
            len(diff["added"]),
            len(diff["removed"]),
            len(diff["changed"]),
        )
        return diff

    async def set_draining(self, replica_id: str, draining: bool, *, by_sleep: bool = False) -> dict[str, Any] | None:
        """`by_sleep`: the fence of a sleep under way, or its undoing; any other ready waits for it to end."""
        if not draining and not by_sleep and replica_id in self.sleeps.under_way:
            raise sleep_under_way(replica_id)
        if not draining:
            asleep = next((r for r in (await self.snapshot()).replicas if r.id == replica_id), None)
            if asleep is not None and asleep.state in ("asleep", "waking"):
                answer = await self.sleeps.wake(self, replica_id)
                async with self._changes:
                    self.draining.discard(replica_id)
                    self.asleep.pop(replica_id, None)
                    self.write_state()
                return answer
        async with self._changes:
            if draining:
                self.draining.add(replica_id)
            else:
                self.draining.discard(replica_id)
            self.write_state()
            body = orjson.dumps({"state": "draining" if draining else "ready"})
            answers = await self.everywhere("POST", f"/api/v1/replicas/{quote(replica_id, safe='')}/state", body)
        found = [orjson.loads(data) for status, data in answers if status == 200]
        if not found:
            self.draining.discard(replica_id)
            return None
        in_flight = sum(a["in_flight"] for a in found)
        return {"id": replica_id, "state": merged_state([a["state"] for a in found], in_flight), "in_flight": in_flight}

    async def sleep(self, replica_id: str, level: int, *, call_engine: bool, wait: float) -> dict[str, Any]:
        return await self.sleeps.sleep(self, replica_id, level, call_engine=call_engine, wait=wait)

    async def woken(self, replica_id: str) -> dict[str, Any]:
        async with self._changes:
            self.asleep.pop(replica_id, None)
            self.write_state()
        body = orjson.dumps({"state": "ready", "call_engine": False})
        await self.everywhere("POST", f"/api/v1/replicas/{quote(replica_id, safe='')}/state", body)
        return {"id": replica_id, "state": "ready", "in_flight": 0, "level": None}

    async def everywhere(self, method: str, path: str, body: bytes) -> list[tuple[int, bytes]]:
        """Send one change to every worker that is up; raise if a live one did not take it."""
        targets = [w for w in self.processes.workers if w.running]
        answers = await asyncio.gather(*(w.call(method, path, body) for w in targets), return_exceptions=True)
        taken: list[tuple[int, bytes]] = []
        missed: list[str] = []
        for worker, answer in zip(targets, answers, strict=True):
            if isinstance(answer, BaseException):
                if worker.live:
                    missed.append(f"worker {worker.index}: {answer!r}")
            elif answer[0] >= 500:
                missed.append(f"worker {worker.index}: HTTP {answer[0]}")
            else:
                taken.append(answer)
        if missed:
            raise FleetUnavailable("Not every worker took the change: " + "; ".join(missed))
        return taken
