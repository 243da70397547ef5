"""When an engine is saturated: the queue now and the KV cache, as the picks read a lagged reading."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from router.core.pool.loads import Bounds, EngineLoad, EngineView, Prefills, blended, pressure, queue_now

BOUNDS = Bounds(waiting=10, kv=0.8)


def reading(waiting: float, kv: float | None, sent_then: int = 0) -> EngineLoad:
    return EngineLoad(waiting, 4, kv, at=0.0, sent_then=sent_then, source="metrics")


def test_requests_sent_since_a_reading_count_as_queued_only_where_the_engine_was_queueing() -> None:
    # Room in its batch: what this router sent since went into it (continuous batching).
    assert queue_now(reading(0, 0.3, sent_then=2), in_flight=20) == 0
    # Queueing already: each request sent since waits behind them.
    assert queue_now(reading(3, 0.3, sent_then=2), in_flight=6) == 7
    # Requests that ended since do not shorten the queue it read.
    assert queue_now(reading(3, 0.3, sent_then=6), in_flight=2) == 3


def test_a_full_kv_cache_saturates_only_while_requests_wait() -> None:
    assert pressure(reading(0, 0.97), 8, BOUNDS) < 1
    assert pressure(reading(1, 0.97), 8, BOUNDS) >= 1
    assert pressure(reading(1, 0.5), 8, BOUNDS) < 1
    assert pressure(reading(10, 0.1), 8, BOUNDS) >= 1
    # An engine that says nothing of its cache (llama.cpp): its queue alone.
    assert pressure(reading(9, None, sent_then=8), 9, BOUNDS) == 1.0


@dataclass
class Candidate:
    """A replica as the engine view reads it."""

    model: str
    in_flight: int
    load: EngineLoad | None
    prefills: Prefills | None = None


def test_the_picks_inlined_score_is_blended_or_infinite_past_the_bounds() -> None:
    """EngineView.judge inlines pressure(), queue_now() and blended(): the same figures for any reading."""
    rng = random.Random(35)
    now = 100.0
    view = EngineView(lambda: now, stale_after=1.0, bounds={"tight": Bounds(2, 0.5)}, default=BOUNDS)
    for _ in range(5000):
        model = rng.choice(["tight", "other"])
        waiting = rng.choice([0.0, 0.0, 1.0, 3.0, 9.0, 12.0])
        kv = rng.choice([None, 0.1, 0.6, 0.85, 1.0])
        running = rng.choice([None, 0.0, 4.0, 30.0])
        at = now - rng.choice([0.0, 0.3, 0.99, 1.5])
        load = EngineLoad(waiting, running, kv, at=at, sent_then=rng.randrange(6), source="metrics")
        prefills = None
        if rng.random() < 0.3:
            prefills = Prefills()
            prefills.add(now - rng.random(), rng.randrange(2048, 30000), 10_000.0)
        replica = Candidate(model, rng.randrange(8), rng.choice([None, load]), prefills)
        prefilling = prefills.left(now) if prefills is not None else 0.0
        fresh = replica.load if replica.load is not None and now - replica.load.at <= 1.0 else None
        if fresh is not None and pressure(fresh, replica.in_flight, view.bounds(model)) >= 1:
            expected = math.inf
        else:
            expected = blended(fresh, replica.in_flight, prefilling)
        assert view.judge(replica) == pytest.approx(expected), replica
        assert view.saturated(replica) == (expected == math.inf)


def test_the_least_scored_candidate_is_picked_never_an_excluded_one_and_avoid_only_as_a_last_resort() -> None:
    now = 10.0
    view = EngineView(lambda: now, stale_after=1.0, default=BOUNDS)
    busy = Candidate("m", 1, EngineLoad(0, 30, 0.5, at=now, sent_then=1, source="metrics"))
    idle = Candidate("m", 1, EngineLoad(0, 2, 0.1, at=now, sent_then=1, source="metrics"))
    full = Candidate("m", 1, EngineLoad(12, 30, 0.9, at=now, sent_then=1, source="metrics"))
    rng = random.Random(1)
    assert view.least([busy, idle, full], None, (), rng) is idle
    assert view.least([busy, idle, full], idle, (), rng) is busy
    assert view.least([busy, idle, full], None, [idle], rng) is busy
    # Only the avoided one is left: it, unless it is saturated too.
    assert view.least([busy, full], busy, (), rng) is busy
    assert view.least([full], None, (), rng) is None
    assert view.least([full], full, (), rng) is None
