"""Properties of merging several routers' usage maps (Hypothesis)."""

from __future__ import annotations

import random
from types import MappingProxyType

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.pool.tallies import MAX_UNSERVED_NAMES, OTHER_MODELS, WORKER_UNSERVED_NAMES, Tallies
from router.core.usage.merging import Combiner, Memory, WorkerReport, combine, report_json
from router.core.usage.snapshots import Queued, RouterReport, Ticker, UsageSnapshot, merge_reports
from tests.support.clock import FakeClock

WALL = 1_764_000_000.0

IDS = ("a", "b", "c")
NOW = 10_000.0


@st.composite
def reports(draw: st.DrawFn) -> RouterReport:
    watched = draw(st.sets(st.sampled_from(IDS), min_size=1))
    watching = {rid: draw(st.floats(0, NOW)) for rid in watched}
    last_used = {}
    for rid in watched:
        if draw(st.booleans()):
            last_used[rid] = draw(st.floats(watching[rid], NOW))
    return RouterReport(
        server=draw(st.text(max_size=3)), last_used=last_used, watching_since=watching, generated_at=NOW
    )


report_lists = st.lists(reports(), min_size=1, max_size=4)
idle_fors = st.floats(0, NOW)


@given(report_lists, idle_fors, st.randoms())
def test_merging_is_order_independent(items: list[RouterReport], idle_for: float, rng: object) -> None:
    shuffled = list(items)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert merge_reports(items, now=NOW, idle_for=idle_for) == merge_reports(shuffled, now=NOW, idle_for=idle_for)


@given(report_lists, reports())
def test_adding_a_report_never_makes_a_replica_look_quieter(items: list[RouterReport], extra: RouterReport) -> None:
    before = merge_reports(items, now=NOW, idle_for=0.0)
    after = merge_reports([*items, extra], now=NOW, idle_for=0.0)
    for rid, quiet in after.quiet_for.items():
        if quiet is not None:
            previous = before.quiet_for.get(rid)
            assert previous is not None
            assert quiet <= previous


@given(report_lists, st.sampled_from(IDS), st.floats(1.0, NOW))
def test_a_restarted_router_never_makes_a_replica_a_candidate(
    items: list[RouterReport], rid: str, idle_for: float
) -> None:
    # It started watching everything just now and knows no stamps.
    restarted = RouterReport(server="new", last_used={}, watching_since=dict.fromkeys(IDS, NOW), generated_at=NOW)
    merged = merge_reports([*items, restarted], now=NOW, idle_for=idle_for)
    assert merged.candidates == ()


@given(report_lists, idle_fors)
def test_an_unanswered_router_yields_no_candidates(items: list[RouterReport], idle_for: float) -> None:
    merged = merge_reports([*items, None], now=NOW, idle_for=idle_for)
    assert merged.complete is False
    assert merged.candidates == ()
    assert set(merged.unknown) == set(merged.quiet_for)


@given(report_lists)
def test_the_quiet_time_is_the_proven_bound(items: list[RouterReport]) -> None:
    merged = merge_reports(items, now=NOW, idle_for=0.0)
    for rid, quiet in merged.quiet_for.items():
        horizons = [max(r.watching_since[rid], r.last_used.get(rid, 0.0)) for r in items if rid in r.watching_since]
        if len(horizons) < len(items):
            assert quiet is None
        else:
            assert quiet == max(0.0, NOW - max(horizons))
        stamps = [r.last_used[rid] for r in items if rid in r.last_used]
        assert merged.last_used[rid] == (max(stamps) if stamps else None)


def test_unknown_is_not_idle_for_a_single_fresh_router() -> None:
    fresh = RouterReport(server="r", last_used={}, watching_since={"a": NOW - 5}, generated_at=NOW)
    merged = merge_reports([fresh], now=NOW, idle_for=60.0)
    assert merged.candidates == ()
    assert merged.quiet_for["a"] == 5.0
    assert merged.last_used["a"] is None


def test_the_bound_holds_as_of_the_oldest_snapshot_not_as_of_now() -> None:
    # A snapshot taken 10 s ago says nothing of the last 10 s: a request may
    # have arrived since. The proven quiet time ends at the snapshot.
    stale = RouterReport(server="r", last_used={"a": NOW - 100}, watching_since={"a": 0.0}, generated_at=NOW - 10)
    fresh = RouterReport(server="s", last_used={}, watching_since={"a": 0.0}, generated_at=NOW)
    merged = merge_reports([stale, fresh], now=NOW, idle_for=95.0)
    assert merged.quiet_for["a"] == 90.0
    assert merged.candidates == ()


def test_the_workers_queues_add_up_and_a_dead_workers_queue_leaves_with_it() -> None:
    """Queued requests are a gauge: summed over live workers, never kept from a retired one as counters are."""

    def worker(queued: dict[str, int]) -> UsageSnapshot:
        return UsageSnapshot("w", 0.0, 10.0, 1.0, (), queued=MappingProxyType(queued))

    memory = Memory()
    both = combine(
        [worker({"m": 2}), worker({"m": 1, "n": 4})], memory, router="r", started_at=0, generated_at=10, tick_seconds=1
    )
    assert dict(both.queued) == {"m": 3, "n": 4}
    memory.retire(worker({"m": 2}))
    alone = combine([worker({"n": 1})], memory, router="r", started_at=0, generated_at=11, tick_seconds=1)
    assert dict(alone.queued) == {"n": 1}
    assert UsageSnapshot.from_json(both.to_json()).queued == both.queued


def test_the_workers_queues_by_class_and_tenant_add_up_and_the_oldest_wait_wins() -> None:
    def worker(queues: dict[tuple[str, str, str], Queued]) -> UsageSnapshot:
        return UsageSnapshot("w", 0.0, 10.0, 1.0, (), queues=MappingProxyType(queues))

    a, b = ("m", "batch", "a"), ("m", "interactive", "b")
    both = combine(
        [worker({a: Queued(2, 5.0), b: Queued(0, None)}), worker({a: Queued(3, 4.0), b: Queued(1, 7.0)})],
        Memory(),
        router="r",
        started_at=0,
        generated_at=10,
        tick_seconds=1,
    )
    assert dict(both.queues) == {a: (5, 4.0), b: (1, 7.0)}
    assert UsageSnapshot.from_json(both.to_json()).queues == both.queues


# Model names clients asked for that nothing serves, each request sent to one of two workers.
asked_names = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 160)), max_size=600)


@given(st.lists(asked_names, min_size=1, max_size=3), st.integers(0, 1))
def test_the_unserved_names_are_bounded_after_the_workers_merge_and_each_count_is_whole(
    rounds: list[list[tuple[int, int]]], dies: int
) -> None:
    """At most 100 names over every worker together, each with its whole count, the rest under __other__.

    Collected after each round of requests, as the supervisor does each tick;
    a worker may die between rounds (its totals retired) and start again.
    """
    memory = Memory()
    workers = [Tallies(WORKER_UNSERVED_NAMES), Tallies(WORKER_UNSERVED_NAMES)]
    real: dict[str, int] = {}
    shown: set[str] = set()
    other = 0

    def snapshot(tallies: Tallies) -> UsageSnapshot:
        return UsageSnapshot("w", 0.0, 10.0, 1.0, (), unserved=MappingProxyType(dict(tallies.unserved)))

    for number, requests in enumerate(rounds):
        for worker, name in requests:
            workers[worker].unserved_request(f"model-{name}")
            real[f"model-{name}"] = real.get(f"model-{name}", 0) + 1
        merged = dict(
            combine(
                [snapshot(t) for t in workers], memory, router="r", started_at=0, generated_at=10, tick_seconds=1
            ).unserved
        )
        named = {name: n for name, n in merged.items() if name != OTHER_MODELS}
        assert len(named) <= MAX_UNSERVED_NAMES
        assert named == {name: real[name] for name in named}
        assert merged.get(OTHER_MODELS, 0) == sum(real.values()) - sum(named.values())
        # A name once shown stays; the sum of the rest never goes down.
        assert shown <= set(named)
        assert merged.get(OTHER_MODELS, 0) >= other
        shown, other = set(named), merged.get(OTHER_MODELS, 0)
        if number == 0:
            memory.retire(snapshot(workers[dies]))
            workers[dies] = Tallies(WORKER_UNSERVED_NAMES)


# The supervisor of --workers: each worker's changes, combined as they come ------------------------


def _worker(configs: list[ReplicaConfig], clock: FakeClock) -> Ticker:
    return Ticker(
        Pool(configs, clock=clock),
        [],
        router="w",
        started_at=WALL,
        tick_seconds=1.0,
        wall=lambda: clock.now() + WALL,
        mono=clock.now,
    )


def _fleet(salt: int) -> list[ReplicaConfig]:
    return [
        ReplicaConfig(f"r{i}", f"m{i % 2}", f"http://127.0.0.1:{9000 + i + (salt if i == 0 else 0)}") for i in range(5)
    ]


def _wire(snapshot: UsageSnapshot) -> WorkerReport:
    """A worker's report as it crosses to the supervisor: JSON, and back."""
    return WorkerReport.from_json(orjson.loads(orjson.dumps(report_json(snapshot))))


def _plain(snapshot: UsageSnapshot) -> list[tuple[object, ...]]:
    return sorted(
        ((*r[:8], dict(r.labels), dict(r.responses), dict(r.errors), *r[11:]) for r in snapshot.replicas), key=repr
    )


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 60))
def test_the_workers_changes_combined_as_they_come_equal_their_whole_snapshots_combined(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    workers = [_worker(_fleet(0), clock) for _ in range(3)]
    held: list[list[Replica]] = [[] for _ in workers]
    combiner, memory = Combiner(Memory()), Memory()
    # The reference: each worker's last whole snapshot, combined whole.
    last: dict[int, UsageSnapshot] = {}
    published: int | None = None
    for _ in range(steps):
        clock.advance(rng.choice((0.5, 3.0)))
        index = rng.randrange(len(workers))
        pool = workers[index].pool
        op = rng.randrange(10)
        if op < 3:
            got = pool.acquire(f"m{rng.randrange(2)}")
            if got is not None:
                held[index].append(got)
                pool.count_response(got, rng.choice((200, 503)))
        elif op < 5 and held[index]:
            pool.release(held[index].pop(rng.randrange(len(held[index]))))
        elif op == 5:
            replica = rng.choice(list(pool))
            if not replica.removed:
                pool.set_draining(replica.id, not replica.draining)
        elif op == 6:
            configs = _fleet(rng.randrange(3))
            for worker in workers:
                worker.pool.set_replicas(configs)
        elif op == 7:
            # A worker dies: its last report taken into the memory; a new one starts.
            combiner.drop(index)
            if index in last:
                memory.retire(last.pop(index))
            workers[index] = _worker(list(pool.configs()), clock)
            held[index] = []
        else:
            # A collection; now and then two overlapping ones, answered out of order.
            for i, worker in enumerate(workers):
                taken = combiner.since(i)
                since = taken[1] if taken is not None and taken[0] == worker.snapshotter.book.number else None
                first = worker.snapshot(since=since)
                if rng.random() < 0.3:
                    # Another collection asks the same before the first answer is taken;
                    # the worker served a request in between. Answers taken in either order.
                    clock.advance(0.25)
                    got = worker.pool.acquire(f"m{rng.randrange(2)}")
                    if got is not None:
                        worker.pool.release(got)
                    second = worker.snapshot(since=since)
                    answers = [first, second] if rng.random() < 0.5 else [second, first]
                    for answer in answers:
                        combiner.update(i, _wire(answer))
                    first = second
                else:
                    combiner.update(i, _wire(first))
                last[i] = first
            generated_at = clock.now() + WALL
            combined = combiner.snapshot(
                router="r", started_at=WALL, generated_at=generated_at, tick_seconds=1.0, since=published
            )
            whole = combine(
                last.values(), memory, router="r", started_at=WALL, generated_at=generated_at, tick_seconds=1.0
            )
            assert _plain(combined) == _plain(whole)
            for name in ("retries", "fallbacks", "unserved", "hold_outcomes", "affinity", "demand"):
                assert dict(getattr(combined, name)) == dict(getattr(whole, name))
            published = combined.seq
