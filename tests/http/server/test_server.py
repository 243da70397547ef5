"""The client port's own HTTP/1.1 server (router/http/server/), spoken to byte by byte, with a stub handler.

What aiohttp's server used to do for us and clients rely on: pipelining in
order, HTTP/1.0 (no chunks: the stream ends with the connection), HEAD, a
400 that says why and closes, chunked request bodies; and the Writer's
framing rules, whatever a handler does. (Expect: 100-continue, and a
replica's 204 passed on, are tested through the router:
tests/gateway/test_client_port.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson

from router.http.messages import Reply, Request
from router.http.writer import Writer
from tests.support.clients import CHAT
from tests.support.http_harness import StartServer, Stub
from tests.support.waiting import until_cancelled
from tests.support.wire import Wire


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


async def test_pipelined_requests_are_answered_in_order(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    host, port = server.address
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


async def test_an_http_1_0_stream_is_not_chunked_and_ends_with_the_connection(start_server: StartServer) -> None:
    stub = Stub(tokens=3)
    server = await start_server(stub)
    host, port = server.address
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


async def test_a_chunked_request_body_is_forwarded_whole(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    host, port = server.address
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
    assert stub.inference[-1].body == body


async def test_head_of_the_model_list_has_no_body(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    host, port = server.address
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
    start_server: StartServer,
) -> None:
    stub = Stub()
    server = await start_server(stub)
    host, port = server.address
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
    assert stub.seen == []


# The Writer's framing rules, against the Server with handlers written to break them.


async def test_the_writer_keeps_the_framing_rules_whatever_the_handler_does(start_server: StartServer) -> None:
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

    address = (await start_server(handler)).address
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


async def test_the_writer_refuses_what_would_break_its_framing(start_server: StartServer) -> None:
    """A second head, a piece past the declared length, a sink or an end outside a stream, a
    piece after the end: each a RuntimeError to the handler, and the answer stays well framed."""
    errors: list[str] = []

    def refused(attempt: Callable[[], object]) -> None:
        try:
            attempt()
        except RuntimeError as exc:
            errors.append(str(exc))

    async def handler(request: Request, writer: Writer) -> None:
        kind = request.path.strip("/")
        assert not writer.started
        if kind == "head-twice":
            writer.start(200, b"OK", [])
            refused(lambda: writer.start(200, b"OK", []))
            writer.end()
        elif kind == "past-length":
            writer.start(200, b"OK", [], length=3)
            refused(lambda: writer.write(b"too long"))
            writer.write(b"abc")
            writer.end()
        elif kind == "outside":
            refused(writer.body_sink)
            refused(writer.end)
            writer.answer(Reply(200, b"ok", []))
        else:
            writer.start(200, b"OK", [])
            sink = writer.body_sink()
            sink(b"")  # (no last-chunk from an empty piece)
            sink(b"a")
            writer.end()
            refused(lambda: sink(b"b"))
        assert writer.started

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(
            b"".join(
                b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n" % k for k in (b"head-twice", b"past-length", b"outside", b"sink")
            )
        )
        answers = [await wire.answer() for _ in range(4)]
    assert [(a.status, a.body, a.complete) for a in answers] == [
        (200, b"", True),
        (200, b"abc", True),
        (200, b"ok", True),
        (200, b"a", True),
    ]
    assert len(errors) == 5


async def test_what_a_handler_writes_after_its_client_left_goes_nowhere(start_server: StartServer) -> None:
    """A handler answering in its cleanup, once its client is gone: nothing is written and nothing
    raised, whether a whole answer or a stream (whose writes say the client takes no more)."""
    said: list[bool] = []
    done = asyncio.Event()
    began = asyncio.Event()

    async def handler(request: Request, writer: Writer) -> None:
        began.set()
        try:
            await until_cancelled()
        except asyncio.CancelledError:
            if request.path == "/whole":
                writer.answer(Reply(200, b"late", []))
            else:
                writer.start(200, b"OK", [])
                said.append(writer.write(b"late"))
                said.append(writer.body_sink()(b"late"))
                writer.end()
            done.set()
            raise

    server = await start_server(handler)
    for path in (b"/whole", b"/stream"):
        began.clear()
        done.clear()
        async with await Wire.open(server.address) as wire:
            wire.send(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(began.wait(), 5)
        await asyncio.wait_for(done.wait(), 5)
    assert said == [True, True]


async def test_an_http_1_0_stream_of_known_length_keeps_a_keep_alive_connection(start_server: StartServer) -> None:
    async def handler(request: Request, writer: Writer) -> None:
        writer.start(200, b"OK", [], length=5)
        writer.write(b"hello")
        writer.end()

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        for _ in range(2):
            wire.send(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            answer = await wire.answer()
            assert answer.body == b"hello" and answer.framing == "length"
            assert answer.header(b"connection") == b"keep-alive"


async def test_a_handler_may_close_the_connection_after_its_answer(start_server: StartServer) -> None:
    async def handler(request: Request, writer: Writer) -> None:
        writer.close_after()
        writer.answer(Reply(200, b"bye", []))

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        answer = await wire.answer()
        assert answer.body == b"bye" and answer.header(b"connection") == b"close"
        assert await wire.closed() == b""
