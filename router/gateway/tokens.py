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
given to orjson; compiled, a stream's usual end is read byte by byte first (flat_usage).
Whatever does not read as whole numbers (garbage, a huge or broken
object, a float, a negative) is unknown: None, never 0.
"""

from __future__ import annotations

import re
from types import FunctionType
from typing import TYPE_CHECKING, Any, Final

import orjson

if TYPE_CHECKING:
    # Machine integers to mypyc: its byte reads and arithmetic in C, not on Python's ints. Only
    # ever an annotation, never evaluated (the pure build has no need of mypy_extensions).
    from mypy_extensions import i64

# Final: the compiled build reads these as constants, not from the module's dict (and calls
# orjson's parser without looking it up in its module each time).
_KEY: Final = b'"usage"'
_loads: Final = orjson.loads
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
        usage = _loads(raw)
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


def _last_key(data: bytes, stop: i64) -> i64:
    """Where the last `"usage"` of `data` starts, at or after `stop`; -1 if none does.

    Candidates are tried from the end; a byte that is none of the key's lets the next seven go.
    """
    start: i64 = len(data) - 7
    while start >= stop:
        c: i64 = data[start]
        if c == 0x22:
            if (
                data[start + 6] == 0x22
                and data[start + 1] == 0x75  # u
                and data[start + 2] == 0x73  # s
                and data[start + 3] == 0x61  # a
                and data[start + 4] == 0x67  # g
                and data[start + 5] == 0x65  # e
            ):
                return start
            start -= 1
        elif c == 0x75 or c == 0x73 or c == 0x61 or c == 0x67 or c == 0x65:  # noqa: PLR1714 (compares in C, no set)
            start -= 1
        else:
            # No occurrence holds this byte: none starts in the seven up to it.
            start -= 7
    return -1


def flat_usage(before_last: bytes, last: bytes) -> Tokens | None:
    """read_stream's usual end (a compact, flat OpenAI usage object in the last read, or in the one
    before a last read of its own) read byte by byte: the compiled build's way.

    None unless it is certainly that end, whose counts it gives: the key found and the object
    read as read_stream's searches and orjson read them, with its counts plain whole numbers
    (at most 15 digits) or null, the prompt's present. Anything else, read_stream reads.
    Compiled, each byte read is a load and a compare, where each search is a call through the
    C API (about 1,300 instructions) and orjson a dict made; pure, this is bytecode per byte,
    and the searches the cheaper.
    """
    data = last
    end: i64 = len(last)
    if not end:
        return None
    # Not a conditional expression: compiled, its two sides (an i64 and a literal) make an int
    # object, made and read back.
    stop: i64 = 0
    if end > TAIL_WINDOW:
        stop = end - TAIL_WINDOW
    at: i64 = _last_key(last, stop)
    if at < 0:
        if end >= TAIL_WINDOW:
            return None
        # A key that ends in the last read's first bytes began in the read before: the searches read it.
        for quote in range(end if end < 7 else 7):
            if last[quote] == 0x22:
                return None
        data = before_last
        # In the window, and not its first byte (the searches give that one up).
        at = _last_key(data, max(len(data) - (TAIL_WINDOW - end), 1))
    # Escaped, it is inside a string (a model writing about usage).
    if at <= 0 or data[at - 1] == 0x5C:
        return None
    size: i64 = len(data)
    # The object's "}" is before this (MAX_USAGE_BYTES after the key), and in this read.
    limit: i64 = min(at + 7 + MAX_USAGE_BYTES, size)
    i: i64 = at + 7
    if i + 2 >= limit or data[i] != 0x3A or data[i + 1] != 0x7B:
        return None
    i += 2
    # -1: not named; -2: null.
    prompt: i64 = -1
    completion: i64 = -1
    c: i64
    key: i64
    value: i64
    digits: i64
    while True:
        if i >= limit or data[i] != 0x22:
            return None
        i += 1
        key = i
        while i < limit:
            c = data[i]
            if c == 0x5F or 0x61 <= c <= 0x7A or 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A:
                i += 1
            else:
                break
        if i + 2 >= limit or data[i] != 0x22 or data[i + 1] != 0x3A:
            return None
        length = i - key
        i += 2
        c = data[i]
        if 0x30 <= c <= 0x39:
            value = c - 0x30
            digits = i
            i += 1
            while i < limit:
                c = data[i]
                if not 0x30 <= c <= 0x39:
                    break
                value = value * 10 + c - 0x30
                i += 1
            # A leading zero is no JSON number; 16 digits may pass 2**53.
            if i - digits > 15 or (data[digits] == 0x30 and i - digits > 1):
                return None
        elif c == 0x6E and i + 4 < limit and data[i + 1] == 0x75 and data[i + 2] == 0x6C and data[i + 3] == 0x6C:
            value = -2
            i += 4
        else:
            return None
        if length == 13 and data[key : key + 13] == b"prompt_tokens":
            prompt = value
        elif length == 17 and data[key : key + 17] == b"completion_tokens":
            completion = value
        if i >= limit:
            return None
        c = data[i]
        if c == 0x7D:
            break
        if c != 0x2C:
            return None
        i += 1
    if prompt < 0 or completion == -2:
        return None
    return (prompt, completion if completion >= 0 else 0, None)


# Compiled, flat_usage reads the usual end first (mypyc makes a module's functions built-in ones).
BYTEWISE: Final = type(flat_usage) is not FunctionType


def whole_answer_tokens(body: bytes, bytewise: bool = BYTEWISE) -> Tokens | None:
    """A whole JSON answer's usage (its last `"usage"`: engines write it after the choices, and
    only what follows it, such as prompt logprobs asked for, could put it past WHOLE_WINDOW).

    `bytewise` (where compiled): read byte by byte first, as a stream's last read is, and searched
    only if that leaves it undecided.
    """
    if bytewise:
        # Not narrowed before it is returned: compiled, a tuple narrowed from `| None` is unboxed,
        # then made again (a tuple and its ints) to be returned as one.
        tokens = flat_usage(b"", body)
        if tokens is None:
            tokens = whole_answer_tokens(body, False)
        return tokens
    usage = usage_object(body, within=WHOLE_WINDOW)
    return None if usage is None else tokens_of(usage)


def read_stream(before_last: bytes, last: bytes, first: bytes | None, bytewise: bool = BYTEWISE) -> Tokens | None:
    """A stream's usage from its last two reads (and its first): stream_tokens over their last
    TAIL_WINDOW bytes, in one call for the usual end (a flat OpenAI usage object).

    `bytewise` (where compiled): read byte by byte first (flat_usage), searched only if that
    leaves it undecided. Searched, the end of every counted stream of the pure build runs this,
    so the usual end is read here without a call per step (each Python call costs as much as a
    search here): one search, the flat object cut out, orjson, the counts checked in place.
    Anything else (no flat object, Anthropic's or the Responses API's names, counts that do not
    read) is left to stream_tokens, whose answer it is.
    """
    if bytewise:
        tokens = flat_usage(before_last, last)
        if tokens is None:
            tokens = read_stream(before_last, last, first, False)
        return tokens
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
                usage: dict[str, Any] = _loads(tail[at + 8 : close + 1])
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
