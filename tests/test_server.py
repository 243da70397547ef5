"""The client port's own HTTP/1.1 server (router/server.py), spoken to byte by byte.

What aiohttp's server used to do for us and clients rely on: pipelining in
order, HTTP/1.0 (no chunks: the stream ends with the connection), Expect:
100-continue, HEAD, a 400 that says why and closes, chunked request bodies.
"""

from __future__ import annotations

import asyncio

import orjson

from router.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.test_proxy import CHAT


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
