"""What a request is estimated to take before it is sent: its prompt's size, and the most it may write.

The prompt: its body's bytes over four (about a token per four bytes of
English; JSON's quoting and field names count, so this leans high). The
output: the largest of `max_tokens`, `max_completion_tokens` (OpenAI's chat)
and `max_output_tokens` (the Responses API) the body gives as a whole
number of at least 0; none given, or none that reads as one (negative, a
fraction, a string, a boolean: the engine will judge the request), counts
as `unbounded` ([limits] unbounded_output_tokens). The output is counted once
per answer asked for (`n`, or `best_of` candidates, per prompt of a batched
completions request), and only on the paths that generate text
(GENERATING_PATHS): an embedding, a token count or a score costs its input. The
estimate is settled with the answer's usage when the answer ends: a wrong guess
costs only until then.
"""

from __future__ import annotations

from typing import Any

from router.core.config.engines import GENERATING_PATHS

OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# The counts of sequences a request asks the engine to generate: its choices, and the
# completions API's candidates (each written in full, the best one returned).
SEQUENCE_FIELDS = ("n", "best_of")


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


def sequences(parsed: dict[str, Any]) -> int:
    """How many answers the engine writes for the request: the largest of `n` and `best_of` given
    as a whole number (else 1), for each prompt of a batch (`prompt` a list of texts or of token lists)."""
    count = 1
    for name in SEQUENCE_FIELDS:
        value = parsed.get(name)
        if type(value) is int and value > count:
            count = value
    prompt = parsed.get("prompt")
    # A list of numbers is one prompt's tokens; a list of texts or of token lists is a batch.
    if type(prompt) is list and prompt and type(prompt[0]) is not int:
        count *= len(prompt)
    return count


def output_estimate(parsed: dict[str, Any], unbounded: int, path: str) -> int:
    """The most a request to `path` whose body reads as `parsed` may generate, over every answer it
    asks for (`unbounded` per answer when it names no usable bound); 0 where the path generates nothing.

    The limits' estimate and the fair queue's (fairness_unit = "tokens") both count the output so.
    """
    return output_bound(parsed, unbounded) * sequences(parsed) if path in GENERATING_PATHS else 0


def estimate(body_bytes: int, parsed: dict[str, Any], unbounded: int, path: str, bucket: int = 0) -> int:
    """The tokens a request to `path` of `body_bytes` whose body reads as `parsed` is admitted against.

    `bucket`: the tenant's tokens a minute (0: not limited by tokens). An estimate past it that only
    the prompt's guess puts there is taken as the whole bucket: bytes over four is a guess that an
    image's or an audio file's encoding inflates many times over (every byte of a base64 `data:`
    URL counts), and settlement takes what the answer says it took. Only an output bound past
    the bucket is certainly too large.
    """
    prompt = body_bytes >> 2
    output = output_estimate(parsed, unbounded, path)
    total = prompt + output
    if bucket and total > bucket >= output:
        return bucket
    return total
