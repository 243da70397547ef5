"""Reading each replica's `/v1/models` when it joins and when it is readmitted: the model cards.

A background task, apart from every request: a card that was never read is
left out of the catalog's answers, never waited for. A replica is read once
it becomes ready: when it joins the set, and again when it comes back from
an ejection or a drain (a restarted engine may serve a different
max_model_len). The pool says which replicas those are (Pool.watch_joins),
so a round costs what joined since the last, never a look at the fleet.

A read that fails (no connection: a replica that is down, or a model
scaled to zero) is not simply tried again on a timer: with a fleet of
thousands that do not answer, that is most of a quiet router's work. It is
tried again only once the replica has shown life since (a request reached
it, or it came back from an ejection), looked for at intervals that double
from `retry` up to `retry_cap`. A replica that is down or cold is never
polled.

A replica's `/v1/models` also lists the LoRA adapters its engine has loaded
(router.core.pool.adapters), and vLLM loads and unloads them at run time: a
replica that had traffic since its last read is read again once `refresh`
seconds have passed, so that a new adapter is found within that time. A
quiet replica is never read again for it: no traffic, no one asking.

What a replica answers is bounded: CARD_BYTES of body (an endless answer
is a failed read), no redirect followed (the router would fetch what a
replica names and serve its fields to clients), fields bounded in
router.core.config.cards.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging

import aiohttp
import orjson

from router.core.config.cards import Cards, adapters_of, engine_of, read_card
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica, ReplicaState

log = logging.getLogger("router.control.cards")

# A /v1/models answer is a few kilobytes (vLLM's, with a hundred LoRA adapters, tens).
CARD_BYTES = 1 << 20
# Reads under way at once: a fleet of ten thousand joining at start is read
# this many at a time, not ten thousand at once.
READS_AT_ONCE = 64


class CardReader:
    """Reads each replica's /v1/models as it joins or shows life, and keeps its model's card."""

    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        cards: Cards,
        *,
        every: float = 1.0,
        timeout: float = 5.0,
        retry: float = 10.0,
        retry_cap: float = 600.0,
        refresh: float = 30.0,
    ) -> None:
        self.pool = pool
        self.session = session
        self.cards = cards
        self.every = every
        self.retry = retry
        self.retry_cap = retry_cap
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        # Replicas to read, in the order they became ready (the pool adds to it).
        self._joined = pool.watch_joins()
        # Failed reads: (when to look again, its token, replica, the interval, its evidence of
        # life then: requests that reached it and its comebacks).
        self._retries: list[tuple[float, int, Replica, float, tuple[int, int]]] = []
        # The token of each failed replica's one live entry: an entry whose token is not
        # its replica's here is stale (the replica was read again since, or left).
        self._failing: dict[Replica, int] = {}
        self._tokens = itertools.count()
        self.reads = 0
        self.refresh = refresh
        # Each replica read: requests that had reached it then (read again once it has had more).
        self._read_with: dict[Replica, int] = {}
        self._refreshed_at: float | None = None

    async def read(self, replica: Replica) -> bool:
        """One replica's card, stored under its model; False when there was none to read."""
        self.reads += 1
        try:
            async with self.session.get(
                replica.base_url + "/v1/models",
                timeout=self._timeout,
                allow_redirects=False,
                headers={"Accept-Encoding": "identity"},
            ) as resp:
                if resp.status != 200:
                    return False
                body = bytearray()
                async for piece in resp.content.iter_chunked(65536):
                    body += piece
                    if len(body) > CARD_BYTES:
                        log.warning("replica %s: /v1/models answered over %d bytes; no card", replica.id, CARD_BYTES)
                        return False
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return False
        if replica.engine is None:
            replica.engine = engine_of(doc, replica.model)
        self.pool.adapters.learn(replica, adapters_of(doc, replica.model))
        self._read_with[replica] = replica.requests
        card = read_card(doc, replica.model)
        if card is None:
            return False
        self.cards.put(replica.model, card)
        return True

    def due(self, now: float) -> list[Replica]:
        """The replicas to read now: those that joined, then failed ones that showed life since."""
        batch: list[Replica] = []
        joined = self._joined
        failing = self._failing
        while joined and len(batch) < READS_AT_ONCE:
            replica = next(iter(joined))
            del joined[replica]
            if replica.state is ReplicaState.READY:
                failing.pop(replica, None)
                batch.append(replica)
        retries = self._retries
        while retries and retries[0][0] <= now and len(batch) < READS_AT_ONCE:
            _, token, replica, interval, evidence = heapq.heappop(retries)
            if failing.get(replica) != token:
                continue
            if replica.removed:
                del failing[replica]
            elif _evidence(replica) != evidence and replica.state is ReplicaState.READY:
                del failing[replica]
                batch.append(replica)
            else:
                # Still no sign of life: look again later, never polling it meanwhile.
                self._failed(replica, now + min(interval * 2, self.retry_cap), interval * 2, evidence)
        return batch

    def _failed(self, replica: Replica, when: float, interval: float, evidence: tuple[int, int]) -> None:
        token = self._failing[replica] = next(self._tokens)
        heapq.heappush(self._retries, (when, token, replica, min(interval, self.retry_cap), evidence))

    def refresh_busy(self, now: float) -> None:
        """Once every `refresh` seconds: the replicas read before that have had requests since, read again
        (their engines may have loaded or unloaded adapters). One look at the replicas read, no request."""
        if self._refreshed_at is not None and now < self._refreshed_at + self.refresh:
            return
        self._refreshed_at = now
        joined = self._joined
        for replica, requests in list(self._read_with.items()):
            if replica.removed:
                del self._read_with[replica]
            elif replica.requests != requests and replica.state is ReplicaState.READY:
                joined[replica] = None

    async def round(self) -> None:
        """Read the replicas that joined, or showed life after a failed read, since the last round,
        and those with traffic since their read `refresh` seconds ago."""
        now = asyncio.get_running_loop().time()
        self.refresh_busy(now)
        due = self.due(now)
        if not due:
            return
        # Evidence is taken before the read: a request that reaches the replica while it is read counts after.
        evidence = [_evidence(replica) for replica in due]
        results = await asyncio.gather(*(self.read(replica) for replica in due))
        for replica, seen, read in zip(due, evidence, results, strict=True):
            if not read and replica not in self._joined:
                self._failed(replica, now + self.retry, self.retry, seen)

    @property
    def pending(self) -> int:
        """Replicas waiting for a first read (joined) or for a sign of life (failed)."""
        return len(self._joined) + len(self._failing)

    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:
                # The root of a background task: log, and read again next time.
                log.exception("model card round failed")
            # At once while a burst of joins is still being read; else once a `every`.
            await asyncio.sleep(0 if self._joined else self.every)


def _evidence(replica: Replica) -> tuple[int, int]:
    """What changes when a replica shows life: requests that reached it, its comebacks from ejection."""
    return replica.requests, replica.recoveries
