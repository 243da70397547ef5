"""Held requests on fake time: the probes and their pauses, the deadline, the line, and every way out of a hold.

The pool runs on tests/support/clock.py's clock, so what the clock decides (a
deadline, a probe's pause) happens when the test moves time, and no test
waits any real time for it. The replicas are the pool's own records: a try
is the test saying what the engine did (answered, or refused while loading).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.core.config.settings import ReplicaConfig
from router.core.pool.coldstart import Hold, ShuttingDown
from router.core.pool.pool import Limits, Pool
from router.core.pool.replicas import Replica
from router.core.pool.waiters import PROBE_CAP_SECONDS, PROBE_FIRST_SECONDS
from tests.support.clock import FakeClock


def cold_pool(clock: FakeClock, replicas: int = 1, limits: Limits | None = None) -> Pool:
    configs = [ReplicaConfig(f"r{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(replicas)]
    return Pool(configs, clock=clock, limits=limits or Limits())


async def turns(n: int = 5) -> None:
    """Let every task that can run, run (no time passes)."""
    for _ in range(n):
        await asyncio.sleep(0)


def outcomes(pool: Pool) -> dict[str, int]:
    return {outcome: n for (model, outcome), n in pool.tallies.hold_outcomes.items() if model == "m"}


async def test_a_held_request_gets_none_at_its_deadline_and_not_before() -> None:
    clock = FakeClock()
    pool = Pool(clock=clock)

    async def held() -> Replica | None:
        async with pool.cold_start.begin("m", 0.8) as hold:
            return await hold.replica()

    task = asyncio.create_task(held())
    await turns()
    assert pool.cold_start.held("m") == 1
    clock.advance(0.79)
    await turns()
    assert not task.done()
    clock.advance(0.01)
    assert await task is None
    assert pool.cold_start.held("m") == 0 and pool.queues.waiting("m") == 0
    assert outcomes(pool) == {"timeout": 1}


async def test_the_first_probe_goes_at_once_then_each_after_a_pause_that_doubles_to_the_cap() -> None:
    clock = FakeClock()
    pool = cold_pool(clock)
    pauses: list[float] = []
    async with pool.cold_start.begin("m", 60) as hold:
        first = await hold.replica()
        assert first is not None and clock.now() == 1000.0  # at once: no time passed
        for _ in range(4):
            hold.still_loading()
            refused_at = clock.now()
            task = asyncio.create_task(hold.replica())
            await turns()
            due = clock.next_call()
            assert due is not None and not task.done()
            clock.advance(due - clock.now() - 0.001)
            await turns()
            assert not task.done()  # not a moment before its pause is over
            clock.advance(0.001)
            assert await task is first
            pauses.append(round(clock.now() - refused_at, 6))
        hold.answered()
    doubling = [PROBE_FIRST_SECONDS, 2 * PROBE_FIRST_SECONDS, PROBE_CAP_SECONDS, PROBE_CAP_SECONDS]
    assert pauses == pytest.approx(doubling)
    assert outcomes(pool) == {"served": 1}
    assert first.in_flight == 0 and pool.in_flight == 0


async def test_a_refused_probe_keeps_its_place_at_the_head_of_the_line_and_its_age() -> None:
    clock = FakeClock()
    pool = cold_pool(clock)
    async with pool.cold_start.begin("m", 60) as first:
        clock.advance(1.0)
        async with pool.cold_start.begin("m", 60) as second:
            behind = asyncio.create_task(second.replica())
            replica = await first.replica()
            assert replica is not None
            assert pool.cold_start.held("m") == 2  # one trying, one waiting: both held, as max_held counts them
            first.still_loading()
            again = asyncio.create_task(first.replica())
            await turns()
            assert pool.cold_start.held("m") == 2
            assert pool.cold_start.oldest_held("m") == first.since == 1000.0
            clock.advance(PROBE_FIRST_SECONDS)
            assert await again is replica  # the probe went to the first again, not to the one behind it
            assert not behind.done()
            behind.cancel()
            await asyncio.gather(behind, return_exceptions=True)


async def test_once_a_probe_answers_the_held_requests_go_in_arrival_order_under_the_limits() -> None:
    clock = FakeClock()
    pool = cold_pool(clock, limits=Limits(per_replica=1))
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("a", "b", "c")}

    async def request(name: str) -> None:
        async with pool.cold_start.begin("m", 60) as hold:
            replica = await hold.replica()
            assert replica is not None
            order.append(name)
            await release[name].wait()
            hold.answered()

    tasks = []
    for name in ("a", "b", "c"):
        tasks.append(asyncio.create_task(request(name)))
        await turns()
    assert order == ["a"]  # the probe; the rest wait for its verdict
    release["a"].set()
    await turns()
    assert order == ["a", "b"]  # warm: the next in line, as the limit frees a slot
    release["b"].set()
    await turns()
    assert order == ["a", "b", "c"]
    release["c"].set()
    await asyncio.gather(*tasks)
    assert outcomes(pool) == {"served": 3}
    assert pool.in_flight == 0


async def test_without_limits_every_held_request_goes_as_soon_as_the_probe_answers() -> None:
    clock = FakeClock()
    pool = cold_pool(clock, replicas=2)
    handed: list[str] = []
    answer = asyncio.Event()

    async def request(name: str) -> None:
        async with pool.cold_start.begin("m", 60) as hold:
            assert await hold.replica() is not None
            handed.append(name)
            if name == "probe":
                await answer.wait()
                hold.answered()

    tasks = [asyncio.create_task(request(name)) for name in ("probe", "x", "y", "z")]
    await turns()
    assert handed == ["probe"]
    answer.set()
    await asyncio.gather(*tasks)
    assert handed == ["probe", "x", "y", "z"]


async def test_a_probe_whose_client_leaves_mid_try_frees_the_next_probe_after_the_pause() -> None:
    clock = FakeClock()
    pool = cold_pool(clock)
    trying = asyncio.Event()

    async def leaving() -> None:
        async with pool.cold_start.begin("m", 60) as hold:
            assert await hold.replica() is not None
            trying.set()
            await asyncio.Event().wait()  # the client goes while the replica is tried

    first = asyncio.create_task(leaving())
    await trying.wait()
    async with pool.cold_start.begin("m", 60) as second:
        waiting = asyncio.create_task(second.replica())
        await turns()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert pool.in_flight == 0  # the hold gave its replica back on the way out
        await turns()
        assert not waiting.done()
        clock.advance(PROBE_FIRST_SECONDS)
        assert await waiting is not None
    assert outcomes(pool) == {"client_gone": 1, "served": 1}


async def test_a_client_that_leaves_while_held_leaves_the_line_and_is_counted() -> None:
    clock = FakeClock()
    pool = Pool(clock=clock)

    async def held() -> None:
        async with pool.cold_start.begin("m", 60) as hold:
            await hold.replica()

    task = asyncio.create_task(held())
    await turns()
    assert pool.cold_start.held("m") == 1 and pool.cold_start.oldest_held("m") == 1000.0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert pool.cold_start.held("m") == 0 and pool.queues.waiting("m") == 0 and pool.cold_start.oldest_held("m") is None
    assert outcomes(pool) == {"client_gone": 1}


async def test_shutdown_ends_every_hold_at_once_with_hold_ended() -> None:
    clock = FakeClock()
    pool = Pool(clock=clock)

    async def held() -> None:
        async with pool.cold_start.begin("m", 60) as hold:
            await hold.replica()

    tasks = [asyncio.create_task(held()) for _ in range(3)]
    await turns()
    assert pool.cold_start.end_holds() == 3
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(result, ShuttingDown) for result in results)
    assert clock.next_call() is None  # no deadline or probe left to fire
    assert outcomes(pool) == {"shutdown": 3}


async def test_every_way_out_of_a_hold_gives_its_replica_back() -> None:
    clock = FakeClock()
    pool = cold_pool(clock)

    async def answered(hold: Hold) -> None:
        hold.answered()

    async def said_nothing(hold: Hold) -> None:
        return None

    async def raised(hold: Hold) -> None:
        raise RuntimeError("the caller's own error")

    for leave in (answered, said_nothing, raised):
        with pytest.raises(RuntimeError) if leave is raised else contextlib.nullcontext():
            async with pool.cold_start.begin("m", 60) as hold:
                replica = await hold.replica()
                assert replica is not None and replica.in_flight == 1
                await leave(hold)
        assert pool.in_flight == 0 and replica.in_flight == 0
        clock.advance(PROBE_CAP_SECONDS)  # past any pause before the next probe
    # A caller's own error is no outcome of the hold's: the caller answers it.
    assert outcomes(pool) == {"served": 2}


async def test_a_request_handed_its_replica_while_warm_ends_no_probe_of_a_later_cold_spell() -> None:
    clock = FakeClock()
    pool = cold_pool(clock, replicas=3)
    steps: dict[str, asyncio.Event] = {name: asyncio.Event() for name in ("probe", "early", "refusing")}
    handed: list[str] = []

    async def request(name: str) -> None:
        async with pool.cold_start.begin("m", 60) as hold:
            while await hold.replica() is not None:
                handed.append(name)
                if name == "refusing" and handed.count(name) == 1:
                    hold.still_loading()  # the engine went back to loading: the model is cold again
                    continue
                await steps[name].wait()
                if name == "probe":
                    hold.answered()
                return

    tasks = [asyncio.create_task(request(name)) for name in ("probe", "early", "refusing")]
    await turns()
    steps["probe"].set()
    await turns()
    # The probe answered: "early" and "refusing" were handed theirs at once;
    # "refusing" was refused, so the model is cold again and it probes next.
    assert handed == ["probe", "early", "refusing"]
    clock.advance(PROBE_FIRST_SECONDS)
    await turns()
    assert handed == ["probe", "early", "refusing", "refusing"]
    async with pool.cold_start.begin("m", 60) as later:
        behind = asyncio.create_task(later.replica())
        await turns()
        steps["early"].set()  # its try ends with nothing said: it was no probe of this spell
        await turns()
        clock.advance(PROBE_CAP_SECONDS * 4)
        await turns()
        assert not behind.done()  # one probe at a time: "refusing" is still trying
        steps["refusing"].set()
        await turns()
        clock.advance(PROBE_CAP_SECONDS)
        assert await behind is not None
    await asyncio.gather(*tasks)


async def test_a_hold_hands_out_no_replica_outside_async_with() -> None:
    """Only the exit of `async with` gives a try's replica back, so no try may begin outside one."""
    clock = FakeClock()
    pool = cold_pool(clock)
    hold = pool.cold_start.begin("m", 60)
    with pytest.raises(RuntimeError, match="async with"):
        await hold.replica()
    assert pool.in_flight == 0 and pool.cold_start.held("m") == 0
