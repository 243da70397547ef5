"""Request smuggling vectors and slow heads on the client port's server: refused or closed, nothing handled."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.http_harness import StartServer, Stub

BODY = b'{"model": "m", "messages": []}'
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"

VECTORS = {
    "two different content-lengths": HEAD + b"Content-Length: 30\r\nContent-Length: 5\r\n\r\n" + BODY,
    "content-length and transfer-encoding": HEAD
    + b"Content-Length: 30\r\nTransfer-Encoding: chunked\r\n\r\n1e\r\n"
    + BODY
    + b"\r\n0\r\n\r\n",
    "chunked, identity": HEAD + b"Transfer-Encoding: chunked, identity\r\n\r\n" + BODY,
    "bare LF line ends": HEAD.replace(b"\r\n", b"\n") + b"Content-Length: 30\n\n" + BODY,
    "obs-fold": HEAD + b"Content-Length: 30\r\nX-Folded: a\r\n b\r\n\r\n" + BODY,
    "NUL in a header": HEAD + b"Content-Length: 30\r\nX-Nul: a\x00b\r\n\r\n" + BODY,
    "negative content-length": HEAD + b"Content-Length: -1\r\n\r\n" + BODY,
    "oversize header": HEAD + b"X-Big: " + b"a" * 20_000 + b"\r\nContent-Length: 30\r\n\r\n" + BODY,
    "too many headers": HEAD + b"".join(b"X-H%d: 1\r\n" % i for i in range(200)) + b"Content-Length: 30\r\n\r\n" + BODY,
}


async def send_raw(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(65536), 5)
        # The connection must be closed after the answer: nothing left to smuggle.
        rest = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    return answer + rest


@pytest.mark.parametrize("name", list(VECTORS))
async def test_smuggling_vectors_are_refused_and_never_forwarded(start_server: StartServer, name: str) -> None:
    stub = Stub()
    server = await start_server(stub)
    host, port = server.address
    answer = await send_raw(host, port, VECTORS[name])
    # A head too large is 431 (RFC 6585); every other vector is malformed framing.
    expected = b"431" if name in ("oversize header", "too many headers") else b"400"
    assert answer.split(b" ", 2)[1] == expected, answer[:200]
    assert stub.seen == []


async def test_a_slowloris_client_is_closed_and_others_keep_their_latency(start_server: StartServer) -> None:
    import time

    import orjson

    from tests.support.clients import CHAT, post

    stub = Stub()
    server = await start_server(stub, header_timeout=1.0)
    host, port = server.address
    reader, writer = await asyncio.open_connection(host, port)
    began = time.monotonic()
    closed_after = None
    latencies = []
    try:
        for byte in HEAD:
            writer.write(bytes([byte]))
            await writer.drain()
            step = time.monotonic()
            status, _, _ = await post(f"http://{host}:{port}/v1/chat/completions", orjson.dumps(CHAT))
            assert status == 200
            latencies.append(time.monotonic() - step)
            try:
                if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                    closed_after = time.monotonic() - began
                    break
            except TimeoutError:
                continue
    except ConnectionError:
        closed_after = time.monotonic() - began
    finally:
        writer.close()
    assert closed_after is not None, "the slow client was never closed"
    assert 1.0 <= closed_after < 3.0
    assert max(latencies) < 0.5
    assert stub.seen and all(seen.path == "/v1/chat/completions" for seen in stub.seen)
    assert len(stub.seen) == len(latencies)


async def test_a_slow_head_after_a_first_request_is_closed_too(start_server: StartServer) -> None:
    import time

    import orjson

    from tests.support.clients import CHAT

    stub = Stub()
    server = await start_server(stub, header_timeout=1.0)
    host, port = server.address
    reader, writer = await asyncio.open_connection(host, port)
    body = orjson.dumps(CHAT)
    try:
        # One whole request on the connection, answered; it stays open.
        writer.write(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        # Then a second head, a byte every 0.1 s: closed at the deadline.
        began = time.monotonic()
        closed_after = None
        for byte in HEAD:
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                    closed_after = time.monotonic() - began
                    break
            except TimeoutError:
                continue
            except ConnectionError:
                closed_after = time.monotonic() - began
                break
    finally:
        writer.close()
    assert closed_after is not None, "the slow second head was never cut off"
    assert 0.9 <= closed_after < 3.0
    assert len(stub.seen) == 1
