"""What a request is estimated to take before it is sent: its prompt's size, and the most it may write.

The prompt: its body's bytes over four (about a token per four bytes of
English; JSON's quoting and field names count, so this leans high). The
output: the largest of `max_tokens`, `max_completion_tokens` (OpenAI's chat)
and `max_output_tokens` (the Responses API) the body gives as a whole
number of at least 0; none given, or none that reads as one (negative, a
fraction, a string, a boolean: the engine will judge the request), counts
as `unbounded` ([limits] unbounded_output_tokens). The estimate is settled
with the answer's usage when the answer ends: a wrong guess costs only until
then.
"""

from __future__ import annotations

from typing import Any

OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def output_bound(parsed: dict[str, Any], unbounded: int) -> int:
    """The most the request's answer may write, as its body says; `unbounded` when it says nothing usable."""
    found = -1
    for name in OUTPUT_FIELDS:
        value = parsed.get(name)
        if value is None:
            continue
        kind = type(value)
        if kind is int:
            count = value
        elif kind is float and value.is_integer():
            count = int(value)
        else:
            continue
        found = max(found, count)
    return found if found >= 0 else unbounded


def estimate(body_bytes: int, parsed: dict[str, Any], unbounded: int) -> int:
    """The tokens a request of `body_bytes` whose body reads as `parsed` is admitted against."""
    return (body_bytes >> 2) + output_bound(parsed, unbounded)
