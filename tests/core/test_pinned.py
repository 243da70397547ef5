"""Requests pinned to one replica (it keeps their response): they wait while it is busy, and only then."""

from __future__ import annotations

import asyncio

from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Limits, Pool
from tests.support.clock import FakeClock


def two_replicas(limits: Limits, clock: FakeClock | None = None) -> Pool:
    replicas = [ReplicaConfig(f"r{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    return Pool(replicas, limits=limits, clock=clock or FakeClock())


async def test_a_freed_slot_goes_to_the_request_pinned_to_that_replica_before_the_models_line() -> None:
    pool = two_replicas(Limits(per_replica=1))
    r0, r1 = pool.acquire_this("r0"), pool.acquire_this("r1")
    assert r0 is not None and r1 is not None
    anyone = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    pinned = asyncio.create_task(pool.pinned.wait("r0", wait_seconds=5))
    await asyncio.sleep(0)
    assert pool.queued() == {"m": 2}
    pool.release(r0)
    # The request that r0 alone can serve takes it, though it came second: the other may take r1.
    assert await pinned == (r0, False)
    assert not anyone.done()
    pool.release(r1)
    assert await anyone == (r1, False)


async def test_under_the_router_wide_limit_a_slot_freed_anywhere_goes_to_a_pinned_request() -> None:
    pool = two_replicas(Limits(total=1))
    r1 = pool.acquire_this("r1")
    assert r1 is not None
    pinned = asyncio.create_task(pool.pinned.wait("r0", wait_seconds=5))
    await asyncio.sleep(0)
    assert pool.queued() == {"m": 1}
    pool.release(r1)
    replica, timed_out = await pinned
    assert replica is not None and replica.id == "r0" and not timed_out


async def test_a_pinned_request_is_told_at_once_that_a_draining_replica_is_gone() -> None:
    pool = two_replicas(Limits(per_replica=1))
    pool.set_draining("r0", True)
    assert await pool.pinned.wait("r0", wait_seconds=5) == (None, False)
    assert await pool.pinned.wait("nobody", wait_seconds=5) == (None, False)
    assert pool.queued() == {}


async def test_a_pinned_request_times_out_at_its_deadline_not_before() -> None:
    clock = FakeClock()
    pool = two_replicas(Limits(per_replica=1), clock)
    busy = pool.acquire_this("r0")
    assert busy is not None
    pinned = asyncio.create_task(pool.pinned.wait("r0", wait_seconds=2))
    await asyncio.sleep(0)
    clock.advance(1.99)
    await asyncio.sleep(0)
    assert not pinned.done()
    clock.advance(0.01)
    assert await pinned == (None, True)
    assert pool.queued() == {}
    assert busy.in_flight == 1  # nothing was handed to the request that left
