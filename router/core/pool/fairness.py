"""Who gets a model's next free slot: held requests first, then the classes in order, aged, and tenants fairly.

A model's `Line` keeps its waiting requests in the shape the choice needs:

    Line
    ├── held        requests held for the cold model (router.core.pool.coldstart), oldest first
    └── bands       one per priority class, highest first
        ├── arrivals   the class's requests, oldest first: what aging looks at
        └── flows      one per tenant with requests in the class, FIFO, in the
                       order of the round (the tenant whose turn it is first)

The next request to serve (`next`):

1. a held request, the oldest: it waited for the model to start, longer than
   anything queued behind the limits since;
2. a request of a class below the first one waiting whose wait has reached
   its class's `max_queue_seconds`: aged, it goes before the higher classes
   (the oldest such), so that no class starves under a flood of a higher one;
3. else, in the first class with requests, the oldest request of the tenant
   whose turn it is: a deficit round robin (Shreedhar and Varghese), where a
   turn serves `weight / unit_weight` requests, the fraction left carried to
   the tenant's next turn, so that over time each tenant waiting gets slots in
   proportion to its weight. With `fairness_unit = "tokens"` a turn is worth
   `weight / unit_weight` times QUANTUM_TOKENS tokens and a request costs its
   estimate (its `Charge`), so that the shares count tokens (`_paying`).

Each step reads the heads of a few ordered dicts and moves one entry: a
pick costs the same with ten waiting requests or ten thousand, with one
tenant or a hundred. A request that leaves (client gone, deadline) is
removed from each dict in O(1).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

from router.core.config.tenants import QUANTUM_TOKENS, Queueing
from router.core.pool.waiters import Flow, Waiter


class _Band:
    """One priority class's requests: in arrival order, and per tenant in the order of the round."""

    __slots__ = ("arrivals", "flows", "max_queue")

    def __init__(self, max_queue: float | None) -> None:
        self.max_queue = max_queue
        self.arrivals: OrderedDict[Waiter, None] = OrderedDict()
        # A tenant's flow is here while it has requests; the first is the one whose turn it is.
        self.flows: OrderedDict[str, Flow] = OrderedDict()


class Line:
    """One model's waiting requests, held and queued, and the order in which slots go to them."""

    __slots__ = ("held", "_bands", "_count", "_per_tenant", "_quantum", "_tokens", "_unit")

    def __init__(self, queueing: Queueing) -> None:
        self.held: OrderedDict[Waiter, None] = OrderedDict()
        self._bands = [_Band(c.max_queue_seconds) for c in queueing.classes]
        self._unit = queueing.unit_weight
        # fairness_unit = "tokens": a turn is worth QUANTUM_TOKENS a unit of weight, a request its charge.
        self._tokens = queueing.unit == "tokens"
        self._quantum = QUANTUM_TOKENS if self._tokens else 1.0
        self._per_tenant: dict[str, int] = {}
        self._count = 0

    def __len__(self) -> int:
        """Requests waiting, held ones included."""
        return self._count

    def add(self, waiter: Waiter, *, first: bool = False) -> None:
        """A request joins the line: held, or last of its tenant's flow in its class. `first`: a held one put back."""
        if waiter.hold:
            self.held[waiter] = None
            if first:
                self.held.move_to_end(waiter, last=False)
        else:
            band = self._bands[waiter.priority]
            band.arrivals[waiter] = None
            caller = waiter.caller
            tenant = caller.tenant
            flow = band.flows.get(tenant)
            if flow is None:
                # Last in the round: a tenant that arrives waits for the others' turns.
                flow = band.flows[tenant] = Flow(
                    waiter.priority, tenant, max(1.0, caller.weight / self._unit) * self._quantum
                )
            flow.waiters[waiter] = None
            waiter.flow = flow
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._count += 1

    def discard(self, waiter: Waiter) -> None:
        """A request leaves the line (served, gone, timed out); nothing if it already left."""
        if waiter.hold:
            if waiter not in self.held:
                return
            del self.held[waiter]
        else:
            flow = waiter.flow
            if flow is None or waiter not in flow.waiters:
                return
            del flow.waiters[waiter]
            band = self._bands[flow.band]
            del band.arrivals[waiter]
            if not flow.waiters and band.flows.get(flow.tenant) is flow:
                # An emptied flow leaves the round, and what was left of its turn with it.
                del band.flows[flow.tenant]
            tenant = flow.tenant
            left = self._per_tenant[tenant] - 1
            if left:
                self._per_tenant[tenant] = left
            else:
                del self._per_tenant[tenant]
        self._count -= 1

    def next(self, now: Callable[[], float]) -> Waiter | None:
        """The request the next free slot goes to (still in the line); requests already gone are dropped.

        `now` is the clock, read only when a lower class has requests that may be aged.
        """
        held = self.held
        bands = self._bands
        count = len(bands)
        while True:
            if held:
                waiter = next(iter(held))
            else:
                first = 0
                while first < count and not bands[first].flows:
                    first += 1
                if first == count:
                    return None
                flows = bands[first].flows
                flow = _paying(flows) if self._tokens else next(iter(flows.values()))
                waiter = next(iter(flow.waiters))
                time: float | None = None
                for index in range(first + 1, count):
                    band = bands[index]
                    if band.max_queue is not None and band.arrivals:
                        oldest = next(iter(band.arrivals))
                        if time is None:
                            time = now()
                        if time - oldest.since >= band.max_queue and (
                            waiter.priority == first or oldest.since < waiter.since
                        ):
                            # Aged: before the higher classes (the oldest of the aged first).
                            waiter = oldest
            if not waiter.future.done():
                return waiter
            # Gone (client left, deadline): its own finally removes it too; skip it now.
            self.discard(waiter)

    def take(self, waiter: Waiter, *, served: bool) -> None:
        """`waiter`, which next() chose, leaves the line; `served`: it got a slot, which its tenant's turn pays."""
        flow = waiter.flow
        if served and flow is not None and waiter in flow.waiters:
            flows = self._bands[flow.band].flows
            # Only a pick of the round pays for the turn; an aged one is a debt of the class, not the tenant.
            if next(iter(flows.values())) is flow and next(iter(flow.waiters)) is waiter:
                if self._tokens:
                    # next() saw to it that the turn pays for it (_paying): the next pick rotates.
                    charge = waiter.charge
                    flow.deficit -= charge.tokens if charge is not None else 1.0
                    if charge is not None:
                        charge.flow = flow
                    self.discard(waiter)
                    return
                if flow.deficit < 1.0:
                    flow.deficit += flow.quantum
                flow.deficit -= 1.0
                if flow.deficit < 1.0 and len(flow.waiters) > 1:
                    flows.move_to_end(flow.tenant)
        self.discard(waiter)

    def oldest_held(self) -> Waiter | None:
        """The held request first in line (the next probe while the model is cold)."""
        return next(iter(self.held), None)

    def oldest_seq(self) -> int:
        """The arrival number of the oldest request waiting; -1 with none."""
        heads = [next(iter(self.held)).seq] if self.held else []
        heads += [next(iter(band.arrivals)).seq for band in self._bands if band.arrivals]
        return min(heads, default=-1)

    def queued_of(self, tenant: str) -> int:
        """Requests of `tenant` queued now, every class together."""
        return self._per_tenant.get(tenant, 0)

    def flows(self) -> Iterator[Flow]:
        """Every tenant's flow with requests, class by class."""
        for band in self._bands:
            yield from band.flows.values()


def _cost(flow: Flow) -> float:
    charge = next(iter(flow.waiters)).charge
    return charge.tokens if charge is not None else 1.0


def _paying(flows: OrderedDict[str, Flow]) -> Flow:
    """With tokens: the flow whose turn can pay for its oldest request, the round moved on to it.

    A deficit round robin as Shreedhar and Varghese wrote it: a turn adds the
    flow's quantum, serves while what is left pays for its next request, then
    passes, the rest kept for the next turn. A request dearer than a quantum
    takes several turns to pay; rather than go round in vain, once a whole
    round has passed with nobody able to pay, every flow is given at once the
    rounds it would take the first of them to pay (O(tenants), and rare).
    """
    passed = 0
    while True:
        flow = next(iter(flows.values()))
        cost = _cost(flow)
        if flow.deficit >= cost:
            return flow
        if not flow.started:
            flow.started = True
            flow.deficit += flow.quantum
            if flow.deficit >= cost:
                return flow
        # Its turn is over: the rest is kept for its next.
        flow.started = False
        flows.move_to_end(flow.tenant)
        passed += 1
        if passed == len(flows):
            rounds = min(math.ceil((_cost(f) - f.deficit) / f.quantum) for f in flows.values()) - 1
            if rounds > 0:
                for f in flows.values():
                    f.deficit += rounds * f.quantum
            passed = 0


class Lines(dict[str, Line]):
    """Every model's line, present while it has requests: an empty dict is the hot path's one test."""

    __slots__ = ("queueing",)

    def __init__(self, queueing: Queueing) -> None:
        super().__init__()
        self.queueing = queueing

    def open(self, model: str) -> Line:
        """`model`'s line, made if it has none."""
        line = self.get(model)
        if line is None:
            line = self[model] = Line(self.queueing)
        return line

    def close(self, model: str, line: Line) -> None:
        """`line` is gone once empty, so that release() finds no line to serve."""
        if not line and self.get(model) is line:
            del self[model]
