"""The queue at the limits: priority classes, aging, per-tenant fairness and bounds, on fake time."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from router.core.config.settings import ReplicaConfig
from router.core.config.tenants import Caller, PriorityClass, Queueing, lowered
from router.core.errors import RateLimited
from router.core.pool.pool import Limits, Pool
from router.core.pool.replicas import Replica
from tests.support.clock import FakeClock

CLASSES = (PriorityClass("interactive", 60.0), PriorityClass("batch", 600.0, 30.0))
RANKS = {b"interactive": 0, b"batch": 1}
QUEUEING = Queueing(CLASSES)


def busy_pool(queueing: Queueing = QUEUEING, clock: FakeClock | None = None) -> tuple[Pool, Replica]:
    """One replica taking one request at a time, taken: everything asked for now waits."""
    pool = Pool(
        [ReplicaConfig("r0", "m", "http://127.0.0.1:9000")],
        clock=clock or FakeClock(),
        limits=Limits(per_replica=1),
        queueing=queueing,
    )
    replica = pool.acquire("m")
    assert replica is not None
    return pool, replica


class Served:
    """Requests queued in the pool, recorded in the order the slot reaches them."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.order: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    def ask(self, name: str, caller: Caller, priority: int | None = None) -> None:
        async def wait() -> None:
            replica, _ = await self.pool.queues.acquire_or_wait(
                "m", wait_seconds=1000, caller=caller, priority=priority
            )
            assert replica is not None
            self.order.append(name)

        self.tasks.append(asyncio.create_task(wait()))

    async def queued(self) -> None:
        await asyncio.sleep(0)
        assert self.pool.queues.waiting("m") == len(self.tasks) - len(self.order)

    async def serve(self, replica: Replica, count: int) -> list[str]:
        """Free the slot `count` times, each time handed to the next request in turn; their names in that order."""
        before = len(self.order)
        for _ in range(count):
            self.pool.release(replica)
        await asyncio.sleep(0)
        return self.order[before:]


async def test_a_higher_class_is_served_before_a_lower_one_that_came_first() -> None:
    pool, replica = busy_pool()
    served = Served(pool)
    for i in range(3):
        served.ask(f"batch{i}", Caller("a", priority=1))
    served.ask("interactive", Caller("b"))
    await served.queued()
    assert await served.serve(replica, 4) == ["interactive", "batch0", "batch1", "batch2"]


async def test_a_request_is_fifo_within_its_tenant_and_class() -> None:
    pool, replica = busy_pool()
    served = Served(pool)
    for i in range(5):
        served.ask(f"a{i}", Caller("a"))
    await served.queued()
    assert await served.serve(replica, 5) == ["a0", "a1", "a2", "a3", "a4"]


async def test_tenants_of_one_class_take_turns_whatever_their_backlog() -> None:
    """A tenant with 20 queued and one with 3: the slots alternate while both wait."""
    pool, replica = busy_pool()
    served = Served(pool)
    for i in range(20):
        served.ask(f"a{i}", Caller("a"))
    for i in range(3):
        served.ask(f"b{i}", Caller("b"))
    await served.queued()
    assert await served.serve(replica, 8) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4"]


async def test_freed_slots_go_to_tenants_in_proportion_to_their_weights() -> None:
    pool, replica = busy_pool(Queueing(CLASSES, unit_weight=1.0))
    served = Served(pool)
    for i in range(40):
        served.ask(f"heavy{i}", Caller("heavy", weight=2.0))
        served.ask(f"light{i}", Caller("light", weight=1.0))
    await served.queued()
    first = Counter(name.rstrip("0123456789") for name in await served.serve(replica, 30))
    assert first == {"heavy": 20, "light": 10}


async def test_a_fractional_weight_carries_what_is_left_of_its_turn_to_the_next() -> None:
    """Weights 1.5 : 1 give 3 : 2 over whole rounds, not 1 : 1."""
    pool, replica = busy_pool(Queueing(CLASSES, unit_weight=1.0))
    served = Served(pool)
    for i in range(40):
        served.ask(f"a{i}", Caller("a", weight=1.5))
        served.ask(f"b{i}", Caller("b", weight=1.0))
    await served.queued()
    first = Counter(name[0] for name in await served.serve(replica, 25))
    assert first == {"a": 15, "b": 10}


async def test_a_lower_class_waiting_past_its_max_queue_seconds_goes_before_the_higher_one() -> None:
    clock = FakeClock()
    pool, replica = busy_pool(clock=clock)
    served = Served(pool)
    served.ask("batch-old", Caller("a", priority=1))
    await served.queued()
    clock.advance(10.0)
    served.ask("batch-young", Caller("a", priority=1))
    for i in range(3):
        served.ask(f"interactive{i}", Caller("b"))
    await served.queued()
    # Not aged yet: the higher class first.
    assert await served.serve(replica, 1) == ["interactive0"]
    clock.advance(20.0)
    # 30 s for the oldest batch request: it goes next, and the younger one waits its turn.
    assert await served.serve(replica, 3) == ["batch-old", "interactive1", "interactive2"]
    assert await served.serve(replica, 1) == ["batch-young"]


async def test_aging_does_not_reorder_a_class_that_nothing_above_waits_on() -> None:
    """With only batch requests waiting, long-waiting ones still take the tenants' turns."""
    clock = FakeClock()
    pool, replica = busy_pool(clock=clock)
    served = Served(pool)
    for i in range(3):
        served.ask(f"a{i}", Caller("a", priority=1))
    served.ask("b0", Caller("b", priority=1))
    await served.queued()
    clock.advance(100.0)
    assert await served.serve(replica, 4) == ["a0", "b0", "a1", "a2"]


async def test_a_tenant_at_its_bound_is_refused_and_the_others_still_queue() -> None:
    pool, replica = busy_pool(Queueing(CLASSES, max_queued_per_tenant=2))
    served = Served(pool)
    served.ask("a0", Caller("a"))
    served.ask("a1", Caller("a", priority=1))
    await served.queued()
    with pytest.raises(RateLimited) as refused:
        await pool.queues.acquire_or_wait("m", wait_seconds=60, caller=Caller("a"))
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.retry_after == 1 and "'a'" in refused.value.message
    served.ask("b0", Caller("b"))
    await served.queued()
    # Once one of its requests is served, the tenant may queue one more.
    assert await served.serve(replica, 1) == ["a0"]
    served.ask("a2", Caller("a"))
    await served.queued()
    assert await served.serve(replica, 3) == ["b0", "a2", "a1"]


async def test_a_request_that_leaves_takes_its_place_in_the_round_with_it() -> None:
    pool, replica = busy_pool()
    served = Served(pool)
    served.ask("a0", Caller("a"))
    leaving = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=60, caller=Caller("b")))
    served.ask("c0", Caller("c"))
    await asyncio.sleep(0)
    assert pool.queues.waiting("m") == 3
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    assert pool.queues.waiting("m") == 2
    assert await served.serve(replica, 2) == ["a0", "c0"]
    assert pool.queues.waiting("m") == 0 and pool.queued() == {}


async def test_a_timed_out_request_leaves_its_tenant_and_class() -> None:
    clock = FakeClock()
    pool, replica = busy_pool(clock=clock)
    timing_out = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=1.0, caller=Caller("a")))
    served = Served(pool)
    served.ask("b0", Caller("b"))
    await asyncio.sleep(0)
    clock.advance(1.0)
    assert await timing_out == (None, True)
    assert await served.serve(replica, 1) == ["b0"]


async def test_queue_figures_count_by_model_class_and_tenant_and_stay_at_zero_once_empty() -> None:
    clock = FakeClock(100.0)
    pool, replica = busy_pool(clock=clock)
    served = Served(pool)
    served.ask("a0", Caller("a"))
    await served.queued()
    clock.advance(1.0)
    served.ask("a1", Caller("a"))
    served.ask("b0", Caller("b", priority=1))
    await served.queued()
    figures = pool.queues.figures()
    assert figures == {("m", "interactive", "a"): (2, 100.0), ("m", "batch", "b"): (1, 101.0)}
    await served.serve(replica, 3)
    assert pool.queues.figures() == {("m", "interactive", "a"): (0, None), ("m", "batch", "b"): (0, None)}


async def test_a_held_request_goes_before_every_queued_one_once_its_model_is_up() -> None:
    pool, replica = busy_pool()
    served = Served(pool)
    served.ask("queued", Caller("a"))
    await served.queued()
    order: list[str] = []

    async def held() -> None:
        async with pool.cold_start.begin("m", 60.0) as hold:
            got = await hold.replica()
            assert got is not None
            order.append("held")
            hold.answered()

    task = asyncio.create_task(held())
    await asyncio.sleep(0)
    assert pool.queues.waiting("m") == 2
    pool.release(replica)
    await task
    await asyncio.gather(*served.tasks)
    assert order == ["held"] and served.order == ["queued"]


@pytest.mark.parametrize(
    ("key_rank", "header", "body", "rank"),
    [
        (0, None, None, 0),
        (0, b"batch", None, 1),
        (0, b" Batch ", None, 1),
        (1, b"interactive", None, 1),  # never raised by a header
        (0, None, 5, 1),
        (0, None, 0.5, 1),
        (1, None, -10, 1),  # never raised by the body either
        (0, None, 0, 0),
        (0, None, True, 0),  # a boolean is no number
        (0, None, "5", 0),
        (0, None, float("inf"), 0),
        (0, b"urgent", None, 0),  # no such class: nothing changes
    ],
)
def test_a_request_may_lower_its_class_never_raise_it(
    key_rank: int, header: bytes | None, body: object, rank: int
) -> None:
    assert lowered(key_rank, header, body, RANKS) == rank


def test_a_body_priority_cannot_lower_a_request_when_there_is_one_class() -> None:
    assert lowered(0, None, 5, {b"only": 0}) == 0


async def test_of_several_aged_classes_the_oldest_request_goes_first() -> None:
    """Aged requests go by how long they waited, not by their classes."""
    classes = (
        PriorityClass("premium", 600.0),
        PriorityClass("standard", 600.0, 10.0),
        PriorityClass("bulk", 600.0, 5.0),
    )
    clock = FakeClock()
    pool, replica = busy_pool(Queueing(classes), clock=clock)
    served = Served(pool)
    served.ask("bulk", Caller("a", priority=2))
    await served.queued()
    clock.advance(2.0)
    served.ask("standard", Caller("a", priority=1))
    for i in range(2):
        served.ask(f"premium{i}", Caller("b"))
    await served.queued()
    clock.advance(2.0)
    # 4 s in, nothing aged: the highest class first.
    assert await served.serve(replica, 1) == ["premium0"]
    clock.advance(8.0)
    # 12 s in: bulk (12 s of its 5) and standard (10 s of its 10) both aged; bulk waited longer.
    assert await served.serve(replica, 3) == ["bulk", "standard", "premium1"]
