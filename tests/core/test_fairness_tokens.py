"""Shares counted in tokens: a tenant's turn pays for its requests' estimates, settled by their usage."""

from __future__ import annotations

import asyncio
from collections import Counter

from router.core.config.tenants import QUANTUM_TOKENS, Caller, Queueing
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.pool.waiters import Charge
from tests.core.test_fairness import CLASSES, busy_pool

TOKENS = Queueing(CLASSES, unit="tokens", output_weight=4.0)


class Charged:
    """Requests queued with their costs, recorded in the order the slot reaches them, with their charges."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.order: list[str] = []
        self.charges: dict[str, Charge] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def ask(self, name: str, caller: Caller, tokens: float) -> None:
        charge = self.charges[name] = Charge(tokens, 4.0)

        async def wait() -> None:
            replica, _ = await self.pool.queues.acquire_or_wait("m", wait_seconds=1000, caller=caller, charge=charge)
            assert replica is not None
            self.order.append(name)

        self.tasks.append(asyncio.create_task(wait()))

    async def serve(self, replica: Replica, count: int) -> list[str]:
        await asyncio.sleep(0)
        before = len(self.order)
        for _ in range(count):
            self.pool.release(replica)
        await asyncio.sleep(0)
        return self.order[before:]


def tenants(order: list[str]) -> Counter[str]:
    return Counter(name[0] for name in order)


async def test_a_tenant_of_short_requests_gets_as_many_more_as_the_long_ones_cost() -> None:
    """Long requests cost 2,000 tokens, short ones 100: while both wait, 20 short ones go for each long one."""
    pool, replica = busy_pool(TOKENS)
    queued = Charged(pool)
    for i in range(10):
        queued.ask(f"long{i}", Caller("l"), 2000)
    for i in range(200):
        queued.ask(f"short{i}", Caller("s"), 100)
    order = await queued.serve(replica, 105)
    counts = tenants(order)
    # Tokens served differ by at most a quantum and a request: 5 long (10,000) against 100 short (10,000).
    assert abs(counts["l"] * 2000 - counts["s"] * 100) <= QUANTUM_TOKENS + 2000
    assert counts["l"] in (4, 5, 6)
    for task in queued.tasks:
        task.cancel()
    await asyncio.gather(*queued.tasks, return_exceptions=True)


async def test_requests_as_the_unit_alternate_whatever_they_cost() -> None:
    pool, replica = busy_pool()
    queued = Charged(pool)
    for i in range(10):
        queued.ask(f"long{i}", Caller("l"), 2000)
    for i in range(10):
        queued.ask(f"short{i}", Caller("s"), 100)
    assert tenants(await queued.serve(replica, 20)) == {"l": 10, "s": 10}


async def test_weights_scale_a_turn_in_tokens() -> None:
    """Weight 2 against 1, equal costs: two of a's for each of b's."""
    pool, replica = busy_pool(Queueing(CLASSES, unit_weight=1.0, unit="tokens"))
    queued = Charged(pool)
    for i in range(60):
        queued.ask(f"a{i}", Caller("a", weight=2.0), 512)
        queued.ask(f"b{i}", Caller("b"), 512)
    counts = tenants(await queued.serve(replica, 60))
    assert abs(counts["a"] - 40) <= 2
    for task in queued.tasks:
        task.cancel()
    await asyncio.gather(*queued.tasks, return_exceptions=True)


async def test_a_request_dearer_than_many_quanta_waits_the_turns_it_takes_to_pay() -> None:
    """One request of 50 quanta against requests of a quarter quantum: about 200 of them before it."""
    pool, replica = busy_pool(TOKENS)
    queued = Charged(pool)
    queued.ask("huge", Caller("h"), 50 * QUANTUM_TOKENS)
    for i in range(260):
        queued.ask(f"small{i}", Caller("s"), QUANTUM_TOKENS / 4)
    order = await queued.serve(replica, 250)
    assert "huge" in order
    assert 190 <= order.index("huge") <= 210
    for task in queued.tasks:
        task.cancel()
    await asyncio.gather(*queued.tasks, return_exceptions=True)


async def test_usage_settles_an_estimate_against_the_tenant_that_paid() -> None:
    """A tenant whose answers took far more than estimated pays it back in later turns."""
    pool, replica = busy_pool(TOKENS)
    queued = Charged(pool)
    for i in range(40):
        queued.ask(f"x{i}", Caller("x"), 100)
        queued.ask(f"y{i}", Caller("y"), 100)
    first = await queued.serve(replica, 20)
    for name in first:
        if name.startswith("x"):
            # Each of x's answers says 1,000 prompt tokens and 100 out: 1,400 against 100.
            queued.charges[name].settle(1000, 100)
    later = tenants(await queued.serve(replica, 20))
    assert later["y"] >= 18
    # Settled once: a second settle changes nothing.
    charge = queued.charges[first[0]]
    assert charge.flow is None
    for task in queued.tasks:
        task.cancel()
    await asyncio.gather(*queued.tasks, return_exceptions=True)


async def test_an_estimate_far_past_its_answer_gives_back_no_more_than_a_turn() -> None:
    """A tenant alone in the line with a request of 128 answers' bound (estimated 2,097,152): the round
    gives it the turns to pay. Its answer took 522; what it gave back beyond a turn is not credit
    that serves it before a tenant that came meanwhile."""
    pool, replica = busy_pool(TOKENS)
    queued = Charged(pool)
    queued.ask("abig", Caller("a"), 4 * 4096 * 128)
    for i in range(300):
        queued.ask(f"a{i}", Caller("a"), 100)
    assert await queued.serve(replica, 1) == ["abig"]
    for i in range(300):
        queued.ask(f"b{i}", Caller("b"), 100)
    await asyncio.sleep(0)
    queued.charges["abig"].settle(10, 128)
    # Equal costs: about a turn (1,024 tokens: 10 requests) each in turn, a's credit at most a turn more.
    counts = tenants(await queued.serve(replica, 60))
    assert counts["b"] >= 20, counts
    for task in queued.tasks:
        task.cancel()
    await asyncio.gather(*queued.tasks, return_exceptions=True)
