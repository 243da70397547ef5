"""Requests that one replica alone can serve, waiting while it is busy: a line per replica.

A request that continues a response (`previous_response_id`, `GET
/v1/responses/{id}`) must reach the replica that keeps it. While that
replica is only at a limit (`max_in_flight_per_replica`, or the router at
`max_in_flight`) the request waits for it, as any request waits in its
model's line, up to the queue's timeout; it is told None at once, or while
it waits, when the replica is gone, draining or ejected: what it keeps is
lost with it. A slot that frees on the replica goes to these first, since
the others may take any replica of the model.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping

from router.core.clock import Clock
from router.core.pool.replicas import Replica, ReplicaState
from router.core.pool.waiters import Waiter, handed


class PinnedLines:
    """The pool's requests pinned to one replica each; it hands them slots as that replica releases them."""

    __slots__ = ("lines", "_acquire_this", "_by_id", "_clock", "_release", "_seq")

    def __init__(
        self,
        clock: Clock,
        by_id: Mapping[str, Replica],
        seq: Callable[[], int],
        acquire_this: Callable[[str], Replica | None],
        release: Callable[[Replica], None],
    ) -> None:
        """The pool's: its replicas by id, its arrival numbers, its acquire_this() and release()."""
        self._clock = clock
        self._by_id = by_id
        self._seq = seq
        self._acquire_this = acquire_this
        self._release = release
        # Per replica, its waiting requests, oldest first (removed in O(1) when one leaves).
        self.lines: dict[Replica, OrderedDict[Waiter, None]] = {}

    async def wait(self, replica_id: str, *, wait_seconds: float) -> tuple[Replica | None, bool]:
        """acquire_this(), or wait up to `wait_seconds` while that replica (or the router) is at its limit.

        Returns (replica, timed_out) as the pool's acquire_or_wait() does: None
        and False when the replica is gone, draining or ejected, at once or
        while the request waits.
        """
        replica = self._acquire_this(replica_id)
        if replica is not None:
            return replica, False
        wanted = self._by_id.get(replica_id)
        if wanted is None or wanted.state is not ReplicaState.READY:
            return None, False
        future: asyncio.Future[Replica | None] = asyncio.get_running_loop().create_future()
        waiter = Waiter(future, wanted.model, None, (), self._seq())
        queue = self.lines.get(wanted)
        if queue is None:
            queue = self.lines[wanted] = OrderedDict()
        queue[waiter] = None
        timer = self._clock.call_at(self._clock.now() + wait_seconds, lambda: _expire(waiter))
        try:
            replica = await handed(future, self._release)
        finally:
            timer.cancel()
            queue.pop(waiter, None)
            if not queue and self.lines.get(wanted) is queue:
                del self.lines[wanted]
        return replica, waiter.expired

    def hand_off(self, replica: Replica) -> None:
        """Give `replica`'s free slots to the requests only it can serve, oldest first."""
        queue = self.lines.get(replica)
        while queue:
            waiter = next(iter(queue))
            if not waiter.future.done():
                if self._by_id.get(replica.id) is replica and replica.state is ReplicaState.READY:
                    handed = self._acquire_this(replica.id)
                    if handed is None:
                        # Still at a limit: they wait for its next release.
                        return
                else:
                    # Gone, draining or ejected: what it keeps is lost with it.
                    handed = None
                waiter.future.set_result(handed)
            queue.popitem(last=False)

    def released(self, replica: Replica, router_wide: bool) -> None:
        """`replica` has a slot free: its own line first; under a router-wide limit (`router_wide`), every line."""
        self.hand_off(replica)
        if router_wide:
            for other in list(self.lines):
                self.hand_off(other)

    def count_into(self, counts: dict[str, int]) -> None:
        """Add the waiting requests to `counts`, by model."""
        for replica, queue in self.lines.items():
            if queue:
                counts[replica.model] = counts.get(replica.model, 0) + len(queue)


def _expire(waiter: Waiter) -> None:
    """Its deadline passed before a slot was handed over: it gets None, and timed out."""
    if not waiter.future.done():
        waiter.expired = True
        waiter.future.set_result(None)
