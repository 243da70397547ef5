"""The buckets' arithmetic on a clock the test moves: refill, admit, refuse, settle, too large."""

from __future__ import annotations

import pytest

from router.core.config.limits import TenantLimit
from router.core.limits.buckets import REQUESTS, TOKENS, Buckets
from router.core.limits.estimates import estimate, output_bound
from router.gateway.limits import duration


class Clock:
    """Seconds the test sets."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_request_limit_is_a_minute_at_once_then_one_every_sixtieth() -> None:
    clock = Clock()
    buckets = Buckets({"a": TenantLimit(requests_per_minute=3)}, clock)
    assert [buckets.admit("a", 10).admitted for _ in range(3)] == [True, True, True]
    refused = buckets.admit("a", 10)
    assert (refused.admitted, refused.kind) == (False, REQUESTS)
    assert refused.retry_after == pytest.approx(20.0)
    assert refused.limit_tokens == 0  # not limited by tokens: left out of the headers
    clock.t += 19.9
    assert not buckets.admit("a", 10).admitted
    clock.t += 0.2
    admitted = buckets.admit("a", 10)
    assert admitted.admitted and admitted.remaining_requests == 0
    # Continuous: a bucket full again after a minute, never more than full.
    clock.t += 600
    assert buckets.admit("a", 10).remaining_requests == 2


def test_tokens_are_taken_on_admission_and_trued_up_by_settlement() -> None:
    clock = Clock()
    buckets = Buckets({"a": TenantLimit(tokens_per_minute=600)}, clock)
    first = buckets.admit("a", 100)
    assert first.remaining_tokens == 500
    assert first.reset_tokens == pytest.approx(10.0)
    # It took 30: 70 come back.
    buckets.settle("a", 30 - 100)
    assert buckets.admit("a", 0).remaining_tokens == 570
    # It took 900 (a bad estimate): the bucket goes into debt, refused until the refill repays it.
    buckets.settle("a", 900 - 100)
    owed = buckets.admit("a", 10)
    assert not owed.admitted and owed.kind == TOKENS
    assert owed.retry_after == pytest.approx((10 + 230) / 10.0)
    clock.t += owed.retry_after + 0.001
    assert buckets.admit("a", 10).admitted
    # Given back never past full.
    buckets.settle("a", -10_000)
    assert buckets.admit("a", 0).remaining_tokens == 600


def test_a_request_larger_than_the_bucket_is_refused_as_too_large_whatever_the_wait() -> None:
    buckets = Buckets({"a": TenantLimit(tokens_per_minute=1000, requests_per_minute=5)}, Clock())
    verdict = buckets.admit("a", 1001)
    assert (verdict.admitted, verdict.too_large, verdict.kind) == (False, True, TOKENS)
    # A refused request took nothing.
    assert buckets.admit("a", 1000).remaining_requests == 4


def test_a_shadow_look_takes_nothing() -> None:
    buckets = Buckets({"a": TenantLimit(requests_per_minute=1)}, Clock())
    assert buckets.admit("a", 1, debit=False).admitted
    assert buckets.admit("a", 1).admitted
    assert not buckets.admit("a", 1, debit=False).admitted


def test_new_limits_start_a_changed_tenant_full_and_forget_a_removed_one() -> None:
    buckets = Buckets({"a": TenantLimit(requests_per_minute=1), "b": TenantLimit(requests_per_minute=1)}, Clock())
    buckets.admit("a", 1)
    buckets.admit("b", 1)
    buckets.update({"a": TenantLimit(requests_per_minute=2), "b": TenantLimit(requests_per_minute=1)})
    assert buckets.admit("a", 1).admitted
    assert not buckets.admit("b", 1).admitted


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 16}, 16),
        ({"max_completion_tokens": 32, "max_tokens": 16}, 32),
        ({"max_output_tokens": 8}, 8),
        ({}, 1024),
        ({"max_tokens": None}, 1024),
        ({"max_tokens": -5}, 1024),
        ({"max_tokens": 16.5}, 1024),
        ({"max_tokens": 16.0}, 16),
        ({"max_tokens": "16"}, 1024),
        ({"max_tokens": True}, 1024),
        ({"max_tokens": float("inf")}, 1024),
        ({"max_tokens": 10**30}, 10**30),
    ],
)
def test_the_output_bound_is_a_whole_number_the_body_gives_else_the_default(
    body: dict[str, object], expected: int
) -> None:
    assert output_bound(body, 1024) == expected


def test_the_estimate_is_the_bytes_over_four_and_the_bound() -> None:
    assert estimate(400, {"max_tokens": 16}, 1024) == 116


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.0123, b"13ms"), (1.0, b"1s"), (17.5, b"17.5s"), (360.0, b"6m0s"), (61.25, b"1m1.25s")]
)
def test_reset_times_are_written_as_openai_writes_them(seconds: float, text: bytes) -> None:
    assert duration(seconds) == text
