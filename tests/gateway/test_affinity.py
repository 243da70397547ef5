"""Session and prefix affinity: consistent hashing with bounded loads, alone and through the router."""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from collections import Counter, defaultdict
from typing import Any

import aiohttp
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.config.settings import ReplicaConfig
from router.core.pool.picking import BoundedHashRing, PolicySettings, Routing, affinity_key
from router.core.pool.pool import Pool
from router.core.pool.replicas import ReplicaState
from router.gateway.affinity import prompt_text
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, in_flight, samples, scrape
from tests.support.waiting import tick

KEYS = [affinity_key(f"session-{i}".encode()) for i in range(10_000)]


def ring_of(names: list[str], factor: float = 1.25, spread: int = 0, by_prefix: bool = False) -> BoundedHashRing[str]:
    """The ring of `names`, each at 0 in flight; `spread` is prefix_replicas, `by_prefix` routing = "prefix"."""
    settings = PolicySettings("m", balance_factor=factor, spread=spread, by_prefix=by_prefix)
    ring: BoundedHashRing[str] = BoundedHashRing(random.Random(1), settings)
    for name in names:
        ring.add(name, 0)
    return ring


# The ring, alone ------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=12, unique=True), st.randoms())
def test_the_same_key_and_set_map_the_same_way_whatever_the_order(names: list[str], rng: random.Random) -> None:
    shuffled = list(names)
    rng.shuffle(shuffled)
    one, other = ring_of(names), ring_of(shuffled)
    assert [one.home(key) for key in KEYS[:500]] == [other.home(key) for key in KEYS[:500]]


@settings(max_examples=20, deadline=None)
@given(st.integers(min_value=2, max_value=24), st.integers(min_value=0, max_value=10_000))
def test_adding_one_replica_moves_about_one_nth_of_the_keys(n: int, salt: int) -> None:
    names = [f"replica-{salt}-{i}" for i in range(n)]
    before = ring_of(names)
    after = ring_of([*names, f"replica-{salt}-new"])
    moved = 0
    for key in KEYS:
        home = after.home(key)
        if home != before.home(key):
            # A key moves only to the newcomer, never between the old ones.
            assert home == f"replica-{salt}-new"
            moved += 1
    assert moved <= 2 * len(KEYS) / (n + 1)


def test_each_replica_is_home_to_about_its_share_of_the_keys() -> None:
    ring = ring_of([f"r{i}" for i in range(8)])
    shares = Counter(ring.home(key) for key in KEYS)
    assert len(shares) == 8
    assert max(shares.values()) < 1.35 * len(KEYS) / 8
    assert min(shares.values()) > 0.65 * len(KEYS) / 8


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=8),
    st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]),
    st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=5), st.booleans()), max_size=300),
)
def test_no_replica_takes_a_request_above_the_bound(n: int, factor: float, steps: list[tuple[bool, int, bool]]) -> None:
    # Hot keys (few distinct ones) make spills: the bound must hold through them.
    ring = ring_of([f"r{i}" for i in range(n)], factor)
    loads = dict.fromkeys((f"r{i}" for i in range(n)), 0)
    held: list[str] = []
    for acquire, which, keyed in steps:
        if acquire or not held:
            chosen = ring.pick(KEYS[which] if keyed else None)
            assert chosen is not None
            ring.increment(chosen)
            loads[chosen] += 1
            held.append(chosen)
            mean = sum(loads.values()) / n
            # (Stricter than the ceil(c x mean) + 1 that the paper's bound allows.)
            assert loads[chosen] <= math.ceil(factor * mean)
        else:
            released = held.pop(which % len(held))
            ring.decrement(released)
            loads[released] -= 1
    assert ring.lowest_load == min(loads.values())


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["ready", "draining", "ejected", "removed"]), min_size=1, max_size=8),
    st.integers(min_value=0, max_value=9_999),
)
def test_every_key_maps_to_a_ready_replica_when_one_exists(states: list[str], which: int) -> None:
    replicas = [ReplicaConfig(f"r{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(len(states))]
    pool = Pool(replicas, routing={"m": Routing("session")})
    pool.set_replicas([r for r, state in zip(replicas, states, strict=True) if state != "removed"])
    for replica, state in zip(replicas, states, strict=True):
        if state == "draining":
            pool.set_draining(replica.id, True)
        elif state == "ejected":
            got = pool.get(replica.id)
            assert got is not None
            pool.ejections.eject(got, 60.0)
    chosen = pool.acquire("m", key=KEYS[which])
    if "ready" in states:
        assert chosen is not None and chosen.state is ReplicaState.READY
        assert states[int(chosen.id[1:])] == "ready"
    else:
        assert chosen is None


def test_a_retry_walks_the_ring_and_never_reaches_an_excluded_replica() -> None:
    pool = Pool(
        [ReplicaConfig(f"r{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(4)],
        routing={"m": Routing("session")},
    )
    first = pool.acquire("m", key=KEYS[7])
    assert first is not None
    pool.release(first)
    refused = {first}
    second = pool.acquire("m", first, refused, KEYS[7])
    assert second is not None and second is not first
    pool.release(second)
    # The same retry goes the same way: the next replica along the ring, not a random one.
    again = pool.acquire("m", first, refused, KEYS[7])
    assert again is second


def test_the_prompt_text_is_what_the_engine_reads_in_order() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {}}]},
        ]
    }
    assert prompt_text(chat, 1024) == "system:Be brief.\nuser:Hello\n"
    assert prompt_text({"prompt": "once upon"}, 1024) == "once upon"
    assert prompt_text({"prompt": ["first", "second"]}, 1024) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}, 1024) == "1,2,3"
    assert prompt_text({"instructions": "Be kind.", "input": "Hi"}, 1024) == "system:Be kind.\nuser:Hi\n"
    assert prompt_text({"model": "m"}, 1024) == ""
    # Only as much as the key needs is gathered.
    long = {"messages": [{"role": "user", "content": "x" * 100}] * 50}
    assert 1024 <= len(prompt_text(long, 1024)) < 1024 + 110


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 12), spread=st.integers(2, 4), salt=st.integers(0, 10**6))
def test_the_sessions_of_a_prefix_meet_on_prefix_replicas_of_the_ring(n: int, spread: int, salt: int) -> None:
    names = [f"r{i}" for i in range(n)]
    ring = ring_of(names, spread=spread)
    prefix = affinity_key(f"system prompt {salt}".encode())
    homes = {s: ring.pick(prefix + s) for s in KEYS[:300]}
    # As many replicas as asked, or the whole fleet when it is smaller; each session on one of them.
    assert len(set(homes.values())) == min(spread, n)
    assert all(ring.pick(prefix + s) == home for s, home in homes.items())
    # Another prefix's sessions meet elsewhere on the ring, or on some of the same replicas.
    assert set(homes.values()) <= set(names)
    # A session without a prompt is placed by its own key, as without the setting.
    plain = ring_of(names)
    assert all(ring.pick(s) == plain.pick(s) for s in KEYS[:100])


def test_a_replica_leaving_moves_only_the_sessions_it_held_or_its_successor_wins() -> None:
    names = [f"r{i}" for i in range(8)]
    ring = ring_of(names, spread=2)
    prefix = affinity_key(b"You are a careful assistant.")
    before = {s: ring.home(prefix + s) for s in KEYS[:1000]}
    held = Counter(home for home in before.values() if home is not None)
    assert len(held) == 2
    gone, kept = sorted(held)
    ring.discard(gone)
    after = {s: ring.pick(prefix + s) for s in KEYS[:1000]}
    assert all(after[s] != gone for s in KEYS[:1000])
    # The one that stayed keeps its sessions but those the replica coming in ranks higher.
    stayed = [s for s in KEYS[:1000] if before[s] == kept]
    moved = [s for s in stayed if after[s] != kept]
    assert len(moved) < len(stayed) * 0.7
    # A replica that is not one of the first two along the ring from the prefix's point moves none.
    ring = ring_of(names, spread=2)
    start = bisect.bisect_left(ring._points, prefix)
    along = [owner for _, owner in candidates_after(ring, start)]
    nearest = list(dict.fromkeys(along))[:2]
    assert set(nearest) == set(held)
    ring.discard(next(name for name in names if name not in nearest))
    assert {s: ring.home(prefix + s) for s in KEYS[:1000]} == before


def nearest_of(ring: BoundedHashRing[str], key: bytes) -> list[str]:
    """The candidates along the ring from `key`'s point, each once, nearest first."""
    return list(dict.fromkeys(owner for _, owner in candidates_after(ring, bisect.bisect_left(ring._points, key))))


def candidates_after(ring: BoundedHashRing[str], start: int) -> list[tuple[bytes, str]]:
    """The ring's points from `start` on, round to the start (the last point is the END's)."""
    points = list(zip(ring._points[:-1], ring._owners[:-1], strict=True))
    return points[start:] + points[:start]


def test_a_full_replica_spills_a_spread_session_along_the_ring() -> None:
    names = [f"r{i}" for i in range(4)]
    ring = ring_of(names, spread=2)
    prefix = affinity_key(b"system")
    home = ring.pick(prefix + KEYS[0])
    assert home is not None
    # Loaded past ceil(1.25 x (in flight + 1) / 4): the session goes on along the ring, never home.
    for _ in range(10):
        ring.increment(home)
    spilled = ring.pick(prefix + KEYS[0])
    assert spilled not in (None, home)
    assert ring.pick_avoiding(spilled, {home}, prefix + KEYS[0]) not in (home, spilled)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 12), spread=st.integers(2, 4), salt=st.integers(0, 10**6))
def test_a_prefix_shares_the_least_loaded_of_its_nearest_replicas(n: int, spread: int, salt: int) -> None:
    names = [f"r{i}" for i in range(n)]
    # A bound far off: what is tested here is the choice among the nearest.
    ring = ring_of(names, 100.0, spread=spread, by_prefix=True)
    prefix = affinity_key(f"system prompt {salt}".encode())
    nearest = nearest_of(ring, prefix)[: min(spread, n)]
    # Quiet, the prefix goes where it goes without the setting: its home, the nearest.
    assert ring.pick(prefix) == nearest[0] == ring_of(names).pick(prefix)
    # Requests held as they come: each to the least loaded of the nearest, the nearer among equals.
    picked = []
    for _ in range(3 * len(nearest)):
        replica = ring.pick(prefix)
        assert replica is not None
        ring.increment(replica)
        picked.append(replica)
    assert picked[: len(nearest)] == nearest
    assert Counter(picked) == dict.fromkeys(nearest, 3)
    # One of them freed: the next request goes there.
    ring.decrement(nearest[-1])
    assert ring.pick(prefix) == nearest[-1]


def test_a_prefix_whose_nearest_replicas_are_full_spills_along_the_ring() -> None:
    names = [f"r{i}" for i in range(6)]
    ring = ring_of(names, spread=2, by_prefix=True)
    prefix = affinity_key(b"You are a careful assistant.")
    nearest = nearest_of(ring, prefix)
    # Each of the two past ceil(1.25 x (in flight + 1) / 6): on along the ring, to the third.
    for replica in nearest[:2]:
        for _ in range(5):
            ring.increment(replica)
    assert ring.pick(prefix) == nearest[2]
    assert ring.pick_avoiding(nearest[2], (), prefix) not in (None, nearest[2])


# Through the router ----------------------------------------------------------------------------------


async def start_fleet(
    start_fake: StartFake,
    start_router: StartRouter,
    n: int,
    routing: str,
    behaviour: Behaviour | None = None,
    **kw: Any,
) -> tuple[RouterServer, list[FakeReplica]]:
    fakes = [await start_fake("m", behaviour=behaviour or Behaviour(tokens=2)) for _ in range(n)]
    server = await start_router(
        [replica_entry(f"r{i}", fake) for i, fake in enumerate(fakes)],
        models={"m": {"routing": routing, **kw}},
        expose_replica_header=True,
        tick_seconds=0.05,
    )
    return server, fakes


async def start_held_fleet(
    start_fake: StartFake, start_router: StartRouter, n: int, **kw: Any
) -> tuple[RouterServer, list[FakeReplica]]:
    """Prefix routing over `n` replicas whose answers are each held a moment, so that requests sent
    together are in flight together; the prefix is the prompt's first 256 characters."""
    return await start_fleet(
        start_fake, start_router, n, "prefix", Behaviour(tokens=2, first_token_delay=1.0), prefix_chars=256, **kw
    )


def with_system(system: str, question: str) -> dict[str, Any]:
    """A chat request: `system`'s prompt, then the user's `question`."""
    return {**CHAT, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


async def ask(
    session: aiohttp.ClientSession, server: RouterServer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> str:
    async with session.post(server.client_url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["X-Router-Replica"]


async def test_every_turn_of_a_session_reaches_one_replica(start_fake: StartFake, start_router: StartRouter) -> None:
    server, _ = await start_fleet(start_fake, start_router, 4, "session")
    served: dict[str, set[str]] = defaultdict(set)
    async with aiohttp.ClientSession() as session:
        for turn in range(10):
            for s in range(100):
                body = {**CHAT, "messages": [{"role": "user", "content": f"turn {turn}"}]}
                served[f"s{s}"].add(await ask(session, server, body, {"X-Session-Id": f"s{s}"}))
    assert all(len(replicas) == 1 for replicas in served.values())
    # And the sessions spread over the fleet.
    homes = Counter(next(iter(replicas)) for replicas in served.values())
    assert len(homes) == 4 and min(homes.values()) >= 10
    assert in_flight(server) == dict.fromkeys(("r0", "r1", "r2", "r3"), 0)

    async def counted() -> dict[str, float]:
        found = samples(await scrape(server), "router_affinity_total")
        return {dict(labels)["outcome"]: value for labels, value in found.items()}

    # The tallies reach /metrics at the next tick.
    await tick(server)
    outcomes = await counted()
    assert outcomes == {"hit": 1000}


async def test_the_user_field_and_previous_response_id_name_the_session_too(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server, _ = await start_fleet(start_fake, start_router, 4, "session", session_header="X-Chat")
    async with aiohttp.ClientSession() as session:
        by_user = {await ask(session, server, {**CHAT, "user": "alice"}) for _ in range(20)}
        by_previous = {await ask(session, server, {**CHAT, "previous_response_id": "resp_9"}) for _ in range(20)}
        by_header = {await ask(session, server, CHAT, {"X-Chat": "alice"}) for _ in range(20)}
        # The configured header, not the default one.
        by_default_header = {await ask(session, server, CHAT, {"X-Session-Id": str(i)}) for i in range(40)}
    assert len(by_user) == 1 and by_header == by_user and len(by_previous) == 1
    assert len(by_default_header) > 1


async def test_a_hot_session_spills_instead_of_piling_up(start_fake: StartFake, start_router: StartRouter) -> None:
    server, _ = await start_fleet(start_fake, start_router, 4, "session", Behaviour(tokens=2, first_token_delay=0.5))
    async with aiohttp.ClientSession() as session:
        answered = await asyncio.gather(*(ask(session, server, CHAT, {"X-Session-Id": "hot"}) for _ in range(50)))
    spread = Counter(answered)
    # ceil(1.25 x 50 / 4) = 16 at most on any one replica, the session's home first.
    assert max(spread.values()) <= 16
    assert len(spread) >= 4
    await tick(server)
    found = samples(await scrape(server), "router_affinity_total")
    outcomes = {dict(labels)["outcome"]: value for labels, value in found.items()}
    assert outcomes["hit"] == max(spread.values()) and outcomes["spill"] == 50 - outcomes["hit"]


async def test_a_replica_removed_mid_run_moves_only_its_sessions(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server, fakes = await start_fleet(start_fake, start_router, 4, "session")
    sessions = [f"user-{i}" for i in range(100)]
    async with aiohttp.ClientSession() as session:
        before = {s: await ask(session, server, CHAT, {"X-Session-Id": s}) for s in sessions}
        async with session.put(
            server.admin_url + "/api/v1/endpoints",
            json={"replicas": [replica_entry(f"r{i}", fake) for i, fake in enumerate(fakes) if i != 2]},
        ) as resp:
            assert resp.status == 200, await resp.text()
        after = {s: await ask(session, server, CHAT, {"X-Session-Id": s}) for s in sessions}
    moved = {s for s in sessions if after[s] != before[s]}
    assert moved == {s for s in sessions if before[s] == "r2"}
    assert moved and all(after[s] != "r2" for s in sessions)


async def test_requests_sharing_a_long_prefix_meet_on_one_replica(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server, _ = await start_fleet(start_fake, start_router, 4, "prefix", prefix_chars=256)
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    async with aiohttp.ClientSession() as session:
        shared = {
            await ask(session, server, {**CHAT, "messages": [system, {"role": "user", "content": f"question {i}"}]})
            for i in range(30)
        }
        spread = {
            await ask(session, server, {**CHAT, "messages": [{"role": "user", "content": f"{i} " + "x" * 300}]})
            for i in range(40)
        }
        # No prompt at all: no key, least loaded.
        async with session.post(server.client_url + "/v1/embeddings", json={"model": "m", "input": "x"}) as resp:
            assert resp.status == 200
    assert len(shared) == 1
    assert len(spread) > 1


async def test_the_sessions_of_a_system_prompt_meet_on_its_prefix_replicas(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server, _ = await start_fleet(start_fake, start_router, 6, "session", prefix_chars=256, prefix_replicas=2)
    prompts = [{"role": "system", "content": f"You are assistant number {n}. " * 20} for n in range(2)]
    served: dict[tuple[int, int], set[str]] = defaultdict(set)
    async with aiohttp.ClientSession() as session:
        for s in range(30):
            messages: list[dict[str, str]] = [prompts[s % 2]]
            for turn in range(3):
                messages = [*messages, {"role": "user", "content": f"turn {turn} of {s}"}]
                replica = await ask(session, server, {**CHAT, "messages": messages}, {"X-Session-Id": f"chat-{s}"})
                served[(s % 2, s)].add(replica)
                messages.append({"role": "assistant", "content": "ok"})
    # Every turn of a conversation on one replica, and a system prompt's conversations on two.
    assert all(len(replicas) == 1 for replicas in served.values())
    for prompt in range(2):
        assert len({r for (p, _), replicas in served.items() if p == prompt for r in replicas}) == 2


async def test_a_popular_prefix_is_served_by_its_prefix_replicas_and_no_others(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # A bound far off.
    server, _ = await start_held_fleet(start_fake, start_router, 6, prefix_replicas=2, balance_factor=20)
    system = "You are a careful assistant. " * 20
    async with aiohttp.ClientSession() as session:
        questions = [with_system(system, f"question {i}") for i in range(12)]
        answered = await asyncio.gather(*(ask(session, server, body) for body in questions))
    # Both of its replicas share the prefix's requests, half each; the other four see none.
    assert sorted(Counter(answered).values()) == [6, 6]


async def test_the_replica_header_is_off_unless_asked_for(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
    ):
        assert resp.status == 200
        assert "X-Router-Replica" not in resp.headers


async def test_the_fake_replicas_prefix_cache_finds_a_conversations_earlier_turns(start_fake: StartFake) -> None:
    # bench/affinity.py's figures rest on this cache: check what it reports.
    fake = await start_fake("m", behaviour=Behaviour(tokens=4, prefix_cache_blocks=40, cache_block_chars=16))
    system = {"role": "system", "content": "s" * 200}
    first = [system, {"role": "user", "content": "u" * 100}]

    async def usage(messages: list[dict[str, str]]) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(fake.url + "/v1/chat/completions", json={"model": "m", "messages": messages}) as resp,
        ):
            doc = await resp.json()
            return dict(doc["usage"])

    cold = await usage(first)
    assert "prompt_tokens_details" not in cold and cold["prompt_tokens"] == len(fake_prompt(first)) // 4
    # The next turn: the first turn, its answer, and a new message. All but the new part is found.
    second = [*first, {"role": "assistant", "content": "tok0 tok1 tok2 tok3 "}, {"role": "user", "content": "v" * 50}]
    warm = await usage(second)
    cached = warm["prompt_tokens_details"]["cached_tokens"]
    unfound = len(fake_prompt(second)) - len(fake_prompt(first)) - len("<|assistant|>tok0 tok1 tok2 tok3 \n")
    assert cached * 4 >= len(fake_prompt(second)) - unfound - 16
    # Another conversation on the same system prompt finds the system prompt only.
    other = await usage([system, {"role": "user", "content": "w" * 100}])
    assert 0 < other["prompt_tokens_details"]["cached_tokens"] * 4 <= len("<|system|>" + "s" * 200 + "\n")
    # The LRU forgets: 40 blocks of 16 characters, then a long new prompt pushes the rest out.
    await usage([{"role": "user", "content": "x" * 1000}])
    assert "prompt_tokens_details" not in await usage(first)


def fake_prompt(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
