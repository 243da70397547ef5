"""The RESP2 parser of the limits' Redis client: every prefix of a reply is incomplete, garbage is a protocol error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.gateway.redis import MAX_BULK, RedisError, RedisUnavailable, encode, parse

REPLIES = [
    (b"+OK\r\n", b"OK"),
    (b"-NOSCRIPT No matching script. Please use EVAL.\r\n", "NOSCRIPT"),
    (b":-12\r\n", -12),
    (b"$5\r\nhello\r\n", b"hello"),
    (b"$-1\r\n", None),
    (b"*5\r\n:0\r\n:0\r\n:0\r\n:3000\r\n:59000\r\n", [0, 0, 0, 3000, 59000]),
    (b"*2\r\n*1\r\n$0\r\n\r\n:1\r\n", [[b""], 1]),
]


@pytest.mark.parametrize(("data", "value"), REPLIES)
def test_a_whole_reply_and_each_of_its_prefixes(data: bytes, value: object) -> None:
    parsed, end = parse(data + b"+next\r\n")
    assert end == len(data)
    assert (parsed.code if isinstance(parsed, RedisError) else parsed) == value
    for cut in range(len(data)):
        assert parse(data[:cut]) == (None, -1)


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\n",
        b":12a\r\n",
        b"$%d\r\n" % (MAX_BULK + 1),
        b"$3\r\nabcXY",
        b"*99999\r\n",
        b"*1\r\n" * 10 + b":1\r\n",
        b"+" + b"x" * 70_000,
    ],
)
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(RedisUnavailable) as caught:
        parse(data)
    assert caught.value.reason == "protocol"


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_say_why(data: bytes) -> None:
    reason = ""
    end = -1
    try:
        _, end = parse(data)
    except RedisUnavailable as exc:
        reason = exc.reason
    assert reason in ("", "protocol")
    assert end == -1 or 0 < end <= len(data)


def test_a_command_is_an_array_of_bulk_strings() -> None:
    assert encode([b"EVALSHA", b"ab", b"1"]) == b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n"
