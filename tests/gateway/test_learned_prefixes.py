"""Prefix routing with prefix_placement = "learned" (router.core.pool.learned): alone and through the router."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from router.core.pool import learned
from router.core.pool.learned import LearnedPrefixes
from router.core.pool.picking import PolicySettings, affinity_key
from tests.conftest import StartFake, StartRouter
from tests.gateway.test_affinity import ask, start_held_fleet, with_system

# The policy, alone ------------------------------------------------------------------------------------


def learned_ring(names: list[str], spread: int = 0) -> LearnedPrefixes[str]:
    policy: LearnedPrefixes[str] = LearnedPrefixes(random.Random(1), PolicySettings("m", spread=spread, by_prefix=True))
    for name in names:
        policy.add(name, 0)
    return policy


PROMPTS = [affinity_key(f"system prompt {n}".encode()) for n in range(8)]


def sent(ring: LearnedPrefixes[str], key: bytes) -> str:
    """Pick for `key`, and hold the request there."""
    replica = ring.pick(key)
    assert replica is not None
    ring.increment(replica)
    return replica


def test_learned_prefixes_are_placed_where_the_load_is_least_and_stay_there() -> None:
    names = [f"r{i}" for i in range(4)]
    ring = learned_ring(names)
    # Four prompts first seen while the others are held: one replica each, whatever their hashes.
    placed = {key: sent(ring, key) for key in PROMPTS[:4]}
    assert sorted(placed.values()) == names
    # Each comes back to its own while it has room (below ceil(1.25 x (in flight + 1) / 4)).
    for key, replica in placed.items():
        ring.decrement(replica)
        assert ring.pick(key) == replica


def test_a_learned_prefix_spills_to_the_least_loaded_which_then_shares_it() -> None:
    names = [f"r{i}" for i in range(4)]
    ring = learned_ring(names)
    home = sent(ring, PROMPTS[0])
    # Its replica full: the least loaded of all takes the next, and is one of the prefix's from then on.
    for _ in range(4):
        ring.increment(home)
    other = sent(ring, PROMPTS[0])
    assert other != home
    for name in names:
        if name not in (home, other):
            # The rest loaded level with the prefix's second: the prefix does not spread to them.
            ring.increment(name)
    picks = [sent(ring, PROMPTS[0]) for _ in range(3)]
    assert set(picks) <= {home, other}
    # A request of it that finds both full goes to the least loaded, a third of its replicas.
    assert ring.pick(PROMPTS[0]) not in (home, other, None)


def test_a_learned_prefix_stays_above_the_bound_while_its_engine_queues_nothing() -> None:
    names = [f"r{i}" for i in range(4)]
    queueing: set[str] = set()
    settings = PolicySettings(
        "m", by_prefix=True, judge=lambda r: 0.0, takes=lambda r: r not in queueing, per_replica=20
    )
    policy: LearnedPrefixes[str] = LearnedPrefixes(random.Random(1), settings)
    for name in names:
        policy.add(name, 0)
    # The engines read (the pool says so at the first reading).
    policy.aware = True
    home = sent(policy, PROMPTS[0])
    # Far past ceil(1.25 x (in flight + 1) / 4), its engine taking all in: the prefix stays.
    assert [sent(policy, PROMPTS[0]) for _ in range(15)] == [home] * 15
    # Its engine queues: the bound decides, and the prefix spills.
    queueing.add(home)
    assert sent(policy, PROMPTS[0]) != home
    # Nothing waiting again, but at max_in_flight_per_replica: not there either.
    queueing.clear()
    for _ in range(20 - policy.load_of(home)):
        policy.increment(home)
    assert policy.pick(PROMPTS[0]) != home


def test_prefix_replicas_bound_the_replicas_a_learned_prefix_spreads_over() -> None:
    names = [f"r{i}" for i in range(6)]
    ring = learned_ring(names, spread=2)
    served = [sent(ring, PROMPTS[0]) for _ in range(30)]
    # Past its two, a full prefix's requests go to the least loaded without it becoming a third.
    assert ring.learned(PROMPTS[0]) == list(dict.fromkeys(served))[:2]
    assert len(set(served)) == 6


def test_a_learned_prefix_whose_replica_leaves_is_placed_again() -> None:
    names = [f"r{i}" for i in range(3)]
    ring = learned_ring(names)
    home = sent(ring, PROMPTS[0])
    ring.decrement(home)
    ring.discard(home)
    again = ring.pick(PROMPTS[0])
    assert again not in (home, None)
    assert ring.learned(PROMPTS[0]) == [again]


def test_the_least_recently_used_learned_prefix_is_forgotten_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(learned, "LEARNED_PREFIXES", 4)
    ring = learned_ring(["r0", "r1"])
    for key in PROMPTS[:4]:
        ring.pick(key)
    # The first used again: the second is now the least recently used, and the fifth pushes it out.
    ring.pick(PROMPTS[0])
    ring.pick(PROMPTS[4])
    assert ring.learned_keys() == [PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[4]]


# Through the router ----------------------------------------------------------------------------------


async def test_learned_prefixes_go_one_to_a_replica_and_come_back_to_it(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server, _ = await start_held_fleet(start_fake, start_router, 4, prefix_placement="learned")
    systems = [f"You are assistant number {n}. " * 20 for n in range(4)]

    async with aiohttp.ClientSession() as session:
        first = await asyncio.gather(*(ask(session, server, with_system(systems[n], "first")) for n in range(4)))
        # Four prompts first sent together: one to each replica, whatever their hashes.
        assert sorted(first) == ["r0", "r1", "r2", "r3"]
        again = [await ask(session, server, with_system(systems[n], "again")) for n in range(4)]
    assert again == first
