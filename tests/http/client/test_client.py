"""The upstream client (router/http/client/) against hand-written HTTP servers.

Each server is a real socket on 127.0.0.1 that answers with exact bytes, so
the framing cases that aiohttp's client used to cover for us are pinned here:
lengths, chunks, bodies ended by close, interim answers, keep-alive reuse
(its race: tests/http/client/test_upstream_client.py), idle expiry,
back-pressure, garbage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from router.core.origin import Origin
from router.http.client import Client, ConnectFailed, ConnectionBroken, HeadTimeout
from tests.helpers import HEAD, OK, StartRaw, fixed


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    c = Client(connect_timeout=2.0, keepalive_seconds=5.0)
    yield c
    await c.close()


async def test_content_length_answer_and_reuse_of_the_connection(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(OK))
    for _ in range(3):
        resp = await client.request(raw.origin, HEAD, b"{}")
        assert (resp.status, resp.reason) == (200, "OK")
        assert resp.header(b"x-kept") == b"yes"
        assert await resp.read() == b"hello"
        resp.release()
    assert raw.connections == 1
    # What was sent is exactly what the caller framed, query string included.
    assert raw.requests[0] == HEAD + b"{}"


async def test_chunked_answer_in_pieces_passes_each_chunk_on(raw_server: StartRaw, client: Client) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%b\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")

    raw = await raw_server(answer)
    resp = await client.request(raw.origin, HEAD, b"{}")
    got: list[bytes] = []

    def sink(chunk: bytes) -> bool:
        got.append(chunk)
        return False  # never full

    async def drain() -> None:
        raise AssertionError("a sink that is never full is never drained")

    await resp.pipe(sink, drain)
    resp.release()
    assert b"".join(got) == b"data: 1\n\ndata: 2\n\n"
    assert len(got) >= 2
    # A complete chunked answer leaves the connection reusable.
    resp = await client.request(raw.origin, HEAD, b"{}")
    await resp.read()
    resp.release()
    assert raw.connections == 1


async def test_body_ended_by_close_is_complete_and_not_reused(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end", close=True))
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert resp.content_length is None
    assert await resp.read() == b"until the end"
    resp.release()
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert await resp.read() == b"until the end"
    resp.release()
    assert raw.connections == 2


async def test_interim_answers_are_skipped(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + OK))
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert resp.status == 200
    assert resp.header(b"link") is None
    assert await resp.read() == b"hello"
    resp.release()


async def test_length_cut_short_is_broken_after_the_head(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nonly this", close=True))
    resp = await client.request(raw.origin, HEAD, b"{}")
    with pytest.raises(ConnectionBroken) as info:
        await resp.read()
    assert not info.value.before_head
    assert info.value.answered
    resp.release()


async def test_garbage_is_broken_before_the_head(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"SSH-2.0-OpenSSH\r\n\r\n"))
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    # Garbage is an answer of sorts: the replica had the request.
    assert info.value.answered
    assert client.open_connections == 0


async def test_refused_connection_is_connect_failed(client: Client) -> None:
    holder = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = holder.sockets[0].getsockname()[1]
    holder.close()
    await holder.wait_closed()
    with pytest.raises(ConnectFailed):
        await client.request(Origin.parse(f"http://127.0.0.1:{port}"), HEAD, b"{}")


async def test_idle_connection_closed_by_the_replica_is_dropped(raw_server: StartRaw, client: Client) -> None:
    # The replica answers, then closes the kept-alive connection while idle.
    raw = await raw_server(fixed(OK, close=True))
    resp = await client.request(raw.origin, HEAD, b"{}")
    await resp.read()
    resp.release()
    await asyncio.sleep(0.1)
    assert client.open_connections == 0
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert await resp.read() == b"hello"
    resp.release()
    assert raw.connections == 2


async def test_fresh_connection_broken_before_the_head_is_not_retried(raw_server: StartRaw, client: Client) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.transport.abort()

    raw = await raw_server(answer)
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    assert not info.value.answered
    # Written whole, then met by a close: the replica may have acted on it.
    assert not info.value.unsent
    assert len(raw.requests) == 1


async def test_idle_connections_expire_before_the_replicas_timeout(raw_server: StartRaw) -> None:
    raw = await raw_server(fixed(OK))
    client = Client(connect_timeout=2.0, keepalive_seconds=0.2)
    try:
        resp = await client.request(raw.origin, HEAD, b"{}")
        await resp.read()
        resp.release()
        assert client.open_connections == 1
        await asyncio.sleep(0.6)
        # The client closed it (the server saw EOF), not the server.
        assert client.open_connections == 0
        assert raw.eofs == 1
    finally:
        await client.close()


async def test_unread_answer_closes_the_connection(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"))
    resp = await client.request(raw.origin, HEAD, b"{}")
    resp.release()
    await asyncio.sleep(0.05)
    assert client.open_connections == 0


async def test_a_full_sink_stops_reading_from_the_replica(raw_server: StartRaw, client: Client) -> None:
    sent = asyncio.Event()
    total = 8 * 1024 * 1024

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        sent.set()

    raw = await raw_server(answer)
    resp = await client.request(raw.origin, HEAD, b"{}")
    received = 0
    release = asyncio.Event()

    def sink(chunk: bytes) -> bool:
        nonlocal received
        received += len(chunk)
        return True  # always full: one drain per chunk

    async def drain() -> None:
        await release.wait()

    piping = asyncio.ensure_future(resp.pipe(sink, drain))
    await asyncio.sleep(0.3)
    # The replica is held back: its drain() waits, it has not sent it all.
    assert not sent.is_set()
    assert received < total
    release.set()
    await asyncio.wait_for(piping, 10)
    assert received == total
    resp.release()


async def test_origin_of_a_base_url() -> None:
    origin = Origin.parse("https://gpu-1.example:8443/prefix/")
    assert (origin.host, origin.port, origin.tls, origin.prefix) == ("gpu-1.example", 8443, True, b"/prefix")
    assert origin.host_header == b"gpu-1.example:8443"
    assert Origin.parse("http://[::1]:80").host_header == b"[::1]"


async def test_a_head_past_its_deadline_fails_its_request_and_drops_its_connection(
    raw_server: StartRaw, client: Client
) -> None:
    """The client's one sweep fails a request whose head is late, never before its deadline;
    a request on another connection, answered meanwhile, is not touched."""
    answered = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await asyncio.sleep(30)  # never answers in the test's time
        writer.write(OK)
        await writer.drain()
        answered.set()

    raw = await raw_server(answer)
    began = time.monotonic()
    late = asyncio.create_task(client.request(raw.origin, HEAD, b"{}", head_timeout=0.3))
    await asyncio.sleep(0.05)
    resp = await client.request(raw.origin, HEAD, b"{}", head_timeout=0.3)
    assert await resp.read() == b"hello"
    resp.release()
    with pytest.raises(HeadTimeout, match=r"no response head within 0\.3 s"):
        await late
    assert time.monotonic() - began >= 0.3
    # The late connection is gone; the answered one is kept for the next request.
    assert client.open_connections == 1
    assert answered.is_set()


async def test_a_content_length_of_thousands_of_leading_zeros_is_the_answers_length(
    raw_server: StartRaw, client: Client
) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: " + b"0" * 5000 + b"5\r\n\r\nhello"))
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert resp.content_length == 5
    assert await resp.read() == b"hello"
    resp.release()
