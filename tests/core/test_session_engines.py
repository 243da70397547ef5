"""Session routing with the engines' readings: a session keeps its replica while its engine takes more.

A session is one conversation, its replica's prefix cache holds it: with a
fresh reading that says the engine takes requests in as they come (nothing
waiting, no large prompt still prefilling), the session stays there above the
ring's bounded load (where prefix routing, whose key many clients share,
spills). Once the engine queues, the bound decides again, and a saturated
engine is left; with no fresh reading, the bounded load decides, as with
engine metrics off.
"""

from __future__ import annotations

from router.core.config.settings import ReplicaConfig
from router.core.pool.loads import Bounds, EngineView
from router.core.pool.picking import Routing, affinity_key
from router.core.pool.pool import Limits, Pool
from router.core.pool.replicas import Replica
from tests.support.clock import FakeClock

KEY = affinity_key(b"session-conversation-7")
STALE = 3.0


def fleet(policy: str, size: int = 2) -> tuple[Pool, FakeClock]:
    clock = FakeClock()
    view = EngineView(clock.now, stale_after=STALE, default=Bounds(waiting=4, kv=0.8))
    replicas = [ReplicaConfig(f"r{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(size)]
    return Pool(replicas, clock=clock, routing={"m": Routing(policy)}, engines=view), clock


def read(pool: Pool, replica: Replica, waiting: float = 0, running: float = 2, kv: float = 0.3) -> None:
    loads = pool.engine_loads
    assert loads is not None
    loads.record(replica, waiting, running, kv, "metrics")


def read_all(pool: Pool, **reading: float) -> None:
    for replica in list(pool):
        read(pool, replica, **reading)


def picks(pool: Pool, count: int) -> list[Replica]:
    got = [pool.acquire("m", key=KEY) for _ in range(count)]
    assert all(replica is not None for replica in got)
    return [replica for replica in got if replica is not None]


def test_a_session_stays_on_its_replica_past_the_bounded_load_while_its_engine_queues_nothing() -> None:
    pool, _ = fleet("session")
    read_all(pool)
    got = picks(pool, 6)
    # Two replicas: bounded loads (1.25) would have spilled the third request already.
    assert len({replica.id for replica in got}) == 1
    assert pool.tallies.affinity["m"][:2] == [6, 0]


def test_a_prefix_shared_by_many_clients_still_spills_at_the_bounded_load() -> None:
    pool, _ = fleet("prefix")
    read_all(pool)
    got = picks(pool, 6)
    assert len({replica.id for replica in got}) == 2


def test_a_session_leaves_a_saturated_engine_and_comes_back_once_it_frees() -> None:
    pool, _ = fleet("session", 4)
    read_all(pool)
    (home,) = picks(pool, 1)
    # Its engine's queue at the model's bound: saturated, the session goes on along the ring.
    read(pool, home, waiting=4)
    (away,) = picks(pool, 1)
    assert away is not home
    # ... as it does when its KV cache is full while requests wait.
    read(pool, home, waiting=1, kv=0.9)
    assert picks(pool, 1)[0] is not home
    read(pool, home, waiting=0, kv=0.9)
    assert picks(pool, 1)[0] is home


def test_once_its_engine_queues_the_bounded_load_decides_again() -> None:
    pool, _ = fleet("session")
    read_all(pool)
    (home,) = picks(pool, 1)
    # Queueing, below the bound of 4: a request there would wait, so the ring's bound applies.
    read(pool, home, waiting=2)
    assert picks(pool, 2) == [home, next(r for r in pool if r is not home)]


def test_a_large_prompt_still_prefilling_on_its_replica_puts_the_bounded_load_back() -> None:
    pool, clock = fleet("session")
    read_all(pool)
    home = pool.acquire("m", key=KEY, tokens=30_000)
    assert home is not None
    # Its 30,000 tokens take 3 s to prefill (10,000 a second): the session's next request goes by the bound.
    assert picks(pool, 2) == [home, next(r for r in pool if r is not home)]
    for replica in list(pool):
        while replica.in_flight:
            pool.release(replica)
    clock.advance(3.5)
    read_all(pool)
    assert len({replica.id for replica in picks(pool, 4)}) == 1


def test_without_a_fresh_reading_the_bounded_load_decides_as_with_metrics_off() -> None:
    pool, clock = fleet("session")
    read_all(pool)
    clock.advance(STALE + 1)
    got = picks(pool, 6)
    assert len({replica.id for replica in got}) == 2


def test_the_per_replica_limit_still_holds_a_session_that_its_engine_would_keep() -> None:
    clock = FakeClock()
    view = EngineView(clock.now, stale_after=STALE)
    replicas = [ReplicaConfig(f"r{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    pool = Pool(replicas, clock=clock, routing={"m": Routing("session")}, engines=view, limits=Limits(per_replica=3))
    read_all(pool)
    got = picks(pool, 5)
    counts = sorted(sum(1 for r in got if r is replica) for replica in set(got))
    assert counts == [2, 3]
