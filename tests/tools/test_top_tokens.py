"""router ctl top's tenant table: each tenant's tokens, and their rate once two reads are known."""

from __future__ import annotations

from typing import Any

from router.tools.top import build_frame, render, tokens_by_tenant

NOW = 1_800_000_000.0


def status(tenants: list[dict[str, Any]]) -> dict[str, Any]:
    return {"router": "r", "generated_at": NOW, "watching_since": NOW - 60, "models": [], "tenants": tenants}


def tenant(name: str, prompt: int, completion: int, unknown: int = 0) -> dict[str, Any]:
    return {
        "tenant": name,
        "prompt_tokens": prompt,
        "cached_tokens": 0,
        "completion_tokens": completion,
        "unknown_requests": unknown,
    }


def test_a_tenants_token_rate_is_unknown_at_first_and_then_the_difference_over_the_interval() -> None:
    first = status([tenant("a", 100, 20), tenant("b", 5, 5, unknown=3)])
    frame = build_frame([], first, previous=None, elapsed=None)
    assert [t.tokens_per_second for t in frame.tenants] == [None, None]
    later = status([tenant("a", 300, 70), tenant("b", 5, 5, unknown=4)])
    frame = build_frame([], later, previous={}, elapsed=2.0, previous_tokens=tokens_by_tenant(first))
    assert [(t.tenant, t.tokens_per_second) for t in frame.tenants] == [("a", 125.0), ("b", 0.0)]
    lines = render(frame, width=80)
    header = next(line for line in lines if line.startswith("TENANT"))
    assert header.split() == ["TENANT", "TOK/S", "PROMPT", "CACHED", "COMPLETION", "UNKNOWN"]
    assert next(line for line in lines if line.startswith("a ")).split() == ["a", "125", "300", "0", "70", "0"]
    assert frame.as_json()["tenants"][1]["unknown_requests"] == 4


def test_a_tenants_count_that_went_down_has_an_unknown_rate_and_no_tokens_no_table() -> None:
    frame = build_frame([], status([tenant("a", 10, 0)]), previous={}, elapsed=1.0, previous_tokens={"a": 500})
    assert frame.tenants[0].tokens_per_second is None
    assert not any(
        line.startswith("TENANT") for line in render(build_frame([], status([]), previous=None, elapsed=None))
    )
