"""The upstream client (router/http/client/) against replicas that misbehave.

Each replica is a real socket on 127.0.0.1 (tests/support/raw_server.py's
RawServer) that sends exact bytes at exact moments: answers nobody asked
for, two answers for one request, answers cut short, trailers, silence in
the middle of a body, heads without end, a protocol switch. Whatever a
replica does, it costs its own connection, never another request's answer,
never a request sent twice once the replica may have acted on it, and it is
counted by reason in `Client.protocol_errors`.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from router.http.client import (
    ConnectFailed,
    ConnectionBroken,
    UpstreamIdle,
)
from router.http.origin import Origin
from tests.support.clock import FakeClock
from tests.support.raw_server import HEAD, OK, RawServer, StartRaw, fixed
from tests.support.upstream import MakeClient, Recorder, never_drained, ok_once, ok_once_at
from tests.support.waiting import wait_for
from tests.support.wire import ending_quietly


async def until_hung_up(reader: asyncio.StreamReader) -> None:
    """The replica's silence: nothing more until the client closes the connection."""
    try:
        await reader.read(1)
    except ConnectionError:
        pass


# 1. Bytes on an idle pooled connection -------------------------------------------------


async def test_an_unsolicited_answer_on_an_idle_connection_poisons_it(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    # After its answer the replica sends the start of another, which nobody
    # asked for: parsed, it would become (part of) the next request's answer.
    pooled = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(OK)
        await writer.drain()
        if n == 1:
            await pooled.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nST")
            await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    await ok_once(client, raw)
    pooled.set()
    await wait_for(lambda: client.open_connections == 0)
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"unsolicited_bytes": 1}
    await ok_once(client, raw)
    assert raw.connections == 2


async def test_a_replica_that_speaks_before_the_request_is_connect_failed(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        await until_hung_up(reader)
        writer.close()

    server = await asyncio.start_server(ending_quietly(banner), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    connect = loop.create_connection

    async def slow_connect(*args: Any, **kwargs: Any) -> Any:
        # Let the banner arrive before the request goes out, every time.
        result = await connect(*args, **kwargs)
        transport, _ = result
        # (Read, counted and closed: the connection is aborted the moment the banner is read.)
        await wait_for(transport.is_closing)
        return result

    monkeypatch.setattr(loop, "create_connection", slow_connect)
    client = make_client()
    try:
        raw = RawServer(fixed(OK))
        raw.server = server
        with pytest.raises(ConnectFailed):
            await asyncio.wait_for(client.request(raw.origin, HEAD, b"{}"), 5)
        assert client.open_connections == 0
        assert client.protocol_errors.counts == {"unsolicited_bytes": 1}
    finally:
        server.close()
        await server.wait_closed()


# 2. Bytes after the end of the answer --------------------------------------------------


async def test_a_second_answer_in_the_same_read_closes_the_connection(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    raw = await raw_server(fixed(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nworld"))
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    # The first answer is delivered whole; the second is nobody's.
    assert await resp.read() == b"hello"
    resp.release()
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"bytes_after_answer": 1}
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert await resp.read() == b"hello"
    resp.release()
    assert raw.connections == 2


async def test_bytes_after_the_answer_before_its_release_close_the_connection(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    read = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(OK)
        await writer.drain()
        await read.wait()
        writer.write(b"HTTP/1.1 200 OK\r\n")
        await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert await resp.read() == b"hello"
    read.set()
    await wait_for(lambda: client.protocol_errors.counts)
    resp.release()
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"bytes_after_answer": 1}


# 3. No retry once any of an answer arrived ----------------------------------------------


@pytest.mark.parametrize(
    "partial", [b"HTTP/1.1 20", b"HTTP/1.1 200 OK\r\nContent-Le"], ids=["half-a-status-line", "head-cut-short"]
)
async def test_a_reused_connection_broken_mid_head_is_not_retried(
    raw_server: StartRaw, make_client: MakeClient, partial: bytes
) -> None:
    # Unlike the keep-alive race (nothing came back), the replica has begun
    # to answer this request: sending it again could run it twice.
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(partial if n == 2 else OK)
        await writer.drain()
        if n == 2:
            writer.close()

    raw = await raw_server(answer)
    client = make_client()
    await ok_once(client, raw)
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    assert info.value.answered
    assert len(raw.requests) == 2
    assert raw.connections == 1


# 3b. The keep-alive race, and only it, is sent again -----------------------------------


async def test_a_request_read_whole_on_a_reused_connection_then_dropped_is_not_sent_again(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    """A replica that reads the whole request and closes without a byte (an engine that died on it): sent once."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            writer.write(OK)
            await writer.drain()
        else:
            writer.close()

    raw = await raw_server(answer)
    client = make_client()
    await ok_once(client, raw)
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    assert not info.value.answered
    assert not info.value.unsent
    assert len(raw.requests) == 2
    assert raw.connections == 1


class ThreadReplica:
    """A replica on a blocking socket, in a thread of its own: two connections, one request on each,
    each answered OK; `after_first` runs on the first connection once it is answered, before the
    replica closes it. The thread can block where the event loop cannot: waiting for a close to
    reach the client's kernel, or for a request to arrive that it then never reads."""

    def __init__(self, after_first: Callable[[socket.socket], object]) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(5)
        self.origin = Origin.parse(f"http://127.0.0.1:{self._listener.getsockname()[1]}")
        self.received: list[bytes] = []
        # Set as each connection is closed.
        self.closed = threading.Event()
        self._after_first = after_first
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        with self._listener:
            for n in range(2):
                conn, _ = self._listener.accept()
                with conn:
                    conn.settimeout(5)
                    data = b""
                    for _ in range(100):
                        if data.endswith(b"{}"):
                            break
                        data += conn.recv(65536)
                    self.received.append(data)
                    conn.sendall(OK)
                    if n == 0:
                        self._after_first(conn)
                self.closed.set()

    async def join(self) -> None:
        await asyncio.to_thread(self._thread.join, 5)


async def test_an_idle_connection_the_replica_already_closed_is_not_used(make_client: MakeClient) -> None:
    """The replica's close waits in the kernel, not yet seen by the event loop, when the connection is picked."""
    go = threading.Event()
    replica = ThreadReplica(lambda conn: go.wait(5))
    client = make_client()
    try:
        resp = await client.request(replica.origin, HEAD, b"{}")
        assert await resp.read() == b"hello"
        resp.release()
        go.set()
        # Blocks the event loop on purpose: the close arrives while nothing reads it.
        assert replica.closed.wait(5)
        resp = await asyncio.wait_for(client.request(replica.origin, HEAD, b"{}"), 5)
        assert await resp.read() == b"hello"
        resp.release()
    finally:
        go.set()
        await replica.join()
    # One request per connection: none was written into the closed one.
    assert replica.received == [HEAD + b"{}", HEAD + b"{}"]


async def test_a_reused_connection_reset_with_the_request_unread_is_sent_again_once(make_client: MakeClient) -> None:
    """The keep-alive race as it most often ends: the replica's idle timer fires with the request
    already in its kernel, unread, and its close resets the connection (RFC 1122 4.2.2.13).
    The replica never read it: sent once more, on a fresh connection."""
    unread = threading.Event()

    def close_unread(conn: socket.socket) -> None:
        # The next request arrives; the replica closes without reading it.
        readable, _, _ = select.select([conn], [], [], 5)
        if readable:
            unread.set()

    replica = ThreadReplica(close_unread)
    client = make_client()
    try:
        for _ in range(2):
            resp = await asyncio.wait_for(client.request(replica.origin, HEAD, b"{}"), 5)
            assert await resp.read() == b"hello"
            resp.release()
    finally:
        await replica.join()
    assert unread.is_set()
    # Read once on each connection: the one the reset dropped was never read.
    assert replica.received == [HEAD + b"{}", HEAD + b"{}"]


BIG = b"x" * (32 * 1024 * 1024)  # far more than the kernel's buffers hold for a replica that reads nothing
BIG_HEAD = b"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(BIG)


async def big_request_replica(second: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Any]) -> Any:
    """A replica that answers the first request, hands the head of the second to `second`, answers the rest."""
    connections: list[int] = []
    requests: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            for _ in range(10):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                requests.append(length)
                if len(requests) == 2:
                    await second(reader, writer, length)
                    if writer.is_closing():
                        return
                    continue
                await reader.readexactly(length)
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(ending_quietly(handle), "127.0.0.1", 0, limit=1 << 20)
    return server, connections, requests


async def test_a_request_cut_off_before_it_went_out_whole_is_sent_again_once(make_client: MakeClient) -> None:
    """The replica resets a reused connection while most of the request still waits to go out: the race, retried."""

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int) -> None:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server, connections, requests = await big_request_replica(reset)
    origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    client = make_client()
    try:
        await ok_once_at(client, origin)
        resp = await asyncio.wait_for(client.request(origin, BIG_HEAD, BIG), 20)
        assert await resp.read() == b"hello"
        resp.release()
    finally:
        server.close()
        await server.wait_closed()
    assert requests == [2, len(BIG), len(BIG)]
    assert len(connections) == 2


async def test_a_connection_answered_before_its_request_went_out_whole_is_not_reused(make_client: MakeClient) -> None:
    """An early answer (413 before the body was read) leaves the rest of the body unsent: that connection is dropped."""

    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int) -> None:
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.readexactly(length)

    server, connections, requests = await big_request_replica(early)
    origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    client = make_client()
    try:
        await ok_once_at(client, origin)
        resp = await asyncio.wait_for(client.request(origin, BIG_HEAD, BIG), 20)
        assert resp.status == 413
        assert await resp.read() == b""
        resp.release()
        await ok_once_at(client, origin)
    finally:
        server.close()
        await server.wait_closed()
    assert requests == [2, len(BIG), 2]
    assert len(connections) == 2


# 4. Trailers -----------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["same-read-as-the-head", "later-read"])
async def test_trailers_never_become_response_headers(
    raw_server: StartRaw, make_client: MakeClient, split: bool
) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Trailer\r\n\r\n"
    rest = b"5\r\nhello\r\n0\r\nX-Trailer: evil\r\nContent-Type: text/evil\r\n\r\n"

    headed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if split:
            writer.write(head)
            await writer.drain()
            await headed.wait()  # the head was read and handed over: the rest is a later read
            writer.write(rest)
        else:
            writer.write(head + rest)
        await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    headed.set()
    assert await resp.read() == b"hello"
    assert [name for name, _ in resp.headers] == [b"Transfer-Encoding", b"Trailer"]
    assert resp.header(b"x-trailer") is None
    assert resp.header(b"content-type") is None
    resp.release()
    # Trailers are no protocol error: the connection is reused.
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert await resp.read() == b"hello"
    resp.release()
    assert raw.connections == 1
    assert client.protocol_errors.counts == {}


# 5. Silence in the middle of a body ------------------------------------------------------


async def test_a_stream_that_goes_quiet_ends_with_upstream_idle(raw_server: StartRaw, make_client: MakeClient) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await until_hung_up(reader)

    raw = await raw_server(answer)
    client = make_client(idle_timeout=0.2)
    resp = await client.request(raw.origin, HEAD, b"{}")
    sink = Recorder()
    began = time.monotonic()
    with pytest.raises(UpstreamIdle) as info:
        await asyncio.wait_for(resp.pipe(sink, never_drained), 5)
    waited = time.monotonic() - began
    assert 0.2 <= waited < 2
    assert not info.value.before_head
    assert info.value.answered
    assert sink.pieces == [b"hello"]
    resp.release()
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"idle_timeout": 1}


async def test_a_body_shorter_than_its_length_then_silence_ends_with_upstream_idle(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhell")
        await writer.drain()
        await until_hung_up(reader)

    raw = await raw_server(answer)
    client = make_client(idle_timeout=0.2)
    resp = await client.request(raw.origin, HEAD, b"{}")
    with pytest.raises(UpstreamIdle):
        await asyncio.wait_for(resp.read(), 5)
    resp.release()
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"idle_timeout": 1}


async def test_a_slow_steady_stream_is_not_idle(raw_server: StartRaw, make_client: MakeClient) -> None:
    # Pauses shorter than the idle timeout, for much longer than it in all (on the client's clock).
    clock = FakeClock()
    sink = Recorder()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in range(12):
            clock.advance(0.1)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await wait_for(lambda: len(sink.pieces) > piece)  # noqa: B023
        writer.write(b"0\r\n\r\n")

    raw = await raw_server(answer)
    client = make_client(idle_timeout=0.2, clock=clock)
    resp = await client.request(raw.origin, HEAD, b"{}")
    await resp.pipe(sink, never_drained)
    resp.release()
    assert b"".join(sink.pieces) == b"x" * 12
    assert client.protocol_errors.counts == {}
    assert client.open_connections == 1


async def test_a_stream_paused_by_a_slow_client_is_not_idle(raw_server: StartRaw, make_client: MakeClient) -> None:
    # The proxy's client takes nothing for far longer than the idle timeout:
    # the replica's connection is not read, so it sends nothing, and that is
    # this side's doing, not the replica's.
    total = 2 * 1024 * 1024

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    raw = await raw_server(answer)
    clock = FakeClock()
    client = make_client(idle_timeout=0.1, clock=clock)
    resp = await client.request(raw.origin, HEAD, b"{}")
    sink = Recorder(full=True)
    drains = 0

    async def drain() -> None:
        nonlocal drains
        drains += 1
        if drains == 1:
            # The client takes nothing for six idle timeouts, while the connection is paused.
            assert all(c.paused for c in client._all)
            clock.advance(0.6)

    await asyncio.wait_for(resp.pipe(sink, drain), 10)
    resp.release()
    assert sum(map(len, sink.pieces)) == total
    assert client.protocol_errors.counts == {}


async def test_a_slow_head_is_the_first_byte_timers_not_the_idle_sweeps(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    clock = FakeClock()
    client = make_client(idle_timeout=0.1, clock=clock)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        # Five idle timeouts before the head, well within the head's deadline.
        clock.advance(0.5)
        writer.write(OK)
        await writer.drain()

    raw = await raw_server(answer)
    resp = await client.request(raw.origin, HEAD, b"{}", head_timeout=5.0)
    assert await resp.read() == b"hello"
    resp.release()
    assert client.protocol_errors.counts == {}


async def test_the_idle_sweep_runs_only_while_a_body_is_in_progress(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel"))
    clock = FakeClock()
    client = make_client(idle_timeout=0.2, clock=clock)
    assert client.watching is None
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert client.watching is not None
    resp.release()
    # Nothing in progress: the next sweep finds no body and does not rearm.
    clock.advance(0.15)
    assert client.watching is None
    # Every idle_timeout / 4, within [0.05 s, 5 s].
    assert make_client(idle_timeout=300.0)._watch_every == 5.0
    assert make_client(idle_timeout=0.01)._watch_every == 0.05
    assert make_client(idle_timeout=2.0)._watch_every == 0.5
