"""sleepAfter: a replica proven quiet that long is put to sleep, fenced at every router first.

The scaler polls every router, so it is the one place that can prove a
replica quiet everywhere (view.due_to_sleep) and fence it everywhere. The
sleep is two-phase over the routers' admin APIs: each router drains the
replica (POST .../state {"state": "draining"}) and the scaler waits until
every one reports it drained (nothing in flight); then the first router
puts it to sleep (its engine's call) and the others are told
(`"call_engine": false`). A router that fails in either phase, the telling
included, puts the replica back to ready everywhere (woken, if its engine
slept): no sleep is ever taken while a router may still send it a request,
and no router is left fencing a replica the others think ready. The model
stays active for KEDA (its replicas are quiet, not gone) until idleAfter
scales it to zero.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from router.scaler.settings import server_url

log = logging.getLogger("router.scaler.sleeper")

# How long the routers may take to drain a replica proven quiet (nothing should be in flight).
DRAIN_SECONDS = 30.0
_POLL_SECONDS = 0.05
# An engine's sleep call (vLLM offloads the weights first): the routers' own bound is 120 s.
CALL_SECONDS = 150.0


class SleepFailed(Exception):
    """A phase of a sleep did not go through; the message names the router and what it said."""


_FAILURES = (SleepFailed, aiohttp.ClientError, OSError, TimeoutError, ValueError)


class Sleeper:
    """The scaler's two-phase sleeps, one at a time per replica."""

    def __init__(self, session: aiohttp.ClientSession, token: str) -> None:
        self._session = session
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.under_way: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Sleeps by result (ok, failed), for /metrics.
        self.results: dict[str, int] = {}

    def start(self, replica_id: str, servers: list[str]) -> None:
        if replica_id in self.under_way or not servers:
            return
        self.under_way.add(replica_id)
        task = asyncio.get_running_loop().create_task(self._run(replica_id, servers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, replica_id: str, servers: list[str]) -> None:
        try:
            await self.sleep(replica_id, servers)
        except SleepFailed as exc:
            self.results["failed"] = self.results.get("failed", 0) + 1
            log.warning("replica %s was not put to sleep: %s", replica_id, exc)
        except Exception:
            # The root of a background task: counted, logged, and the scaler goes on.
            self.results["failed"] = self.results.get("failed", 0) + 1
            log.exception("putting replica %s to sleep failed", replica_id)
        else:
            self.results["ok"] = self.results.get("ok", 0) + 1
            log.info("replica %s put to sleep (fenced at %d routers)", replica_id, len(servers))
        finally:
            self.under_way.discard(replica_id)

    async def sleep(self, replica_id: str, servers: list[str], level: int = 1) -> None:
        path = f"/api/v1/replicas/{quote(replica_id, safe='')}/state"
        told = {"state": "asleep", "level": level, "call_engine": False, "wait_seconds": 0}
        try:
            for server in servers:
                await self._post(server, path, {"state": "draining"})
            deadline = asyncio.get_running_loop().time() + DRAIN_SECONDS
            for server in servers:
                while await self._state(server, replica_id) != "drained":
                    if asyncio.get_running_loop().time() > deadline:
                        raise SleepFailed(f"{server} did not drain {replica_id} within {DRAIN_SECONDS:g} s")
                    await asyncio.sleep(_POLL_SECONDS)
            await self._post(servers[0], path, {"state": "asleep", "level": level, "wait_seconds": 0})
            # A router that is not told leaves the sleep half done: asleep at some, fenced at others,
            # and none of those would wake it for a request. It is undone below, as a failed fence is.
            for server in servers[1:]:
                await self._post(server, path, told)
        # ValueError: an answer that is no JSON (orjson's error is one); it too is rolled back.
        except _FAILURES as exc:
            await self._back_to_ready(servers, replica_id, path)
            if isinstance(exc, SleepFailed):
                raise
            raise SleepFailed(f"{exc or type(exc).__name__}") from exc

    async def _back_to_ready(self, servers: list[str], replica_id: str, path: str) -> None:
        """Ready again at every router. The first one first: if it slept the engine, its wake is the
        one engine call; the others then find it awake (/is_sleeping) and make none."""
        for server in servers:
            try:
                await self._post(server, path, {"state": "ready"})
            except _FAILURES:
                log.warning("%s: %s could not be put back to ready", server, replica_id)

    async def _post(self, server: str, path: str, body: dict[str, Any]) -> Any:
        async with (
            asyncio.timeout(CALL_SECONDS),
            self._session.post(server_url(server) + path, data=orjson.dumps(body), headers=self._headers) as resp,
        ):
            answer = await resp.read()
            if resp.status != 200:
                raise SleepFailed(f"{server}: {body['state']} answered {resp.status}: {answer[:200]!r}")
            return orjson.loads(answer)

    async def _state(self, server: str, replica_id: str) -> str | None:
        async with (
            asyncio.timeout(CALL_SECONDS),
            self._session.get(server_url(server) + "/api/v1/replicas", headers=self._headers) as resp,
        ):
            rows = orjson.loads(await resp.read())
        for row in rows if isinstance(rows, list) else ():
            if isinstance(row, dict) and row.get("id") == replica_id:
                return str(row.get("state"))
        raise SleepFailed(f"{server} no longer lists {replica_id}")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
