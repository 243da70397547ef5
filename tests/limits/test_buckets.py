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
    assert estimate(400, {"max_tokens": 16}, 1024, "/v1/chat/completions") == 116


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 16, "n": 50}, 100 + 16 * 50),
        ({"max_tokens": 16, "n": 2, "best_of": 5}, 100 + 16 * 5),
        # Not whole numbers of at least 2: one answer.
        ({"max_tokens": 16, "n": "50", "best_of": 0}, 116),
        ({"max_tokens": 16, "n": True}, 116),
        ({"max_tokens": 16, "n": 2.0}, 116),
        # A batch of prompts, texts or token lists: each prompt's answers.
        ({"max_tokens": 16, "prompt": ["a", "b", "c"], "n": 2}, 100 + 16 * 6),
        ({"max_tokens": 16, "prompt": [[1, 2], [3]]}, 100 + 16 * 2),
        # One prompt, as text or as its tokens.
        ({"max_tokens": 16, "prompt": [1, 2, 3]}, 116),
        ({"max_tokens": 16, "prompt": "abc"}, 116),
        ({"max_tokens": 16, "prompt": []}, 116),
    ],
)
def test_the_output_is_counted_once_per_answer_asked_for(body: dict[str, object], expected: int) -> None:
    assert estimate(400, body, 1024, "/v1/completions") == expected


@pytest.mark.parametrize(
    ("body_bytes", "body", "expected"),
    [
        # Within the bucket: as estimated.
        (4000, {"max_tokens": 100}, 1100),
        # The prompt's guess past the bucket: the whole bucket, settled with the usage.
        (400_000, {"max_tokens": 100}, 10_000),
        (400_000, {}, 10_000),
        # The output bound alone past it: as estimated, and refused as too large.
        (400, {"max_tokens": 20_000}, 20_100),
        (400, {"max_tokens": 100, "n": 200}, 20_100),
    ],
)
def test_an_estimate_past_the_bucket_is_the_bucket_unless_the_output_alone_is(
    body_bytes: int, body: dict[str, object], expected: int
) -> None:
    assert estimate(body_bytes, body, 1024, "/v1/chat/completions", 10_000) == expected


@pytest.mark.parametrize(
    "path", ["/v1/embeddings", "/v1/messages/count_tokens", "/tokenize", "/v1/rerank", "/v1/chat/completions/render"]
)
def test_a_path_that_writes_no_text_costs_its_input_alone(path: str) -> None:
    """No output bound on a path whose answer generates nothing: not even the unbounded default."""
    assert estimate(400, {"input": "x"}, 1024, path) == 100
    assert estimate(400, {"max_tokens": 16, "n": 4}, 1024, path) == 100


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0123, b"13ms"),
        (1.0, b"1s"),
        (17.5, b"17.5s"),
        (360.0, b"6m0s"),
        (61.25, b"1m1.25s"),
        (59.9996, b"1m0s"),
        (119.9996, b"2m0s"),
        (0.9996, b"1s"),
        (60.0, b"1m0s"),
    ],
)
def test_reset_times_are_written_as_openai_writes_them(seconds: float, text: bytes) -> None:
    assert duration(seconds) == text
