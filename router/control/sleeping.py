"""Putting a replica to sleep and waking it, by hand or by a control plane: the fence first, then the engine.

`POST /api/v1/replicas/{id}/state {"state": "asleep", "level": 1}` drains the
replica (the fence of a drain: no new request; those in flight finish),
waits until nothing is in flight, then calls its engine's sleep endpoint
(router.core.pool.sleep), and only then shows it `asleep`. With
`"call_engine": false` the engine is not called: the second phase of a sleep
across several routers, where one router made the call and the others are
told (docs/scale-from-zero.md). `{"state": "ready"}` on an asleep replica
wakes it.

Refusals name the problem: 404 no such replica, 409 it cannot sleep now (its
engine has no sleep API the router knows, it is ejected, removed, waking,
already being put to sleep, or still busy at the end of the wait), 502 its
engine's call failed (the replica is then as it was before). `{"state": "ready"}`
while a sleep is under way is refused 409 `sleep_under_way`: made ready then, the
replica would take requests while its engine goes to sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica, ReplicaState
from router.core.pool.sleep import LEVELS, EngineCall, EngineCallFailed, Wakes, put_to_sleep, sleep_api

_DRAIN_POLL_SECONDS = 0.02
SLEEP_CALL_SECONDS = 120.0
DEFAULT_WAIT_SECONDS = 60.0


class SleepRefused(Exception):
    """A sleep or wake that cannot be done: its HTTP status, error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def answer(replica: Replica) -> dict[str, Any]:
    return {
        "id": replica.id,
        "state": replica.state.value,
        "in_flight": replica.in_flight,
        "level": replica.asleep,
    }


class Sleeper:
    """This process's sleeps and wakes by the admin API, sharing the request path's wakes (`Wakes`)."""

    def __init__(self, pool: Pool, call: EngineCall, wakes: Wakes, *, wake_timeout: Callable[[str], float]) -> None:
        """`wake_timeout(model)`: how long a wake of that model's replica may take (wake_timeout_seconds)."""
        self._pool = pool
        self._call = call
        self.wakes = wakes
        self._wake_timeout = wake_timeout
        # Replicas being put to sleep now: a second call for one is refused, not run twice.
        self._sleeping: set[str] = set()

    def putting_to_sleep(self, replica_id: str) -> bool:
        """Whether a sleep of the replica is under way here: draining it, or its engine's sleep call."""
        return replica_id in self._sleeping

    def _replica(self, replica_id: str) -> Replica:
        replica = self._pool.get(replica_id)
        if replica is None:
            raise SleepRefused(404, "replica_not_found", f"No replica with id {replica_id!r}.")
        return replica

    async def sleep(self, replica_id: str, level: int, *, call_engine: bool, wait: float) -> dict[str, Any]:
        replica = self._replica(replica_id)
        if level not in LEVELS:
            raise SleepRefused(400, "invalid_state", f"level must be 1 or 2, got {level!r}.")
        state = replica.state
        if state is ReplicaState.ASLEEP:
            if replica.asleep == level:
                return answer(replica)
            raise SleepRefused(
                409, "cannot_sleep", f"Replica {replica_id!r} is asleep at level {replica.asleep}; wake it first."
            )
        api = sleep_api(replica.engine)
        if call_engine and api is None:
            raise SleepRefused(
                409,
                "cannot_sleep",
                f"Replica {replica_id!r} runs "
                + (f"engine {replica.engine!r}, which has no sleep API" if replica.engine else "an engine not known")
                + '; set engine = "vllm" or "sglang" on it (their sleep calls are the ones the router knows).',
            )
        if state is ReplicaState.WAKING or replica_id in self._sleeping or self.wakes.under_way(replica):
            raise SleepRefused(409, "cannot_sleep", f"Replica {replica_id!r} is being woken or put to sleep now.")
        if state is ReplicaState.EJECTED:
            raise SleepRefused(
                409, "cannot_sleep", f"Replica {replica_id!r} is ejected (failing); it cannot be drained to sleep."
            )
        self._sleeping.add(replica_id)
        try:
            return await self._sleep(replica, level, api if call_engine else None, wait)
        finally:
            self._sleeping.discard(replica_id)

    async def _sleep(self, replica: Replica, level: int, api: Any, wait: float) -> dict[str, Any]:
        pool = self._pool
        was_draining = replica.draining
        pool.set_draining(replica.id, True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        # The fence: no new request reaches it now; the sleep waits for the last in flight to end.
        while replica.in_flight and not replica.removed:
            if loop.time() >= deadline:
                pool.set_draining(replica.id, was_draining)
                raise SleepRefused(
                    409,
                    "still_busy",
                    f"Replica {replica.id!r} still had {replica.in_flight} request(s) in flight after {wait:g} s; "
                    "it was not put to sleep.",
                )
            await asyncio.sleep(_DRAIN_POLL_SECONDS)
        if replica.removed:
            raise SleepRefused(409, "cannot_sleep", f"Replica {replica.id!r} was removed while it drained.")
        if api is not None:
            try:
                await put_to_sleep(self._call, api, replica.base_url, level, SLEEP_CALL_SECONDS)
            except EngineCallFailed as exc:
                self.wakes.count("sleep", "failed")
                pool.set_draining(replica.id, was_draining)
                raise SleepRefused(
                    502, "engine_call_failed", f"Replica {replica.id!r}'s engine did not sleep: {exc}"
                ) from exc
            self.wakes.count("sleep", "ok")
        pool.set_sleep(replica, level)
        return answer(replica)

    async def wake(self, replica_id: str) -> dict[str, Any]:
        """Wake an asleep (or waking) replica and answer once it is ready."""
        replica = self._replica(replica_id)
        if sleep_api(replica.engine) is None:
            raise SleepRefused(
                409,
                "cannot_wake",
                f"Replica {replica_id!r}'s engine ({replica.engine or 'not known'}) has no wake call the router knows; "
                'if it was woken another way, say so with {"state": "ready", "call_engine": false}.',
            )
        try:
            await asyncio.shield(self.wakes.wake(replica, self._wake_timeout(replica.model)))
        except EngineCallFailed as exc:
            raise SleepRefused(502, "engine_call_failed", f"Replica {replica_id!r} did not wake: {exc}") from exc
        return answer(replica)

    def woken(self, replica_id: str) -> dict[str, Any]:
        """Woken elsewhere: ready here at once (no engine call)."""
        replica = self._replica(replica_id)
        if replica.asleep is not None and not self.wakes.under_way(replica):
            self._pool.set_sleep(replica, None)
        return answer(replica)


class SleepCollector(Collector):
    """router_sleep_calls_total{kind, result}: sleeps and wakes this process made, and 503s "sleeping" found."""

    def __init__(self, wakes: Wakes) -> None:
        self._wakes = wakes

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "router_sleep_calls",
            "The sleep tier's engine calls by kind (sleep, wake, found_asleep: a 503 saying sleeping) and result.",
            labels=["kind", "result"],
        )
        for (kind, result), count in sorted(self._wakes.results.items()):
            family.add_metric([kind, result], count)
        yield family
