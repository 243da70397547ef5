"""The tokens an answer says it took: its `usage`, read from the bytes the client gets, never changed.

Each shape the router passes carries its usage in its own place:

- a whole JSON answer (chat, completions, embeddings): `usage` with
  `prompt_tokens`, `completion_tokens` and `prompt_tokens_details.cached_tokens`;
- a chat or completions stream whose client asked for it
  (`stream_options.include_usage`): the last chunk before `data: [DONE]`,
  with `choices: []`;
- the Responses API: `response.usage` in the last event, `response.completed`
  (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`);
- Anthropic's Messages: `message_start` (the prompt side, first) and
  `message_delta` (`output_tokens`, last), where `input_tokens` leaves out
  the prompt read from the cache (`cache_read_input_tokens`) and written to
  it (`cache_creation_input_tokens`).

Reading must cost next to nothing on the data path: no answer is parsed
whole. The last `"usage"` of the bytes is found by a search in C, the object
after it cut out (a flat one by two more searches, one with details by a
regular expression matching braces one level deep), and only that slice
given to orjson. Whatever does not read as whole numbers (garbage, a huge or broken
object, a float, a negative) is unknown: None, never 0.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

# Final: the compiled build reads these as constants, not from the module's dict.
_KEY: Final = b'"usage"'
# A usage object is a few hundred bytes; one past this is not one an engine wrote.
MAX_USAGE_BYTES: Final = 4096
# A count past JSON's exact integers (2**53) is no count an engine made.
_MAX_COUNT: Final = 1 << 53
# Where `"usage"` is looked for: a stream's last bytes (its usage event, then at most
# `data: [DONE]`, or the few fields after usage in a response.completed), and the end
# of a whole answer.
TAIL_WINDOW: Final = 512
WHOLE_WINDOW: Final = 65536
# OpenAI's streams, which carry usage only when the client asks (`stream_options`) or the
# engine is told to send it anyway (vLLM's and SGLang's `should_include_usage`). Anthropic's
# and the Responses API's always carry it.
USAGE_ON_ASK_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
# A replica not seen to volunteer usage has one unasked stream in this many searched for it:
# the rest are unknown without a search, and one that starts volunteering is seen within as many.
UNASKED_SAMPLE: Final = 64


# What one answer says it took: (prompt, completion, cached), cached None when it says
# nothing of its prompt cache. A plain tuple: made once per answer on the data path, where
# a NamedTuple's or a dataclass's constructor (Python code) costs as much as the reading.
Tokens = tuple[int, int, int | None]

# After the key: the colon, and the object, flat or with objects one deep inside (its details).
# The two character classes and the braces are disjoint, so the match is linear.
_OBJECT = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})")


def usage_object(data: bytes, *, last: bool = True, within: int = 0) -> dict[str, Any] | None:
    """The `usage` object in `data` (the last one, or the first with `last=False`), parsed; None if none reads.

    `within`: look only in the last (or first) this many bytes: a search costs per byte
    searched, and a stream's last read may be the whole stream.
    """
    if last:
        at = data.rfind(_KEY, len(data) - within) if 0 < within < len(data) else data.rfind(_KEY)
    else:
        at = data.find(_KEY, 0, within) if within else data.find(_KEY)
    # Inside a string (a model writing about usage) the quotes are escaped.
    if at <= 0 or data[at - 1] == 0x5C:
        return None
    at += 7  # len(_KEY)
    raw: bytes | None = None
    if data[at : at + 2] == b":{":
        # Compact JSON, as engines write it, and a flat object (its details null or absent):
        # two searches in C, cheaper than the expression's per-byte matching.
        close = data.find(b"}", at, at + MAX_USAGE_BYTES)
        if close > 0 and data.find(b"{", at + 2, close) < 0:
            raw = data[at + 1 : close + 1]
    if raw is None:
        found = _OBJECT.match(data, at, at + MAX_USAGE_BYTES)
        if found is None:
            return None
        raw = found.group(1)
    try:
        usage = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return usage if type(usage) is dict else None


def _count(value: object) -> int | None:
    # bool is an int to Python, not to JSON.
    if type(value) is int and 0 <= value < _MAX_COUNT:
        return value
    return None


def _detail(usage: dict[str, Any], details: str, name: str) -> int | None:
    inner = usage.get(details)
    return _count(inner.get(name)) if type(inner) is dict else None


def tokens_of(usage: dict[str, Any]) -> Tokens | None:
    """A usage object of any of the shapes above as Tokens; None unless its counts are whole numbers."""
    prompt = usage.get("prompt_tokens")
    if prompt is not None:
        # An embedding's usage has no completion: it made none.
        completion = usage.get("completion_tokens", 0)
        if type(prompt) is not int or type(completion) is not int or not 0 <= prompt < _MAX_COUNT > completion >= 0:
            return None
        # Inline, not _detail(): a Python call here costs as much as the rest.
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        if type(cached) is not int or not 0 <= cached < _MAX_COUNT:
            cached = None
        return (prompt, completion, cached)
    if "input_tokens" in usage:
        prompt = _count(usage["input_tokens"])
        completion = _count(usage.get("output_tokens"))
        if prompt is None or completion is None:
            return None
        if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
            # Anthropic's: input_tokens is only the part neither read from nor written to the cache.
            read = _count(usage.get("cache_read_input_tokens") or 0)
            written = _count(usage.get("cache_creation_input_tokens") or 0)
            if read is None or written is None:
                return None
            return (prompt + read + written, completion, read)
        return (prompt, completion, _detail(usage, "input_tokens_details", "cached_tokens"))
    return None


def whole_answer_tokens(body: bytes) -> Tokens | None:
    """A whole JSON answer's usage (its last `"usage"`: engines write it after the choices, and
    only what follows it, such as prompt logprobs asked for, could put it past WHOLE_WINDOW)."""
    usage = usage_object(body, within=WHOLE_WINDOW)
    return None if usage is None else tokens_of(usage)


def read_stream(before_last: bytes, last: bytes, first: bytes | None) -> Tokens | None:
    """A stream's usage from its last two reads (and its first): stream_tokens over their last
    TAIL_WINDOW bytes, in one call for the usual end (a flat OpenAI usage object).

    The end of every counted stream runs this, so the usual end is read here without a call
    per step (each Python call costs as much as a search here): one search, the flat object cut
    out, orjson, the counts checked in place. Anything else (no flat object, Anthropic's or the
    Responses API's names, counts that do not read) is left to stream_tokens, whose answer it is.
    """
    # The usage event may be split over the last two reads, or followed by [DONE] in a read of its own.
    tail = last if len(last) >= TAIL_WINDOW else before_last[-TAIL_WINDOW:] + last
    start = len(tail) - TAIL_WINDOW
    at = tail.rfind(_KEY, start if start > 0 else 0)
    if at <= 0:
        return None
    if tail[at - 1] != 0x5C and tail[at + 7 : at + 9] == b":{":
        # Bounded after the search, not by it: each bound given to a bytes method is parsed
        # (about 450 instructions), and the first "}" is near.
        close = tail.find(b"}", at + 7)
        # Flat: no brace inside (one with details is cut out by stream_tokens' expression).
        # A search with bounds, not `in` on a slice: that copies, and costs half as much again.
        if 0 < close < at + 7 + MAX_USAGE_BYTES and tail.find(b"{", at + 9, close) < 0:
            try:
                # A dict, as an object parsed whole is: compiled, its reads are direct.
                usage: dict[str, Any] = orjson.loads(tail[at + 8 : close + 1])
            except orjson.JSONDecodeError:
                return None
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens", 0)
            if type(prompt) is int and type(completion) is int and 0 <= prompt < _MAX_COUNT > completion >= 0:
                # Flat: its details, if named, are null, so it says nothing of its cache.
                return (prompt, completion, None)
    return stream_tokens(tail, first)


def stream_tokens(tail: bytes, first: bytes | None) -> Tokens | None:
    """A stream's usage: from the end of its `tail` (its last reads), completed from its `first`
    read's when the last says only the output (Anthropic's message_delta after message_start)."""
    usage = usage_object(tail, within=TAIL_WINDOW)
    if usage is None:
        return None
    if "input_tokens" not in usage and "prompt_tokens" not in usage and first is not None:
        start = usage_object(first, last=False, within=TAIL_WINDOW)
        if start is not None:
            usage = {**start, **usage}
    return tokens_of(usage)
