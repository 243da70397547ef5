"""Reading each busy replica's engine load, off the request path, at an interval (`engine_metrics_seconds`).

What costs least first. A vLLM answer that is not a stream carries its
engine's queue and KV cache when the request asks (ORCA, the gateway's
forward.py): a replica that answers often needs no other read. Otherwise
SGLang's small `/v1/loads` JSON, or the engine's Prometheus page, of which
only the few families routing needs are read (engine_metrics.py). A replica
whose engine is not configured is recognised by its model card (vLLM, SGLang
and llama.cpp write their name in `owned_by`: router.control.cards), and a
page that is not the engine's it was taken for, by the names it exports; a
replica whose engine is still not known is not read (its load is its
requests here), one whose page names none we know is left alone for a
while (`RECOGNISE_AGAIN_SECONDS`).

Only the replicas of models with traffic now or in the last `busy_for`
seconds are read: a quiet model's engines change no pick, and a sleeping or
cold replica is never woken by a read. A read is bounded in time and bytes,
and is never a use: it stamps nothing in the usage map. A read that fails
leaves the replica picked by this router's own counts once its reading goes
stale (router.core.pool.loads); it is tried again after `FAILED_AGAIN_SECONDS`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.pool.reports import Reading, from_metrics, from_sglang_loads, recognise
from router.http.client import Client, ConnectFailed, ConnectionBroken, HeadTimeout
from router.http.origin import origin_of

log = logging.getLogger("router.control.engines")

# A Prometheus page is read up to this many bytes: vLLM's is about 60 KB an engine core.
PAGE_BYTES = 512 * 1024
# Reads under way at once.
READS_AT_ONCE = 64
# A replica whose engine could not be recognised, or whose read failed, is left alone this long.
RECOGNISE_AGAIN_SECONDS = 60.0
FAILED_AGAIN_SECONDS = 5.0


class EngineReader:
    """Reads the engines of busy models, each at most once an interval, and hands the pool what they say."""

    def __init__(self, pool: Pool, client: Client, *, every: float, busy_for: float = 30.0) -> None:
        self.pool = pool
        self.client = client
        self.every = every
        self.busy_for = busy_for
        self._timeout = min(2.0, max(0.5, 2 * every))
        # When each model last had requests in flight, as the rounds saw it (monotonic).
        self._busy_at: dict[str, float] = {}
        # Each model's picks as the last round saw them: a change is traffic since.
        self._picks: dict[str, int] = {}
        # Replicas left alone until then (monotonic): a failed read, an engine not recognised.
        self._not_before: dict[Replica, float] = {}
        self.reads = 0
        self.failures = 0

    def due(self, now: float) -> list[Replica]:
        """The replicas to read now: ready ones of busy models whose reading is older than an interval."""
        pool = self.pool
        due: list[Replica] = []
        busy_at = self._busy_at
        picks = self._picks
        for model, candidates in pool.candidates_by_model():
            # (A model first seen has had no traffic yet, but for what is in flight.)
            if candidates.total_in_flight or picks.setdefault(model, candidates.picks) != candidates.picks:
                picks[model] = candidates.picks
                busy_at[model] = now
            elif now - busy_at.get(model, -1e18) > self.busy_for:
                busy_at.pop(model, None)
                continue
            for replica in candidates:
                if replica.engine is None:
                    # Not known (not configured, not said by its model card): its load is its requests here.
                    continue
                load = replica.load
                if load is not None and pool.clock.now() - load.at < self.every:
                    continue
                if self._not_before.get(replica, 0.0) > now:
                    continue
                due.append(replica)
        return due

    async def round(self) -> None:
        now = time.monotonic()
        due = self.due(now)
        loads = self.pool.engine_loads
        if loads is None:
            return
        for start in range(0, len(due), READS_AT_ONCE):
            batch = due[start : start + READS_AT_ONCE]
            readings = await asyncio.gather(*(self.read(replica) for replica in batch))
            for replica, reading in zip(batch, readings, strict=True):
                if reading is None:
                    continue
                source, load = reading
                loads.record(replica, load.waiting, load.running, load.kv, source)
        # Forget what left the set.
        if self._not_before:
            self._not_before = {r: t for r, t in self._not_before.items() if t > now and not r.removed}

    async def read(self, replica: Replica) -> tuple[str, Reading] | None:
        """One replica's engine load, and where it was read from; None when it could not be read."""
        self.reads += 1
        engine = replica.engine
        path = b"/v1/loads?include=core" if engine == "sglang" else b"/metrics"
        body = await self._get(replica, path)
        if body is None and engine == "sglang":
            path, body = b"/metrics", await self._get(replica, b"/metrics")
        if body is None:
            self._failed(replica, FAILED_AGAIN_SECONDS)
            return None
        if path == b"/v1/loads?include=core":
            reading = from_sglang_loads(body)
            return None if reading is None else ("loads", reading)
        reading = from_metrics(engine or "", body)
        if reading is None:
            # Another engine than it was taken for (a model card can mislead): the names it exports say which.
            found = recognise(body)
            if found is not None and found != engine:
                log.info("replica %s exports %s's metrics; read as %s from now on", replica.id, found, found)
                replica.engine = found
                reading = from_metrics(found, body)
        if reading is None:
            self._failed(replica, RECOGNISE_AGAIN_SECONDS)
            return None
        return ("metrics", reading)

    def _failed(self, replica: Replica, seconds: float) -> None:
        self.failures += 1
        self._not_before[replica] = time.monotonic() + seconds

    async def _get(self, replica: Replica, path: bytes) -> bytes | None:
        origin = origin_of(replica.base_url)
        head = b"GET %b%b HTTP/1.1\r\nHost: %b\r\nAccept-Encoding: identity\r\n\r\n" % (
            origin.prefix,
            path,
            origin.host_header,
        )
        try:
            async with asyncio.timeout(self._timeout):
                resp = await self.client.request(origin, head, b"", self._timeout)
                try:
                    if resp.status != 200:
                        return None
                    return await resp.read(PAGE_BYTES)
                finally:
                    resp.release()
        except (ConnectFailed, ConnectionBroken, HeadTimeout, TimeoutError):
            return None

    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:
                # The root of a background task: log, and read again next time.
                log.exception("engine load round failed")
            await asyncio.sleep(self.every)
