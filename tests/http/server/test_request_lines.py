"""The client port's server alone (tests/support/http_harness.py) against odd request lines and codings.

What RFC 9110 and 9112 answer: a method, target or version it must refuse,
a higher minor version served as HTTP/1.1, whitespace and empty elements
around `chunked`, a length of thousands of leading zeros. The clients that
mean harm (desync, smuggling, hangs) are test_hostile_client.py's.
"""

from __future__ import annotations

import orjson
import pytest

from tests.support.http_harness import StartServer, Stub
from tests.support.wire import CHAT, Wire, post

GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"


# What RFC 9110 and 9112 answer to odd request lines and codings ------------------------------

_CHAT_BODY = orjson.dumps(CHAT)
_CHUNKED_CHAT = b"%x\r\n%b\r\n0\r\n\r\n" % (len(_CHAT_BODY), _CHAT_BODY)


def coded_post(codings: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: " + codings + b"\r\n\r\n" + _CHUNKED_CHAT
    )


REFUSED = {
    # RFC 9110 15.6.6: 505 is for a major version the server does not speak.
    # (nginx 1.22 also answers 505 to HTTP/2.0 and 3.0.)
    "HTTP/3.0": (b"GET /v1/models HTTP/3.0\r\nHost: router\r\n\r\n", 505),
    # RFC 9110 9.1: a method the server does not recognise or implement is 501.
    # nginx 1.22 passes any upper-case method on to its upstream, and answers
    # 400 to a lower-case one; the router serves none of them.
    "unknown method": (b"FOO /v1/models HTTP/1.1\r\nHost: router\r\n\r\n", 501),
    "method in lower case": (b"get /v1/models HTTP/1.1\r\nHost: router\r\n\r\n", 501),
    "a method llhttp knows, not HTTP's": (b"PROPFIND /v1/models HTTP/1.1\r\nHost: router\r\n\r\n", 501),
    "not a request line": (b"GARBAGE\r\n\r\n", 400),
    # RFC 9110 4.2.4: userinfo in an http(s) URI is to be treated as an error (nginx: 400).
    "userinfo in the target": (post(path=b"http://user:secret@router/v1/chat/completions"), 400),
    # RFC 9112 6.3: with Transfer-Encoding on a request whose final coding is not
    # chunked, the length cannot be known: 400, then close. (nginx 1.22 answers
    # 501 to every value but "chunked": it reads no list.)
    "identity": (coded_post(b"identity"), 400),
    "gzip alone": (coded_post(b"gzip"), 400),
    "chunked, then another coding": (coded_post(b"chunked, gzip"), 400),
    "an empty Transfer-Encoding": (coded_post(b""), 400),
    # RFC 9112 6.1: chunked MUST NOT be applied twice (read once or twice: a smuggling vector).
    "chunked twice": (coded_post(b"chunked, chunked"), 400),
    # RFC 9112 6.1: chunked is final, but a coding before it is one the router does not decode: 501.
    "gzip, chunked": (coded_post(b"gzip, chunked"), 501),
}


@pytest.mark.parametrize("ahead", [0, 1], ids=["first", "behind a request"])
@pytest.mark.parametrize("name", list(REFUSED))
async def test_what_rfc_9110_and_9112_answer_is_answered(start_server: StartServer, name: str, ahead: int) -> None:
    stub = Stub()
    server = await start_server(stub)
    data, status = REFUSED[name]
    async with await Wire.open(server.address) as wire:
        wire.send(GET_MODELS * ahead + data)
        for _ in range(ahead):
            assert (await wire.answer()).status == 200
        answer = await wire.answer()
        assert answer.status == status
        assert answer.json()["error"]["message"]  # type: ignore[index]
        assert answer.header(b"connection") == b"close"
        assert await wire.closed() == b""
    assert stub.inference == []


async def test_a_higher_minor_version_is_served_as_http_1_1(start_server: StartServer) -> None:
    """RFC 9110 2.5: HTTP/1.2 is read as the highest 1.x the router speaks (nginx 1.22 does the same)."""
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(post(version=b"1.2") + post(version=b"1.9"))
        for _ in range(2):
            answer = await wire.answer()
            assert answer.status == 200 and answer.head.startswith(b"HTTP/1.1 200")
            # Persistent, as HTTP/1.1 is.
            assert answer.header(b"connection") is None
    assert len(stub.inference) == 2


@pytest.mark.parametrize("codings", [b"chunked\t", b"chunked \t ", b"\tchunked\t", b"chunked,", b", chunked , "])
async def test_whitespace_and_empty_elements_around_chunked_are_chunked(
    start_server: StartServer, codings: bytes
) -> None:
    """RFC 9110 5.5 and 5.6.1: OWS around a field value and empty list elements are no part of it.

    llhttp takes a trailing HTAB or comma for another coding; nginx 1.22 answers 501 to both.
    The body is read as chunked all the same, and the request behind it where it begins.
    """
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(coded_post(codings) + GET_MODELS)
        assert (await wire.answer()).status == 200
        listing = await wire.answer()
        assert listing.status == 200 and listing.json()["object"] == "list"
    assert [seen.body for seen in stub.inference] == [_CHAT_BODY]


async def test_a_content_length_of_thousands_of_leading_zeros_is_read(start_server: StartServer) -> None:
    """RFC 9110 8.6: Content-Length is 1*DIGIT, leading zeros and all, more than int() reads at once."""
    stub = Stub()
    server = await start_server(stub)
    body = orjson.dumps(CHAT)
    async with await Wire.open(server.address) as wire:
        wire.send(post(body).replace(b"Content-Length: ", b"Content-Length: " + b"0" * 5000))
        assert (await wire.answer()).status == 200
    assert [seen.body for seen in stub.inference] == [body]
