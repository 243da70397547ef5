"""A request waiting in its model's line: the entry that the pool's queue and the holds share."""

from __future__ import annotations

import asyncio
from collections.abc import Container, Hashable
from typing import TYPE_CHECKING

from router.core.replicas import Replica
from router.core.tenants import ANYONE, Caller

if TYPE_CHECKING:
    from router.core.coldstart import ColdSpell
    from router.core.fairness import Flow


class Waiter:
    """A request waiting for a replica of `model`: handed one (or None: none can take it) by the pool.

    A held waiter (`hold`) waits for its model to come up: it is never handed
    None by the pool, only a replica, or the end (deadline, shutdown).
    """

    __slots__ = (
        "avoid",
        "caller",
        "deadline",
        "exclude",
        "expired",
        "flow",
        "future",
        "hold",
        "key",
        "model",
        "priority",
        "probe",
        "seq",
        "since",
    )

    def __init__(
        self,
        future: asyncio.Future[Replica | None],
        model: str,
        avoid: Replica | None,
        exclude: Container[Replica],
        seq: int,
        hold: bool = False,
        since: float = 0.0,
        deadline: float = 0.0,
        key: Hashable | None = None,
        caller: Caller = ANYONE,
        priority: int = 0,
    ) -> None:
        self.future = future
        self.model = model
        self.avoid = avoid
        self.exclude = exclude
        self.seq = seq
        self.hold = hold
        # Monotonic time it began waiting (the oldest held request's age, a queued one's for aging).
        self.since = since
        # When its wait ends with None, in the clock's time.
        self.deadline = deadline
        # The request's affinity key (session, prefix): it keeps it while it waits.
        self.key = key
        # Whose request it is, and the rank of its class (0 the first): where it waits in its model's line.
        self.caller = caller
        self.priority = priority
        # Its tenant's flow in its class, while it is queued (router.core.fairness).
        self.flow: Flow | None = None
        # Its deadline passed before a replica was handed over.
        self.expired = False
        # The cold spell whose probe it was handed, if it was.
        self.probe: ColdSpell | None = None
