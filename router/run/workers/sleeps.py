"""Sleep across `--workers`: the fence in every worker, one engine call by the supervisor, then every worker told.

A worker alone cannot put a replica to sleep: another worker may still send
it requests. The supervisor drains it in every worker (the change fanned out
as any drain is), waits until their combined report shows it drained (none
has it in flight), makes the engine's sleep call itself, then tells every
worker it is asleep (`"call_engine": false`); a worker that is not told
has the sleep undone (the engine woken, every worker told ready), as a
router that is not told has it undone by `router ctl sleep`. Waking it by
hand is the same in reverse: one wake call here, then every worker told it
is ready.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import orjson

from router.control.fleet import FleetUnavailable
from router.control.sleeping import SLEEP_CALL_SECONDS, SleepRefused
from router.core.pool.sleep import EngineCall, EngineCallFailed, SleepApi, put_to_sleep, sleep_api, wake_up
from router.core.usage.snapshots import ReplicaUsage

if TYPE_CHECKING:
    from router.run.workers.fanout import SupervisedFleet

log = logging.getLogger("router.run.workers.sleeps")

_POLL_SECONDS = 0.05


class SupervisedSleeps:
    """The supervisor's sleeps and wakes of a replica, for all of its workers at once."""

    def __init__(self, call: EngineCall, wake_timeout: float) -> None:
        self._call = call
        self._wake_timeout = wake_timeout
        # Replicas being put to sleep now: a second sleep is refused, as a single process refuses it,
        # rather than a second drain and engine call; and ready is refused until it ends.
        self.under_way: set[str] = set()

    @staticmethod
    async def _usage(fleet: SupervisedFleet, replica_id: str) -> ReplicaUsage:
        for r in (await fleet.snapshot()).replicas:
            if r.id == replica_id:
                return r
        raise SleepRefused(404, "replica_not_found", f"No replica with id {replica_id!r}.")

    async def sleep(
        self, fleet: SupervisedFleet, replica_id: str, level: int, *, call_engine: bool, wait: float
    ) -> dict[str, Any]:
        usage = await self._usage(fleet, replica_id)
        api = sleep_api(usage.engine)
        if usage.state == "asleep":
            return {"id": replica_id, "state": "asleep", "in_flight": 0, "level": level}
        if call_engine and api is None:
            raise SleepRefused(
                409,
                "cannot_sleep",
                f"Replica {replica_id!r}'s engine ({usage.engine or 'not known'}) has no sleep API.",
            )
        if usage.state in ("ejected", "waking"):
            raise SleepRefused(409, "cannot_sleep", f"Replica {replica_id!r} is {usage.state}; it cannot sleep now.")
        # No await between this check and the claim: two sleeps cannot both pass it.
        if replica_id in self.under_way:
            raise SleepRefused(409, "cannot_sleep", f"Replica {replica_id!r} is being put to sleep now.")
        self.under_way.add(replica_id)
        try:
            return await self._sleep(fleet, replica_id, level, api if call_engine else None, wait)
        finally:
            self.under_way.discard(replica_id)

    async def _sleep(
        self, fleet: SupervisedFleet, replica_id: str, level: int, api: SleepApi | None, wait: float
    ) -> dict[str, Any]:
        was_draining = replica_id in fleet.draining
        await fleet.set_draining(replica_id, True, by_sleep=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (usage := await self._usage(fleet, replica_id)).state != "drained":
            if loop.time() >= deadline:
                await fleet.set_draining(replica_id, was_draining, by_sleep=True)
                raise SleepRefused(
                    409, "still_busy", f"Replica {replica_id!r} still had {usage.in_flight} in flight after {wait:g} s."
                )
            await asyncio.sleep(_POLL_SECONDS)
        if api is not None:
            try:
                await put_to_sleep(self._call, api, usage.url, level, SLEEP_CALL_SECONDS)
            except EngineCallFailed as exc:
                await fleet.set_draining(replica_id, was_draining, by_sleep=True)
                raise SleepRefused(
                    502, "engine_call_failed", f"Replica {replica_id!r}'s engine did not sleep: {exc}"
                ) from exc
        body = orjson.dumps({"state": "asleep", "level": level, "call_engine": False, "wait_seconds": 0})
        try:
            answers = await fleet.everywhere("POST", _state_path(replica_id), body)
        except FleetUnavailable as exc:
            # Asleep at some workers, fenced at the one not told, where no request would wake it:
            # undone, as a sleep across routers is when a router is not told.
            await self._undo(fleet, replica_id, usage.url, api, was_draining)
            raise FleetUnavailable(
                f"Replica {replica_id!r} was not put to sleep: a worker was not told it sleeps ({exc}); "
                "its engine was woken again and every worker told it is ready."
            ) from exc
        refused = [(status, answer) for status, answer in answers if not 200 <= status < 300]
        if refused:
            # Told, and it would not take it (the replica removed by a push while the engine slept,
            # say): not asleep there either, so undone as for a worker not told.
            await self._undo(fleet, replica_id, usage.url, api, was_draining)
            status, answer = refused[0]
            raise SleepRefused(
                409,
                "cannot_sleep",
                f"Replica {replica_id!r} was not put to sleep: a worker refused it (HTTP {status}: "
                f"{_message(answer)}); "
                + ("its engine was woken again." if api is not None else "every worker was told it is ready."),
            )
        # Asleep, no longer drained, in the state file too: a worker that restarts loads it asleep.
        fleet.asleep[replica_id] = level
        fleet.draining.discard(replica_id)
        fleet.write_state()
        return {"id": replica_id, "state": "asleep", "in_flight": 0, "level": level}

    async def _undo(
        self, fleet: SupervisedFleet, replica_id: str, url: str, api: SleepApi | None, was_draining: bool
    ) -> None:
        """The engine woken first (if this sleep called it), then ready at every worker: the ones told it
        sleeps find it awake (/is_sleeping) and make no call; the others are undrained."""
        if api is not None:
            try:
                await wake_up(self._call, api, url, self._wake_timeout, asyncio.get_running_loop().time)
            except EngineCallFailed as exc:
                log.warning("replica %s: its engine did not wake after a sleep undone: %s", replica_id, exc)
        if not was_draining:
            fleet.draining.discard(replica_id)
        fleet.asleep.pop(replica_id, None)
        fleet.write_state()
        try:
            await fleet.everywhere("POST", _state_path(replica_id), orjson.dumps({"state": "ready"}))
            if was_draining:
                await fleet.everywhere("POST", _state_path(replica_id), orjson.dumps({"state": "draining"}))
        except FleetUnavailable as exc:
            # A worker still not answering: it restarts from the state file, or takes the next change.
            log.warning("replica %s: not every worker was told it is ready again: %s", replica_id, exc)

    async def wake(self, fleet: SupervisedFleet, replica_id: str) -> dict[str, Any]:
        """One wake call, then every worker told the replica is ready."""
        usage = await self._usage(fleet, replica_id)
        api = sleep_api(usage.engine)
        if api is None:
            raise SleepRefused(409, "cannot_sleep", f"Replica {replica_id!r}'s engine has no sleep API.")
        try:
            await wake_up(self._call, api, usage.url, self._wake_timeout, asyncio.get_running_loop().time)
        except EngineCallFailed as exc:
            raise SleepRefused(502, "engine_call_failed", f"Replica {replica_id!r} did not wake: {exc}") from exc
        body = orjson.dumps({"state": "ready", "call_engine": False})
        await fleet.everywhere("POST", _state_path(replica_id), body)
        return {"id": replica_id, "state": "ready", "in_flight": 0, "level": None}


def _message(answer: bytes) -> str:
    """A worker's error answer, as its message says it (OpenAI's shape), else its first bytes."""
    try:
        return str(orjson.loads(answer)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return repr(answer[:200])


def _state_path(replica_id: str) -> str:
    return f"/api/v1/replicas/{quote(replica_id, safe='')}/state"
