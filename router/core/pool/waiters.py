"""The entries of the pool's lines: a waiting request, its tenant's flow, a cold model's probing; and the one hand-off.

Data only, shared by the line's order (router.core.pool.fairness), the
queue at the limits (queues), the waits for one replica (pinned) and the
holds of a cold model (coldstart); what each does with them is its own.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable

from router.core.clock import Timer
from router.core.config.tenants import ANYONE, Caller
from router.core.pool.replicas import Replica

# While a model is cold, one held request at a time is tried on its replicas,
# this long after the last try failed, doubling up to the cap: an engine that
# starts to answer is found within the cap, and is not flooded while it loads.
PROBE_FIRST_SECONDS = 0.05
PROBE_CAP_SECONDS = 0.2


class Waiter:
    """A request waiting for a replica of `model`: handed one (or None: none can take it) by the pool.

    A held waiter (`hold`) waits for its model to come up: it is never handed
    None by the pool, only a replica, or the end (deadline, shutdown).
    """

    __slots__ = (
        "avoid",
        "caller",
        "charge",
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

    def __init__(  # noqa: PLR0917 (a value object: its fields in order, made on the request path)
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
        charge: Charge | None = None,
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
        # With fairness_unit = "tokens": what it costs its tenant's turn, and who paid it.
        self.charge = charge
        # Its tenant's flow in its class, while it is queued (router.core.pool.fairness).
        self.flow: Flow | None = None
        # Its deadline passed before a replica was handed over.
        self.expired = False
        # The probing whose probe it was handed, if it was.
        self.probe: Probing | None = None


class Charge:
    """A request's cost to its tenant's turn when shares count tokens, and the flow that paid it.

    Made by the gateway for a request that waits, with its estimate: the
    prompt's bytes / 4 plus `output_weight` times the output it may make.
    The answer's own usage settles it (`settle`): the difference is charged
    to, or given back to, the flow that paid, while that flow is in the round.
    """

    __slots__ = ("flow", "output_weight", "tokens")

    def __init__(self, tokens: float, output_weight: float) -> None:
        self.tokens = tokens
        self.output_weight = output_weight
        # The flow whose turn paid for it; None until a pick of the round served it.
        self.flow: Flow | None = None

    def settle(self, prompt: int, completion: int) -> None:
        """What the answer said it took: the flow that paid the estimate pays the difference, or is
        given it back, up to a turn's worth (its quantum) of credit."""
        flow = self.flow
        if flow is not None:
            owed = prompt + self.output_weight * completion - self.tokens
            if owed >= 0:
                flow.deficit -= owed
            else:
                # An estimate far past the answer (a bound of many answers, `n`, that wrote little)
                # was paid with turns the round gave every waiting flow at once (_paying): given back
                # whole, it would be credit that serves this tenant alone for as many turns.
                flow.deficit = min(flow.deficit - owed, max(flow.deficit, flow.quantum))
            self.flow = None


class Flow:
    """One tenant's requests in one class, oldest first, and what is left of its turn."""

    __slots__ = ("band", "deficit", "quantum", "started", "tenant", "waiters")

    def __init__(self, band: int, tenant: str, quantum: float) -> None:
        self.band = band
        self.tenant = tenant
        # Requests served per turn (at least one): the tenant's weight over the smallest.
        self.quantum = quantum
        # Requests it may still be served in this turn; below 1, its turn is over.
        self.deficit = 0.0
        # With tokens: its turn has begun (its quantum added), and goes on while it can pay.
        self.started = False
        self.waiters: OrderedDict[Waiter, None] = OrderedDict()


class Probing:
    """A model whose replicas do not answer yet (none, or all refusing): its held requests probe one at a time."""

    __slots__ = ("backoff", "timer", "under_way")

    def __init__(self) -> None:
        self.backoff = PROBE_FIRST_SECONDS
        self.under_way = False
        # The next probe.
        self.timer: Timer | None = None


async def handed(future: asyncio.Future[Replica | None], give_back: Callable[[Replica], None]) -> Replica | None:
    """What a waiter is handed: the replica, or None. A waiter cancelled (its client gone) after the
    hand-off but before it ran gives the replica back (`give_back`), so that the next one gets it."""
    try:
        return await future
    except asyncio.CancelledError:
        if future.done() and not future.cancelled() and future.exception() is None:
            replica = future.result()
            if replica is not None:
                give_back(replica)
        raise
