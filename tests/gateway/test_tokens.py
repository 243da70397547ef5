"""Reading an answer's usage from its bytes: every shape the router passes, and what is not a count."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.pool.tallies import MAX_TOKEN_TENANTS, OTHER_TENANTS, Tallies
from router.gateway.tokens import (
    MAX_USAGE_BYTES,
    TAIL_WINDOW,
    flat_usage,
    read_stream,
    stream_tokens,
    tokens_of,
    whole_answer_tokens,
)


def chunk(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def test_a_whole_answers_usage_gives_prompt_completion_and_cached_tokens() -> None:
    body = orjson.dumps(
        {
            "id": "chatcmpl-1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {
                "prompt_tokens": 40,
                "completion_tokens": 7,
                "total_tokens": 47,
                "prompt_tokens_details": {"cached_tokens": 32},
            },
            "kv_transfer_params": None,
        }
    )
    assert whole_answer_tokens(body) == (40, 7, 32)


def test_an_answer_that_says_nothing_of_its_cache_has_cached_unknown_not_zero() -> None:
    body = b'{"usage": {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}}'
    assert whole_answer_tokens(body) == (4, 16, None)


def test_an_embeddings_usage_has_no_completion_tokens_and_counts_none() -> None:
    assert whole_answer_tokens(b'{"data": [], "usage": {"prompt_tokens": 3, "total_tokens": 3}}') == (3, 0, None)


def test_usage_written_by_the_model_inside_its_text_is_not_read() -> None:
    text = '"usage": {"prompt_tokens": 999, "completion_tokens": 999}'
    body = orjson.dumps({"choices": [{"message": {"content": text}}]})
    assert whole_answer_tokens(body) is None


def test_a_streams_usage_chunk_before_done_is_read_from_its_tail() -> None:
    tail = chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 64}}) + b"data: [DONE]\n\n"
    assert stream_tokens(tail, None) == (5, 64, None)


def test_a_stream_without_usage_or_with_usage_null_is_unknown() -> None:
    assert stream_tokens(b"data: [DONE]\n\n", None) is None
    assert stream_tokens(chunk({"choices": [{"delta": {}}], "usage": None}) + b"data: [DONE]\n\n", None) is None


def test_the_responses_apis_completed_event_gives_input_output_and_cached_tokens() -> None:
    usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 12, "total_tokens": 21}
    event = {"type": "response.completed", "response": {"id": "resp_1", "output": [], "usage": usage, "user": None}}
    tail = b"event: response.completed\n" + chunk(event)
    assert stream_tokens(tail, None) == (9, 12, 4)


def test_anthropics_stream_takes_its_prompt_from_message_start_and_output_from_message_delta() -> None:
    start = {
        "type": "message_start",
        "message": {"id": "msg_1", "usage": {"input_tokens": 6, "cache_read_input_tokens": 10, "output_tokens": 0}},
    }
    first = b"event: message_start\n" + chunk(start)
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 20}}
    tail = b"event: message_delta\n" + chunk(delta) + b"event: message_stop\n" + chunk({"type": "message_stop"})
    # Anthropic's input_tokens leaves out what was read from the cache: the prompt is both.
    assert stream_tokens(tail, first) == (16, 20, 10)


def test_an_anthropic_whole_answer_counts_cache_writes_in_the_prompt() -> None:
    usage = {"input_tokens": 3, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 0, "output_tokens": 2}
    assert tokens_of(usage) == (8, 2, 0)


def test_message_delta_alone_without_its_start_is_unknown() -> None:
    assert stream_tokens(chunk({"type": "message_delta", "usage": {"output_tokens": 20}}), None) is None


def test_counts_that_are_not_whole_non_negative_numbers_are_unknown() -> None:
    for bad in (1.5, -1, True, "4", None, [4], {"n": 4}, 1 << 60):
        assert tokens_of({"prompt_tokens": bad, "completion_tokens": 1}) is None, bad
        assert tokens_of({"prompt_tokens": 1, "completion_tokens": bad}) is None, bad
        assert tokens_of({"input_tokens": 1, "output_tokens": bad}) is None, bad
        assert tokens_of({"input_tokens": 1, "output_tokens": 1, "cache_read_input_tokens": bad}) in (
            None,
            (1, 1, 0),  # a falsy null or 0 is none read
        ), bad


def test_a_garbage_a_cut_and_a_huge_usage_are_unknown() -> None:
    assert whole_answer_tokens(b'{"usage": {"prompt_tokens": 4, "completion_tokens": ') is None
    assert whole_answer_tokens(b'{"usage": {"prompt_tokens": 4,, "completion_tokens": 1}}') is None
    assert whole_answer_tokens(b'{"usage": "many"}') is None
    padding = " " * MAX_USAGE_BYTES
    assert whole_answer_tokens(b'{"usage": {"prompt_tokens": 4,%b"completion_tokens": 1}}' % padding.encode()) is None
    deep = b'{"usage": {"a": ' + b'{"b": ' * 40 + b"1" + b"}" * 40 + b', "prompt_tokens": 1, "completion_tokens": 1}}'
    assert whole_answer_tokens(deep) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.one_of(st.none(), st.binary(max_size=200)))
def test_any_bytes_read_as_tokens_or_unknown_and_never_raise(data: bytes, first: bytes | None) -> None:
    for text in (data, b'{"usage": ' + data, b'data: {"choices": [], "usage": {' + data):
        for found in (whole_answer_tokens(text), stream_tokens(text, first)):
            assert found is None or (found[0] >= 0 and found[1] >= 0)


# Usage objects as engines write them (compact, flat or with details) and as they should not be.
_values = st.one_of(
    st.integers(min_value=-3, max_value=1 << 54), st.none(), st.booleans(), st.floats(allow_nan=False), st.text()
)
_usages = st.dictionaries(
    st.sampled_from(
        [
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "input_tokens",
            "output_tokens",
            "cache_read_input_tokens",
            "prompt_tokens_details",
            # Names of the counts' lengths that are not theirs: read as no count.
            "prompt_tokenx",
            "completion_tokenx",
        ]
    ),
    st.one_of(_values, st.dictionaries(st.just("cached_tokens"), _values, max_size=1)),
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(
    _usages,
    st.binary(max_size=300),
    st.binary(max_size=40),
    st.integers(min_value=0, max_value=700),
    st.one_of(st.none(), st.binary(max_size=200), _usages.map(lambda u: chunk({"type": "message_start", "usage": u}))),
)
def test_reading_a_streams_last_two_reads_is_reading_their_tail(
    usage: dict[str, object], before: bytes, after: bytes, split: int, first: bytes | None
) -> None:
    """read_stream (the one call a stream's end makes) answers what stream_tokens answers over
    the last TAIL_WINDOW bytes of the two reads, wherever they are split."""
    stream = before + chunk({"choices": [], "usage": usage}) + after + b"data: [DONE]\n\n"
    before_last, last = stream[:split], stream[split:]
    tail = last if len(last) >= TAIL_WINDOW else before_last[-TAIL_WINDOW:] + last
    assert read_stream(before_last, last, first) == stream_tokens(tail, first)
    # The searches alone (the pure build's way, and the compiled build's after the byte-wise read).
    assert read_stream(before_last, last, first, bytewise=False) == stream_tokens(tail, first)


# As engines write them: whole counts, details null or absent, in any order.
_counts = st.integers(min_value=0, max_value=(1 << 53) + 2)
_engine_usages = st.fixed_dictionaries(
    {"prompt_tokens": _counts},
    optional={"completion_tokens": _counts, "total_tokens": _counts, "prompt_tokens_details": st.none()},
).flatmap(lambda usage: st.permutations(list(usage.items())).map(dict))


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(_usages, _engine_usages),
    st.binary(max_size=300),
    st.binary(max_size=40),
    st.integers(min_value=0, max_value=700),
    st.sampled_from([b"", b" ", b"0", b"00", b"-", b".5", b"e3", b"\\", b"{", b"}"]),
)
def test_the_byte_wise_read_answers_what_the_searches_do_or_leaves_it_to_them(
    usage: dict[str, object], before: bytes, after: bytes, split: int, twist: bytes
) -> None:
    """flat_usage (the compiled build's read of the usual end) gives stream_tokens' answer, or None to
    leave it to the searches; on both builds, called directly. The twist, put just after the
    first digit of the usage object, makes numbers and objects that orjson would read otherwise."""
    event = chunk({"choices": [], "usage": usage})
    digit = next((i for i in range(event.find(b'"usage"'), len(event)) if event[i : i + 1].isdigit()), None)
    for body in (event, event if digit is None else event[: digit + 1] + twist + event[digit + 1 :]):
        stream = before + body + after + b"data: [DONE]\n\n"
        before_last, last = stream[:split], stream[split:]
        tail = last if len(last) >= TAIL_WINDOW else before_last[-TAIL_WINDOW:] + last
        found = flat_usage(before_last, last)
        assert found is None or found == stream_tokens(tail, None), (stream, split)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(_usages, _engine_usages),
    st.binary(max_size=700),
    st.dictionaries(st.sampled_from(["prompt_logprobs", "kv_transfer_params", "x"]), _values, max_size=3),
    st.sampled_from([b"", b" ", b"0", b"00", b"-", b".5", b"e3", b"\\", b"{", b"}"]),
)
def test_the_byte_wise_read_of_a_whole_answer_answers_what_the_searches_do_or_leaves_it_to_them(
    usage: dict[str, object], choices: bytes, after: dict[str, object], twist: bytes
) -> None:
    """A whole answer (compiled, whole_answer_tokens reads it byte by byte first): its usage after
    choices of any length and before the fields engines write after it (vLLM's prompt_logprobs)."""
    answer = orjson.dumps({"id": "x", "choices": [choices.decode("latin-1")], "usage": usage, **after})
    digit = next((i for i in range(answer.find(b'"usage"'), len(answer)) if answer[i : i + 1].isdigit()), None)
    for body in (answer, answer if digit is None else answer[: digit + 1] + twist + answer[digit + 1 :]):
        searched = whole_answer_tokens(body, bytewise=False)
        found = flat_usage(b"", body)
        assert found is None or found == searched, body
        assert whole_answer_tokens(body) == searched, body


def test_the_byte_wise_read_reads_the_usual_end_wherever_the_reads_split_it() -> None:
    usage = {"prompt_tokens": 9, "total_tokens": 73, "completion_tokens": 64, "prompt_tokens_details": None}
    event = chunk({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage})
    done = b"data: [DONE]\n\n"
    # The event and [DONE] in one read, in two, or in one the event's end and [DONE] (the searches read that).
    reads = [(b"x" * 600, event + done), (b"x" * 600 + event, done), (event[:-12], event[-12:] + done)]
    for n, (before_last, last) in enumerate(reads):
        assert flat_usage(before_last, last) == ((9, 64, None) if n < 2 else None)
        assert read_stream(before_last, last, None) == (9, 64, None)
    # Escaped (a model writing about usage), past the window, or numbers JSON does not write: the searches decide.
    assert flat_usage(b"", b'data: {"text": "\\"usage\\":{\\"prompt_tokens\\":1}"}\n\n') is None
    assert flat_usage(b"", event + b" " * TAIL_WINDOW + done) is None
    for odd_usage in (
        b'{"prompt_tokens":01}',
        b'{"prompt_tokens":1234567890123456}',
        b'{"prompt_tokens":1,"completion_tokens":null}',
    ):
        assert flat_usage(b"", b'data: {"usage":' + odd_usage + b"}\n\n" + done) is None
    assert flat_usage(b"", b'data: {"usage":{"prompt_tokens":0,"completion_tokens":null2}}\n\n') is None
    assert flat_usage(b"", b'data: {"usage":{"prompt_tokens":0,"total_tokens":null}}\n\n') == (0, 0, None)


def test_tenants_past_the_bound_are_tallied_together_and_the_first_keep_their_own() -> None:
    tallies = Tallies()
    for i in range(MAX_TOKEN_TENANTS + 5):
        tallies.count_tokens("m", f"t{i}", 10, None, 1)
    tallies.count_unknown_usage("m", "late")
    tallies.count_tokens("m", "t0", 5, 2, 1)
    counts = tallies.token_counts()
    assert counts["m", "t0", "prompt"] == 15
    assert counts["m", "t0", "cached"] == 2
    assert counts["m", OTHER_TENANTS, "prompt"] == 50
    assert tallies.unknown_counts() == {("m", OTHER_TENANTS): 1}
    assert len({tenant for _, tenant, _ in counts}) == MAX_TOKEN_TENANTS + 1
