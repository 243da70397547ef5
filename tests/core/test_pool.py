"""The pool: least in flight, stamps in acquire(), draining, ejection."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from router.core.config.settings import ReplicaConfig
from router.core.pool.ejection import EjectionPolicy
from router.core.pool.picking import LeastLoaded
from router.core.pool.pool import Limits, Pool
from router.core.pool.replicas import ReplicaState
from tests.support.clock import FakeClock
from tests.support.waiting import wait_for


def configs(model: str, n: int, prefix: str = "r") -> list[ReplicaConfig]:
    return [ReplicaConfig(f"{prefix}{i}", model, f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def test_acquire_picks_the_replica_with_fewest_in_flight() -> None:
    pool = Pool(configs("m", 3), rng=random.Random(1))
    first = pool.acquire("m")
    second = pool.acquire("m")
    third = pool.acquire("m")
    assert first is not None and second is not None and third is not None
    assert len({first.id, second.id, third.id}) == 3
    pool.release(second)
    assert pool.acquire("m") is second


def test_ties_are_broken_at_random_so_a_quiet_fleet_spreads() -> None:
    pool = Pool(configs("m", 4), rng=random.Random(7))
    seen: Counter[str] = Counter()
    for _ in range(400):
        replica = pool.acquire("m")
        assert replica is not None
        seen[replica.id] += 1
        pool.release(replica)
    assert set(seen) == {"r0", "r1", "r2", "r3"}
    assert min(seen.values()) > 50


def test_acquire_counts_and_stamps_in_the_same_step() -> None:
    clock = FakeClock(50.0)
    pool = Pool(configs("m", 1), clock=clock)
    replica = pool.get("r0")
    assert replica is not None
    before = replica.last_used
    assert before is None
    got = pool.acquire("m")
    assert got is replica
    assert (replica.in_flight, replica.last_used) == (1, 50.0)
    # A request of the replica's is counted once it reaches it (the forwarder's), not when picked.
    assert replica.requests == 0
    clock.advance(10.0)
    pool.release(replica)
    assert (replica.in_flight, replica.last_used) == (0, 50.0)


def test_models_are_independent_and_unknown_models_get_none() -> None:
    pool = Pool(configs("a", 2, "a") + configs("b", 2, "b"))
    got = pool.acquire("a")
    assert got is not None and got.model == "a"
    assert pool.acquire("nope") is None


def test_acquire_avoids_the_replica_that_just_failed_unless_it_is_the_only_one() -> None:
    pool = Pool(configs("m", 2))
    first = pool.acquire("m")
    assert first is not None
    pool.release(first)
    for _ in range(20):
        again = pool.acquire("m", avoid=first)
        assert again is not None and again is not first
        pool.release(again)
    lonely = Pool(configs("m", 1))
    only = lonely.acquire("m")
    assert only is not None
    lonely.release(only)
    assert lonely.acquire("m", avoid=only) is only


def test_draining_replica_takes_no_new_requests_and_reads_drained_when_empty() -> None:
    pool = Pool(configs("m", 2))
    busy = pool.acquire("m")
    assert busy is not None
    pool.set_draining(busy.id, True)
    assert busy.state is ReplicaState.DRAINING
    for _ in range(10):
        other = pool.acquire("m")
        assert other is not None and other is not busy
        pool.release(other)
    pool.release(busy)
    assert busy.state.value == "drained"
    pool.set_draining(busy.id, False)
    assert busy.state.value == "ready"


def test_removed_replica_finishes_its_requests_then_leaves() -> None:
    pool = Pool(configs("m", 2))
    replica = pool.get("r0")
    assert replica is not None
    while pool.acquire("m") is not replica:
        pass
    diff = pool.set_replicas(configs("m", 2)[1:])
    assert diff.removed == ("r0",)
    assert replica in list(pool)
    assert all(pool.acquire("m") is not replica for _ in range(10))
    pool.release(replica)
    assert replica not in list(pool)


def test_a_changed_url_is_a_removal_plus_an_addition() -> None:
    pool = Pool(configs("m", 1))
    old = pool.get("r0")
    diff = pool.set_replicas([ReplicaConfig("r0", "m", "http://127.0.0.1:1")])
    assert diff.changed == ("r0",) and diff.added == () and diff.removed == ()
    new = pool.get("r0")
    assert new is not old and new is not None and new.base_url == "http://127.0.0.1:1"
    assert pool.set_replicas([ReplicaConfig("r0", "m", "http://127.0.0.1:1")]).unchanged == ("r0",)


def test_ejection_after_consecutive_failures_never_more_than_half() -> None:
    clock = FakeClock()
    pool = Pool(configs("m", 4), clock=clock, ejection=EjectionPolicy(3, 10.0, 100.0))
    replicas = [pool.get(f"r{i}") for i in range(4)]
    for replica in replicas:
        assert replica is not None
        for _ in range(3):
            pool.record_failure(replica)
    states = [r.state for r in replicas if r is not None]
    assert states.count(ReplicaState.EJECTED) == 2
    ejected = next(r for r in replicas if r is not None and r.state is ReplicaState.EJECTED)
    assert all(pool.acquire("m") is not ejected for _ in range(10))
    clock.advance(10.0)
    assert any(pool.acquire("m") is ejected for _ in range(50))
    assert ejected.state is ReplicaState.READY


def test_ejection_time_doubles_in_a_row_and_resets_after_success() -> None:
    clock = FakeClock()
    pool = Pool(configs("m", 2), clock=clock, ejection=EjectionPolicy(1, 10.0, 100.0))
    replica = pool.get("r0")
    assert replica is not None
    pool.record_failure(replica)
    assert replica.ejected_until == pytest.approx(clock.now() + 10.0)
    clock.advance(10.0)
    pool.acquire("m")
    assert replica.state is ReplicaState.READY
    pool.record_failure(replica)
    assert replica.ejected_until == pytest.approx(clock.now() + 20.0)
    clock.advance(20.0)
    pool.acquire("m")
    pool.record_success(replica)
    pool.record_failure(replica)
    assert replica.ejected_until == pytest.approx(clock.now() + 10.0)


def test_the_last_replica_is_never_ejected() -> None:
    pool = Pool(configs("m", 1), ejection=EjectionPolicy(1, 10.0, 10.0))
    replica = pool.get("r0")
    assert replica is not None
    assert pool.record_failure(replica) is False
    assert replica.state is ReplicaState.READY


def test_least_loaded_keeps_order_through_adds_and_discards() -> None:
    picker: LeastLoaded[str] = LeastLoaded(random.Random(3))
    for name, load in (("a", 2), ("b", 0), ("c", 1)):
        picker.add(name, load)
    assert picker.pick() == "b"
    picker.discard("b")
    assert picker.pick() == "c"
    picker.increment("c")
    picker.increment("c")
    assert picker.pick() == "a"
    picker.decrement("c")
    picker.decrement("c")
    assert picker.pick() == "c"
    picker.discard("c")
    picker.discard("a")
    assert picker.pick() is None
    picker.add("x", 0)
    with pytest.raises(ValueError, match="already"):
        picker.add("x", 0)


def test_excluded_replicas_are_never_picked_again_for_the_request() -> None:
    pool = Pool(configs("m", 2))
    first = pool.get("r0")
    second = pool.get("r1")
    assert first is not None and second is not None
    assert pool.acquire("m", exclude={first}) is second
    assert pool.acquire("m", avoid=second, exclude={first}) is second
    assert pool.acquire("m", exclude={first, second}) is None


async def test_limits_refuse_beyond_capacity_and_release_wakes_a_waiter() -> None:
    pool = Pool(configs("m", 2), limits=Limits(per_replica=2, total=3))
    held = [pool.acquire("m") for _ in range(3)]
    assert all(r is not None for r in held)
    assert pool.acquire("m") is None
    assert pool.saturated("m")
    waiter = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    assert pool.queues.waiting("m") == 1
    first = held[0]
    assert first is not None
    pool.release(first)
    # The freed slot went straight to the waiter: nobody else can take it first.
    replica, timed_out = await waiter
    assert replica is not None and not timed_out
    assert pool.queues.waiting("m") == 0
    assert pool.in_flight == 3
    pool.release(replica)
    assert not pool.saturated("m")
    assert pool.in_flight == 2


async def test_waiters_are_served_first_in_first_out_per_model() -> None:
    pool = Pool(configs("a", 1, "a") + configs("b", 1, "b"), limits=Limits(per_replica=1))
    busy_a, busy_b = pool.acquire("a"), pool.acquire("b")
    assert busy_a is not None and busy_b is not None
    order: list[str] = []

    async def wait(model: str, name: str) -> None:
        replica, _ = await pool.queues.acquire_or_wait(model, wait_seconds=5)
        assert replica is not None
        order.append(name)
        await asyncio.sleep(0)
        pool.release(replica)

    tasks = [asyncio.create_task(wait(m, f"{m}{i}")) for i in range(3) for m in ("a", "b")]
    await asyncio.sleep(0)
    assert pool.queues.waiting("a") == 3 and pool.queues.waiting("b") == 3
    # b frees first: only b's waiters move, in arrival order; a's stay queued.
    pool.release(busy_b)
    await wait_for(lambda: len(order) == 3)
    assert order == ["b0", "b1", "b2"]
    assert pool.queues.waiting("a") == 3
    pool.release(busy_a)
    await asyncio.gather(*tasks)
    assert order == ["b0", "b1", "b2", "a0", "a1", "a2"]
    assert pool.in_flight == 0


async def test_a_waiter_that_leaves_is_removed_at_once_and_its_slot_goes_on() -> None:
    pool = Pool(configs("m", 1), limits=Limits(per_replica=1))
    busy = pool.acquire("m")
    assert busy is not None
    leaving = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    staying = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    assert pool.queues.waiting("m") == 2
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    assert pool.queues.waiting("m") == 1
    pool.release(busy)
    replica, _ = await staying
    assert replica is busy
    assert pool.queues.waiting("m") == 0


async def test_a_slot_handed_to_a_waiter_that_just_left_goes_to_the_next() -> None:
    pool = Pool(configs("m", 1), limits=Limits(per_replica=1))
    busy = pool.acquire("m")
    assert busy is not None
    first = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    second = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    # Handed to the first, which is cancelled before it runs: nothing may leak.
    pool.release(busy)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    replica, _ = await second
    assert replica is busy
    pool.release(replica)
    assert pool.in_flight == 0 and busy.in_flight == 0


async def test_a_waiter_times_out_and_a_new_replica_or_an_undrain_serves_the_rest() -> None:
    clock = FakeClock()
    pool = Pool(configs("m", 1), clock=clock, limits=Limits(per_replica=1))
    busy = pool.acquire("m")
    assert busy is not None
    timing_out = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=0.05))
    await asyncio.sleep(0)
    clock.advance(0.049)
    await asyncio.sleep(0)
    assert not timing_out.done()  # not before its deadline
    clock.advance(0.001)
    assert await timing_out == (None, True)
    assert pool.queues.waiting("m") == 0
    waiter = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    pool.set_replicas(configs("m", 2))  # r1 arrives
    replica, timed_out = await waiter
    assert replica is not None and replica.id == "r1" and not timed_out
    pool.set_draining("r1", True)
    pool.release(replica)
    waiter = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    assert pool.queues.waiting("m") == 1
    pool.set_draining("r1", False)
    replica, _ = await waiter
    assert replica is not None and replica.id == "r1"


async def test_waiters_are_told_at_once_when_their_model_loses_every_replica() -> None:
    pool = Pool(configs("m", 1), limits=Limits(per_replica=1))
    busy = pool.acquire("m")
    assert busy is not None
    waiter = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    pool.set_draining("r0", True)
    assert await asyncio.wait_for(waiter, 1) == (None, False)


async def test_under_the_router_wide_limit_a_release_serves_another_models_waiter() -> None:
    pool = Pool(configs("a", 1, "a") + configs("b", 1, "b"), limits=Limits(total=1))
    busy = pool.acquire("a")
    assert busy is not None
    waiter = asyncio.create_task(pool.queues.acquire_or_wait("b", wait_seconds=5))
    await asyncio.sleep(0)
    pool.release(busy)
    replica, _ = await waiter
    assert replica is not None and replica.model == "b"
