"""The client port's own HTTP/1.1 server (router/http/server.py), spoken to byte by byte.

What aiohttp's server used to do for us and clients rely on: pipelining in
order, HTTP/1.0 (no chunks: the stream ends with the connection), Expect:
100-continue, HEAD, a 400 that says why and closes, chunked request bodies.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from router.http.messages import Reply
from router.http.server.head import unknown_method
from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.helpers import CHAT


def request(body: bytes, *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/"
        + version
        + b"\r\nHost: router\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a Content-Length: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def test_pipelined_requests_are_answered_in_order(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        # Three requests in one write; the second asks for 2 tokens, the others for 1 and 3.
        writer.write(b"".join(request(orjson.dumps({**CHAT, "max_tokens": n})) for n in (1, 2, 3)))
        for n in (1, 2, 3):
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert orjson.loads(body)["usage"]["completion_tokens"] == n
    finally:
        writer.close()


async def test_an_http_1_0_stream_is_not_chunked_and_ends_with_the_connection(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=3))
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request(orjson.dumps({**CHAT, "stream": True}), version=b"1.0"))
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the router closes
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body.startswith(b"data: {")
    assert body.endswith(b"data: [DONE]\n\n")


async def test_expect_100_continue_is_answered_before_the_body(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    body = orjson.dumps(CHAT)
    try:
        full = request(body, extra=b"Expect: 100-continue\r\n")
        writer.write(full[: -len(body)])  # the head only
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        head, answer = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert orjson.loads(answer)["object"] == "chat.completion"
    finally:
        writer.close()
    # The replica never sees the Expect header (the router answered it).
    assert "Expect" not in fake.seen[-1].headers


async def test_a_chunked_request_body_is_forwarded_whole(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    body = orjson.dumps(CHAT)
    half = len(body) // 2
    chunked = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
        )
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    assert fake.seen[-1].body == body


async def test_head_of_the_model_list_has_no_body(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: router\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        # The next bytes are the GET's answer, not a body of the HEAD.
        _, body = await read_answer(reader)
        assert orjson.loads(body)["data"][0]["id"] == "m"
    finally:
        writer.close()


async def test_an_unparsable_request_gets_an_openai_shaped_400_and_the_connection_closes(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello")
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert b"connection: close" in head.lower()
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert "Content-Length" in error["message"]
    assert fake.seen == []


async def test_a_204_from_the_replica_passes_without_a_body_or_length(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(fail_status=204, fail_body=b""))
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        # Asked as a stream, still no chunks: a 204 has no body at all.
        writer.write(request(orjson.dumps({**CHAT, "stream": True})) + request(orjson.dumps(CHAT)))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 204")
        assert b"content-length" not in head.lower()
        assert b"transfer-encoding" not in head.lower()
        # The next bytes are the second answer's head: nothing was sent between.
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert second.startswith(b"HTTP/1.1 204")
    finally:
        writer.close()


# The Writer's framing rules, against a real Server with handlers written to break them.


async def _serve_with(handler: Any) -> tuple[asyncio.Server, tuple[str, int]]:
    from router.gateway.answers import server_error
    from router.http.server import Server

    server = Server(handler, max_body_bytes=1 << 20, header_timeout=5.0, error=server_error, log_exception=print)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    host, port = listener.sockets[0].getsockname()[:2]
    return listener, (host, port)


async def test_the_writer_keeps_the_framing_rules_whatever_the_handler_does() -> None:
    from router.http.messages import Request
    from router.http.writer import Writer

    errors: list[str] = []

    async def handler(request: Request, writer: Writer) -> None:
        kind = request.path.strip("/")
        if kind == "no-content":
            writer.start(204, b"No Content", [])
            writer.write(b"a body a 204 must not have")
            writer.end()
        elif kind == "short":
            writer.start(200, b"OK", [], length=10)
            writer.write(b"12345")
            writer.end()  # 5 bytes short: aborted, never passed off as whole
        elif kind == "after-end":
            writer.start(200, b"OK", [])
            writer.write(b"x")
            writer.end()
            try:
                writer.write(b"more")
            except RuntimeError as exc:
                errors.append(str(exc))
        elif kind == "twice":
            writer.answer(Reply(200, b"one", []))
            try:
                writer.answer(Reply(200, b"two", []))
            except RuntimeError as exc:
                errors.append(str(exc))
        else:
            writer.start(200, b"OK", [])
            writer.write(b"streamed body")
            writer.end()

    listener, address = await _serve_with(handler)
    try:
        reader, writer = await asyncio.open_connection(*address)
        # HEAD on a stream, a 204 with a body: neither body reaches the client.
        writer.write(
            b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /no-content HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /after-end HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /twice HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 204")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
        assert await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5) == b"1\r\nx\r\n0\r\n\r\n"
        _, body = await read_answer(reader)
        assert body == b"one"
        writer.close()
        assert len(errors) == 2
        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"GET /short HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: aborted
        assert answer.endswith(b"\r\n\r\n12345") and b"content-length: 10" in answer.lower()
        writer.close()
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("data", "unknown"),
    [
        (b"FOO /v1/models HTTP/1.1\r\nHost: r\r\n\r\n", True),
        # The line still arriving: a method token and its space are enough.
        (b"FOO /v1/mo", True),
        (b"FO", False),
        (b"GARBAGE\r\n\r\n", False),
        (b"NOT HTTP AT ALL\r\n\r\n", False),
        (b"\r\nget /v1/models HTTP/1.1\r\n", True),
        # Behind a whole request: the refused one begins where that one ends ...
        (b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\nFOO / HTTP/1.1\r\n\r\n", True),
        # ... not at a request line inside that one's body.
        (b"POST / HTTP/1.1\r\nHost: r\r\nContent-Length: 16\r\n\r\nFOO / HTTP/1.1\r\n{ / HTTP/1.1\r\n", False),
    ],
)
def test_a_refused_method_is_told_apart_from_bytes_that_are_no_request(data: bytes, unknown: bool) -> None:
    """llhttp refuses both; a method token in a request line is 501, anything else 400."""
    assert unknown_method(data) is unknown
