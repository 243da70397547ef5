"""A wake is bounded as a whole (each of its calls gets what is left of the time), and a replica gone is never asleep.

The engine here is a stand-in for its HTTP calls (router.core.pool.sleep.EngineCall)
on a clock the test moves: each call takes the time the test gives it.
"""

from __future__ import annotations

import pytest

from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool
from router.core.pool.sleep import SLEEP_APIS, EngineCallFailed, wake_up
from tests.support.clock import FakeClock


class SlowEngine:
    """vLLM's sleep API answering each call after `takes` seconds of its clock; it records the bound it was given."""

    def __init__(self, takes: float) -> None:
        self.now = 0.0
        self.takes = takes
        self.bounds: list[tuple[str, float]] = []
        self.asleep = True

    def clock(self) -> float:
        return self.now

    async def __call__(self, method: str, url: str, body: bytes | None, seconds: float) -> tuple[int, bytes]:
        self.bounds.append((url.rsplit("/", 1)[-1], seconds))
        if self.takes > seconds:
            self.now += seconds
            raise TimeoutError
        self.now += self.takes
        if url.endswith("/wake_up"):
            self.asleep = False
            return 200, b""
        return 200, b'{"is_sleeping": %s}' % (b"true" if self.asleep else b"false")


async def test_each_call_of_a_wake_gets_only_what_is_left_of_its_bound() -> None:
    engine = SlowEngine(takes=3.0)
    await wake_up(engine, SLEEP_APIS["vllm"], "http://engine", 10.0, engine.clock)
    # The first check had all 10 s, the wake what was left after it, the last check what was left then.
    assert engine.bounds == [("is_sleeping", 10.0), ("wake_up", 7.0), ("is_sleeping", 4.0)]
    assert not engine.asleep


async def test_a_wake_that_cannot_end_within_its_bound_fails_at_the_bound() -> None:
    engine = SlowEngine(takes=6.0)
    with pytest.raises(EngineCallFailed):
        await wake_up(engine, SLEEP_APIS["vllm"], "http://engine", 10.0, engine.clock)
    # Never more than the bound in all: before, the wake call was given the whole 10 s again.
    assert engine.now <= 10.0


def test_a_replica_gone_from_the_pool_is_never_counted_asleep() -> None:
    # A sleep call or a 503 "sleeping" may come back after the replica left the pool: counted,
    # its model would stay "sleepy" for good, and its requests held for a wake nobody can make.
    pool = Pool([ReplicaConfig(id="r1", model="m", url="http://127.0.0.1:9")], clock=FakeClock())
    (replica,) = pool.replicas_of("m")
    pool.set_replicas([])
    pool.set_sleep(replica, 1)
    assert pool.sleepy == {}
    assert replica.asleep is None
