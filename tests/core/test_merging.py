"""Properties of merging several routers' usage maps (Hypothesis)."""

from __future__ import annotations

from types import MappingProxyType

from hypothesis import given
from hypothesis import strategies as st

from router.core.merging import Memory, combine
from router.core.tallies import MAX_UNSERVED_NAMES, OTHER_MODELS, WORKER_UNSERVED_NAMES, Tallies
from router.core.usage import RouterReport, UsageSnapshot, merge_reports

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
