"""Reading each replica's `/v1/models` when it joins and when it is readmitted: the model cards.

A background task, apart from every request: a card that was never read is
left out of the catalog's answers, never waited for. A replica is read once
it is in the set and ready; again after it was ejected and came back (a
restarted engine may serve a different max_model_len); and, while its read
fails (an engine still loading refuses connections), again at most every
`retry` seconds.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from router.core.cards import Cards, read_card
from router.core.pool import Pool
from router.core.replicas import Replica, ReplicaState

log = logging.getLogger("router.control.cards")


class CardReader:
    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        cards: Cards,
        *,
        every: float = 1.0,
        timeout: float = 5.0,
        retry: float = 10.0,
    ) -> None:
        self.pool = pool
        self.session = session
        self.cards = cards
        self.every = every
        self.retry = retry
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        # Replicas read, by object (a replica pushed again under the same id is a new one),
        # with how many times each had come back from an ejection when it was read.
        self._read: dict[Replica, int] = {}
        # When a replica whose read failed may be tried again (loop time).
        self._not_before: dict[Replica, float] = {}
        self.reads = 0

    async def read(self, replica: Replica) -> bool:
        """One replica's card, stored under its model; False when there was none to read."""
        self.reads += 1
        try:
            async with self.session.get(replica.base_url + "/v1/models", timeout=self._timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return False
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        try:
            card = read_card(orjson.loads(body), replica.model)
        except orjson.JSONDecodeError:
            return False
        if card is None:
            return False
        self.cards.put(replica.model, card)
        return True

    async def round(self) -> None:
        """Read the replicas that joined or came back since the last round."""
        now = asyncio.get_running_loop().time()
        current = {replica for replica in self.pool if not replica.removed}
        self._read = {r: back for r, back in self._read.items() if r in current}
        self._not_before = {r: t for r, t in self._not_before.items() if r in current}
        due = [
            r
            for r in current
            if self._read.get(r) != r.recoveries
            and r.state is ReplicaState.READY
            and self._not_before.get(r, 0.0) <= now
        ]
        if not due:
            return
        results = await asyncio.gather(*(self.read(r) for r in due))
        for replica, read in zip(due, results, strict=True):
            if read:
                self._read[replica] = replica.recoveries
                self._not_before.pop(replica, None)
            else:
                self._not_before[replica] = now + self.retry

    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:
                # The root of a background task: log, and read again next time.
                log.exception("model card round failed")
            await asyncio.sleep(self.every)
