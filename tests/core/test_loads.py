"""When an engine is saturated: the queue now and the KV cache, as the picks read a lagged reading."""

from __future__ import annotations

from router.core.pool.loads import Bounds, EngineLoad, pressure, queue_now

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
