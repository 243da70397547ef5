"""Active health checks: GET a path of every replica on an interval.

Passive ejection learns from client requests; this learns without them. A
2xx brings an ejected replica back before its ejection time is up; anything
else, or no answer within the timeout, ejects a ready replica (within the
pool's limits: never more than half of a model, never the last) before a
client meets it. vLLM, SGLang and llama.cpp's llama-server all serve
`/health` (llama-server also `/v1/health`), each 503 while the model loads;
SGLang's runs a one-token generation and takes a second at least, hence the
5 s default timeout (docs/engines.md: each engine's).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica, ReplicaState

log = logging.getLogger("router.control.health")


class HealthChecker:
    """GETs a path of every replica on an interval: ejects the failing, readmits the healthy."""

    def __init__(
        self, pool: Pool, session: aiohttp.ClientSession, *, path: str, interval: float, timeout: float
    ) -> None:
        self.pool = pool
        self.session = session
        self.path = path
        self.interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.checks = 0
        self.failures = 0

    async def check(self, replica: Replica) -> bool:
        try:
            async with self.session.get(replica.base_url + self.path, timeout=self._timeout) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def check_all(self) -> None:
        replicas = [r for r in self.pool if not r.removed]
        results = await asyncio.gather(*(self.check(r) for r in replicas))
        for replica, healthy in zip(replicas, results, strict=True):
            self.checks += 1
            if healthy:
                if replica.state is ReplicaState.EJECTED:
                    self.pool.ejections.readmit(replica, "health check passed")
                self.pool.record_success(replica)
            else:
                self.failures += 1
                self.pool.ejections.try_eject(replica, f"health check GET {self.path} failed")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:
                # The root of a background task: log, and check again next time.
                log.exception("health check round failed")
