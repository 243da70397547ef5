"""The upstream client (router/http/client/) against hand-written HTTP servers.

Each server is a real socket on 127.0.0.1 that answers with exact bytes, so
the framing cases that aiohttp's client used to cover for us are pinned here:
lengths, chunks, bodies ended by close, interim answers, keep-alive reuse
(its race: tests/http/client/test_upstream_client.py), idle expiry,
back-pressure, garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from router.http.client import BodyTooLarge, Client, ConnectFailed, ConnectionBroken, HeadTimeout, Response
from router.http.origin import Origin
from tests.support.clock import FakeClock
from tests.support.raw_server import HEAD, OK, StartRaw, fixed
from tests.support.waiting import wait_for
from tests.support.wire import ending_quietly


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
    got: list[bytes] = []
    # Each piece goes out once the one before has been passed on: two reads, never one.
    passed_on = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%b\r\n" % (len(part), part))
            await writer.drain()
            if n == 1:
                await passed_on.wait()
                passed_on.clear()
        writer.write(b"0\r\n\r\n")

    raw = await raw_server(answer)
    resp = await client.request(raw.origin, HEAD, b"{}")

    def sink(chunk: bytes) -> bool:
        got.append(chunk)
        passed_on.set()
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
    await wait_for(lambda: client.open_connections == 0)
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
    clock = FakeClock()
    client = Client(connect_timeout=2.0, keepalive_seconds=0.2, clock=clock)
    try:
        resp = await client.request(raw.origin, HEAD, b"{}")
        await resp.read()
        resp.release()
        assert client.open_connections == 1
        clock.advance(0.3)
        await wait_for(lambda: raw.eofs == 1)
        # The client closed it (the server saw EOF), not the server.
        assert client.open_connections == 0
        assert raw.eofs == 1
    finally:
        await client.close()


async def test_unread_answer_closes_the_connection(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"))
    resp = await client.request(raw.origin, HEAD, b"{}")
    resp.release()
    assert client.open_connections == 0


async def test_a_full_sink_stops_reading_from_the_replica(raw_server: StartRaw, client: Client) -> None:
    sent = asyncio.Event()
    total = 8 * 1024 * 1024
    replica: list[asyncio.WriteTransport] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        replica.append(writer.transport)
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

    def held_back() -> bool:
        """The client reads no more, and the replica's writes pile up past its buffer's high water."""
        (transport,) = replica
        return all(c.paused for c in client._all) and transport.get_write_buffer_size() > 65536

    await wait_for(held_back)
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
            await asyncio.Event().wait()  # never answers
        writer.write(OK)
        await writer.drain()
        answered.set()

    raw = await raw_server(answer)
    began = time.monotonic()
    late = asyncio.create_task(client.request(raw.origin, HEAD, b"{}", head_timeout=0.3))
    # (Real time, as the head deadline is measured by it below: the request that is never answered is the first.)
    await wait_for(lambda: len(raw.requests) == 1)
    resp = await client.request(raw.origin, HEAD, b"{}", head_timeout=0.3)
    assert await resp.read() == b"hello"
    resp.release()
    with pytest.raises(HeadTimeout, match=r"no response head within 0\.3 s"):
        await late
    assert time.monotonic() - began >= 0.3
    # The late connection is gone; the answered one is kept for the next request.
    assert client.open_connections == 1
    assert answered.is_set()


@pytest.mark.parametrize("zeros", [0, 3, 18, 19, 5000], ids=lambda n: f"{n}-zeros")
async def test_a_content_length_of_leading_zeros_is_the_answers_length(
    raw_server: StartRaw, client: Client, zeros: int
) -> None:
    """Read as it is when short, stripped first when padded past what int() reads at once."""
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: " + b"0" * zeros + b"5\r\n\r\nhello"))
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert resp.content_length == 5
    assert await resp.read() == b"hello"
    resp.release()


Handle = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def listening(handle: Handle, tls: ssl.SSLContext | None = None) -> AsyncIterator[Origin]:
    """A replica written for its test; each handler runs until its client's connection ends."""
    tasks: set[asyncio.Task[None]] = set()

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            with contextlib.suppress(ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
                await handle(reader, writer)
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(ending_quietly(run), "127.0.0.1", 0, ssl=tls)
    try:
        yield Origin.parse(f"{'https' if tls else 'http'}://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    finally:
        server.close()
        # Each ends when its client's connection does (a cancelled one is logged by asyncio).
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await server.wait_closed()


async def test_releasing_an_answer_twice_does_not_touch_the_connections_next_request(
    raw_server: StartRaw, client: Client
) -> None:
    raw = await raw_server(fixed(OK))
    first = await client.request(raw.origin, HEAD, b"{}")
    assert await first.read() == b"hello"
    first.release()
    second = await client.request(raw.origin, HEAD, b"{}")
    first.release()  # again, late: the connection now serves the second request
    assert await second.read() == b"hello"
    second.release()
    assert raw.connections == 1 and client.open_connections == 1


async def test_a_field_as_long_as_content_length_is_not_taken_for_it(raw_server: StartRaw, client: Client) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nAccept-Charset: 99\r\nContent-Length: 5\r\n\r\nhello"))
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert resp.content_length == 5
    assert await resp.read() == b"hello"
    resp.release()


async def test_an_answer_over_the_limit_that_came_whole_in_one_read_is_refused_too(
    raw_server: StartRaw, client: Client
) -> None:
    body = b"x" * 2000
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + body))
    resp = await client.request(raw.origin, HEAD, b"{}")
    await wait_for(lambda: resp._done)  # the whole answer is read before the caller asks for it
    with pytest.raises(BodyTooLarge):
        await resp.read(1000)
    resp.release()


async def test_a_replica_that_hangs_up_on_a_request_still_being_sent_leaves_it_unsent(client: Client) -> None:
    """The replica reads the head, then closes its side before taking the body: the request never
    went out whole, so it is reported unsent (the one break a request may be sent again for)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write_eof()
        await reader.read()  # until the client gives up

    async with listening(handle) as origin:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 33554432\r\n\r\n"
        with pytest.raises(ConnectionBroken) as broken:
            await client.request(origin, head, b"x" * 33554432, head_timeout=5.0)
    assert broken.value.unsent and not broken.value.answered and broken.value.before_head


async def test_no_connection_within_the_connect_timeout_is_a_connect_failure() -> None:
    """A replica whose listen queue is full takes no new connection: nothing was sent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    waiting: list[socket.socket] = []
    client = Client(connect_timeout=0.3, keepalive_seconds=5.0)
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(address)
            waiting.append(filler)
        with pytest.raises(ConnectFailed, match=r"no connection within 0\.3 s"):
            await client.request(Origin.parse(f"http://127.0.0.1:{address[1]}"), HEAD, b"{}")
    finally:
        await client.close()
        for filler in waiting:
            filler.close()
        listener.close()


async def test_a_replica_over_https_must_show_a_certificate_an_authority_signed(tmp_path: Path, client: Client) -> None:
    """TLS to a replica is verified against the system's authorities: a self-signed certificate is
    refused before anything is sent."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
            *("-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))

    async with listening(handle, tls=context) as origin:
        for _ in range(2):  # (the second under the same TLS settings as the first)
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await client.request(origin, HEAD, b"{}")
    assert requests == []


@pytest.mark.parametrize("answer", [OK, b"NOT AN ANSWER\r\n\r\n"], ids=["an answer", "garbage"])
async def test_what_arrives_as_its_caller_gives_up_is_dropped_with_the_connection(
    answer: bytes, caplog: pytest.LogCaptureFixture, client: Client
) -> None:
    """The caller gives up (its task cancelled) in the very turn of the loop the replica's bytes are
    read in: they go to no one, nothing raises in the connection's callbacks, and the connection
    is never reused."""
    written = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(answer)  # in the kernel at once: read in the loop's next turn ...
        written.set()  # ... which begins with the test's task, woken now
        await reader.read()  # until the client drops the connection

    caplog.set_level(logging.ERROR, logger="asyncio")
    async with listening(handle) as origin:
        asking = asyncio.create_task(client.request(origin, HEAD, b"{}", head_timeout=5.0))
        await written.wait()
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        await wait_for(lambda: client.open_connections == 0)
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_a_connection_lost_as_its_caller_gives_up_tells_no_one(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica hangs up, and the caller gives up (its task cancelled) after the hang-up is read
    but before the connection is told it is lost: nothing raises in the connection's callbacks."""
    # A loopback TCP pair for the bell, as the replica's connection is: the kernel delivers
    # the hang-up and the bell in the order they were sent.
    listener = socket.create_server(("127.0.0.1", 0))
    bell = socket.create_connection(listener.getsockname())
    ring, _ = listener.accept()
    listener.close()
    loop = asyncio.get_running_loop()
    asking: asyncio.Task[Response] | None = None

    def give_up() -> None:
        loop.remove_reader(ring)
        ring.recv(1)
        assert asking is not None
        asking.cancel()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        # The hang-up, then the bell: epoll tells them in that order, in one turn of the loop.
        # (write_eof: uvloop's transports hand out no socket that can be shut down.)
        writer.write_eof()
        bell.send(b"!")
        await reader.read()

    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        async with listening(handle) as origin:
            loop.add_reader(ring, give_up)
            asking = asyncio.create_task(client.request(origin, HEAD, b"{}", head_timeout=5.0))
            with pytest.raises((asyncio.CancelledError, ConnectionBroken)):
                await asking
            await wait_for(lambda: client.open_connections == 0)
    finally:
        loop.remove_reader(ring)
        ring.close()
        bell.close()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_a_head_deadline_passing_as_its_caller_gives_up_tells_no_one(caplog: pytest.LogCaptureFixture) -> None:
    """The caller gives up in the very turn of the loop the client's sweep finds its head late:
    no one is told of the deadline, nothing raises, and the connection is dropped."""
    # On fake time: the give-up and the sweep are made in one turn, in that order, by the test
    # itself, not by a bell timed against a real timer (which a loaded machine let the sweep win).
    clock = FakeClock()
    client = Client(connect_timeout=2.0, keepalive_seconds=5.0, clock=clock)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers

    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        async with listening(handle) as origin:
            asking = asyncio.create_task(client.request(origin, HEAD, b"{}", head_timeout=0.2))
            await wait_for(lambda: client.open_connections == 1 and client.watching is not None)
            (connection,) = client._all
            asking.cancel()
            # The sweep that finds the head late, in the same turn as the give-up.
            clock.advance(connection.exchange.head_due - clock.now() + 1.0)
            with pytest.raises(asyncio.CancelledError):
                await asking
            await wait_for(lambda: client.open_connections == 0)
    finally:
        await client.close()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
