"""The session and prefix ring: hashed once per replica, laid out once per batch, the same ring whatever the path."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.config.settings import ReplicaConfig
from router.core.pool.picking import BoundedHashRing, PolicySettings, Routing
from router.core.pool.pool import Limits, Pool
from router.core.pool.ring import affinity_key

KEYS = [affinity_key(f"key-{i}".encode()) for i in range(400)]
NAMES = [f"replica-{i}" for i in range(24)]


def session_pool(n: int, limits: Limits | None = None) -> Pool:
    return Pool(
        [ReplicaConfig(f"s{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(n)],
        routing={"m": Routing("session")},
        limits=limits or Limits(),
    )


def ring_of(pool: Pool) -> BoundedHashRing[object]:
    policy = pool._candidates["m"]
    assert isinstance(policy, BoundedHashRing)
    return policy


def whole(names: list[str]) -> BoundedHashRing[str]:
    """The ring laid out in one batch, as a router starting with `names` makes it."""
    ring: BoundedHashRing[str] = BoundedHashRing(random.Random(1), PolicySettings("m"))
    ring.hold()
    for name in names:
        ring.add(name, 0)
    ring.settle()
    return ring


def candidates_points(ring: BoundedHashRing[str]) -> list[tuple[bytes, str]]:
    """The ring as a key sees it: the candidates' points in order (resting members passed over)."""
    return [(p, o) for p, o in zip(ring._points[:-1], ring._owners[:-1], strict=True) if o in ring]


def test_a_whole_replica_set_lays_out_the_ring_once() -> None:
    pool = session_pool(50)
    ring = ring_of(pool)
    assert ring.builds == 1
    # A push of 30 more, 5 gone: one more layout, not 35.
    pool.set_replicas([ReplicaConfig(f"s{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(5, 80)])
    assert ring.builds == 2
    assert len(ring) == 75


def test_taking_a_replica_out_and_back_lays_out_nothing() -> None:
    pool = session_pool(20)
    ring = ring_of(pool)
    victim = pool.get("s3")
    assert victim is not None
    homes = [ring.home(key) for key in KEYS]
    pool.ejections.eject(victim, 10.0)
    assert victim not in ring
    # Its keys went on to the next replica along, as if its points were gone.
    assert all(home is not victim for home in (ring.home(key) for key in KEYS))
    pool.ejections.readmit(victim)
    pool.set_draining("s4", True)
    pool.set_draining("s4", False)
    assert ring.builds == 1
    assert [ring.home(key) for key in KEYS] == homes


def test_resting_points_are_dropped_once_they_are_a_quarter_of_the_ring() -> None:
    names = NAMES[:20]
    ring = whole(names)
    for name in names[:5]:
        ring.discard(name)
    assert ring.builds == 1
    # The sixth makes 960 of 3,200 points resting: more than a quarter.
    ring.discard(names[5])
    assert ring.builds == 2
    assert len(ring._points) == 14 * 160 + 1
    assert candidates_points(ring) == candidates_points(whole(names[6:]))


Step = tuple[bool, int, int]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, len(NAMES) - 1), st.integers(0, 3)), max_size=60))
def test_the_ring_after_any_changes_is_the_ring_laid_out_whole(steps: list[Step]) -> None:
    ring: BoundedHashRing[str] = BoundedHashRing(random.Random(1), PolicySettings("m"))
    present: list[str] = []
    for add, which, batch in steps:
        # batch > 0: that many changes held and laid out together.
        if batch:
            ring.hold()
        for offset in range(max(1, batch)):
            name = NAMES[(which + offset) % len(NAMES)]
            if add and name not in present:
                ring.add(name, 0)
                present.append(name)
            elif not add and name in present:
                ring.discard(name)
                present.remove(name)
        if batch:
            ring.settle()
        fresh = whole(present)
        assert candidates_points(ring) == candidates_points(fresh)
        assert [ring.home(key) for key in KEYS] == [fresh.home(key) for key in KEYS]


async def test_waiters_are_told_once_the_whole_set_is_in() -> None:
    # A model's only replica changes its URL in one push: its waiter gets the
    # new replica, not a refusal from the moment between the old and the new.
    pool = session_pool(1, Limits(per_replica=1))
    busy = pool.acquire("m")
    assert busy is not None
    waiter = asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=5))
    await asyncio.sleep(0)
    pool.set_replicas([ReplicaConfig("s0", "m", "http://127.0.0.1:9500")])
    replica, timed_out = await asyncio.wait_for(waiter, 1)
    assert replica is not None and replica.base_url == "http://127.0.0.1:9500" and not timed_out
