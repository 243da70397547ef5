"""The proxy's own HTTP/1.1 client to the replicas, on asyncio.Protocol.

aiohttp's ClientSession spends more CPU per request than the whole rest of
the router (URL objects, cookie and trace machinery, a request object per
call, a StreamReader per body). A replica speaks plain HTTP/1.1 to one
proxy, so this client does only that: a pool of keep-alive connections per
origin, the request written in one `transport.write()`, the response parsed
by llhttp (httptools), and a stream's chunks handed straight to a sink in
the protocol callback, with no task switch per chunk.

Failures are classified for the proxy's retry rules: `ConnectFailed` (no
connection; nothing was sent), `ConnectionBroken` (the connection ended or
was garbled; if before the response head, the request may be retried), and
a replica's HTTP status is never an exception here.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

# Above this many bytes queued for a reader that is not taking them, the
# replica's connection stops being read, so TCP pushes back to the replica.
_HIGH_WATER = 256 * 1024


class ConnectFailed(Exception):
    """No connection could be made: the request was not sent."""


class HeadTimeout(Exception):
    """The replica sent no response head within the deadline."""


class ConnectionBroken(Exception):
    """The connection ended or sent something that is not HTTP."""

    def __init__(self, message: str, *, before_head: bool) -> None:
        super().__init__(message)
        self.before_head = before_head


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens, parsed once from its base URL."""

    host: str
    port: int
    tls: bool
    # Path prefix of the base URL (b"" or b"/prefix"), put before the client's path.
    prefix: bytes
    host_header: bytes
    # What the connection pools are keyed by: a str hashes once and compares
    # in C, where the dataclass would build tuples on every lookup.
    key: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname or ""
        shown = f"[{host}]" if ":" in host else host
        default = 443 if tls else 80
        header = shown if port == default else f"{shown}:{port}"
        key = f"{'https' if tls else 'http'}://{shown}:{port}"
        return cls(host, port, tls, parts.path.rstrip("/").encode(), header.encode("idna"), key)


class Response:
    """A replica's answer: the head at once, the body as it arrives.

    Read it whole with `read()`, or `pipe()` each chunk into a sink; then
    `release()` hands the connection back (or closes it if the body was not
    read to the end, so that a half-read answer never lingers).
    """

    __slots__ = (
        "_chunks",
        "_connection",
        "_done",
        "_error",
        "_queued",
        "_sink",
        "_waiter",
        "content_length",
        "headers",
        "reason",
        "reason_bytes",
        "status",
    )

    def __init__(self, connection: _Connection, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self._connection = connection
        self.status = status
        # As the replica sent it, for the answer to the client.
        self.reason_bytes = reason
        self.reason = reason.decode("latin-1")
        # Raw (name, value) pairs in the replica's order and spelling.
        self.headers = headers
        self.content_length: int | None = None
        for name, value in headers:
            if name.lower() == b"content-length":
                try:
                    self.content_length = int(value)
                except ValueError:
                    self.content_length = None
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._done = False
        self._error: ConnectionBroken | None = None
        self._waiter: asyncio.Future[None] | None = None
        # pipe(): called with each chunk in the protocol callback; True = the
        # sink's buffer is full and the replica should wait.
        self._sink: Callable[[bytes], bool] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header, by lower-case name."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    # Fed by the connection ------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None and not self._chunks:
            if sink(data):
                self._connection.pause()
                self._wake()
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > _HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _finish(self, error: ConnectionBroken | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # The proxy's side -------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body; raises ConnectionBroken if it was cut short."""
        while not self._done:
            self._connection.resume()
            await self._wait()
        if self._error is not None:
            raise self._error
        chunks, self._chunks = self._chunks, deque()
        self._queued = 0
        return b"".join(chunks)

    async def pipe(self, sink: Callable[[bytes], bool], drain: Callable[[], Any]) -> None:
        """Pass every chunk to `sink` as it arrives, until the body ends.

        `sink(chunk)` returns True when its buffer is full; reading from the
        replica then stops until `await drain()` returns. Raises
        ConnectionBroken if the replica broke off.
        """
        self._sink = sink
        try:
            while True:
                while self._chunks:
                    chunk = self._chunks.popleft()
                    self._queued -= len(chunk)
                    if sink(chunk):
                        await drain()
                if self._done:
                    break
                self._connection.resume()
                await self._wait()
                if self._connection.paused and not self._chunks and not self._done:
                    # The sink said full inside the callback.
                    await drain()
        finally:
            self._sink = None
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        self._sink = None
        self._connection.response_released(self)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; one request at a time."""

    def __init__(self, client: Client, origin: Origin) -> None:
        self.client = client
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self._status_line = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.reusable = False
        self.paused = False
        self.idle_since = 0.0
        self.closed = False
        # Body bytes parsed from the current read, handed on as one piece
        # after it: a read holding many SSE events costs one client write.
        self._body: list[bytes] = []
        self._deadline: asyncio.TimerHandle | None = None

    # asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._body.clear()
            self._broken(f"the replica's answer is not valid HTTP: {exc}")
            self.close()
            return
        self._flush()

    def _flush(self) -> None:
        body = self._body
        if body and self.response is not None:
            self.response._feed(body[0] if len(body) == 1 else b"".join(body))
        body.clear()

    def eof_received(self) -> bool:
        # Only a body delimited by the end of the connection ends here well.
        try:
            self.parser.feed_data(b"")
        except httptools.HttpParserError:
            pass
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._flush()
        self._stop_deadline()
        if self.response is not None and not self.complete:
            # A body without a length ends with the connection (RFC 9112 6.3).
            if self.response.content_length is None and self._close_delimited():
                self.complete = True
                self.response._finish()
            else:
                self._broken(f"the replica closed the connection: {exc or 'EOF'}")
        elif self.head is not None and not self.head.done():
            self._broken(f"the replica closed the connection before answering: {exc or 'EOF'}")
        self.client._forget(self)

    # httptools callbacks ---------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self._status_line += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): the real one follows.
            self._status_line = b""
            self._headers = []
            return
        self._stop_deadline()
        response = Response(self, status, self._status_line, self._headers)
        self.response = response
        head = self.head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None:
            return  # the end of an interim answer
        self._flush()
        self.complete = True
        self.reusable = self.parser.should_keep_alive()
        response._finish()

    # Flow control --------------------------------------------------------------------

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    # The client's side ---------------------------------------------------------------

    def send(self, data: bytes, head_timeout: float | None) -> asyncio.Future[Response]:
        assert self.transport is not None
        loop = self.loop
        self.complete = False
        self.reusable = False
        self.response = None
        self._status_line = b""
        self._headers = []
        self.head = loop.create_future()
        if head_timeout is not None:
            # One timer per request, cancelled by the head: cheaper than an
            # asyncio.timeout() around the await.
            self._deadline = loop.call_later(head_timeout, self._head_late, head_timeout)
        self.transport.write(data)
        return self.head

    def _head_late(self, seconds: float) -> None:
        self._deadline = None
        head = self.head
        if head is not None and not head.done():
            head.set_exception(HeadTimeout(f"no response head within {seconds:g} s"))

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def response_released(self, response: Response) -> None:
        if response is not self.response:
            return
        self.response = None
        self.head = None
        if self.complete and self.reusable and not self.closed:
            self.resume()
            self.client._idle_again(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
            self.client._forget(self)

    def abandon(self) -> None:
        """The caller gave up before the head (timeout, client gone): never reuse."""
        self._stop_deadline()
        self.response = None
        self.head = None
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()
            self.client._forget(self)

    def _close_delimited(self) -> bool:
        # A response with neither Content-Length nor chunked framing.
        assert self.response is not None
        return not any(
            name.lower() == b"transfer-encoding" and b"chunked" in value.lower()
            for name, value in self.response.headers
        )

    def _broken(self, message: str) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(ConnectionBroken(message, before_head=True))
        elif self.response is not None:
            self.response._finish(ConnectionBroken(message, before_head=False))


class Client:
    """Keep-alive connection pools, one per origin, for every replica."""

    def __init__(self, *, connect_timeout: float, keepalive_seconds: float) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_seconds = keepalive_seconds
        self._idle: dict[str, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def request(self, origin: Origin, head: bytes, body: bytes, head_timeout: float | None = None) -> Response:
        """Send one request (head already framed) and wait for the response head.

        Raises ConnectFailed; HeadTimeout when no head came within
        `head_timeout` seconds of sending; or ConnectionBroken(before_head=True)
        when the connection ended before any answer (a stale keep-alive
        connection that the replica closed just then looks like that).
        """
        connection = self._reuse(origin)
        if connection is not None:
            try:
                return await self._exchange(connection, head, body, head_timeout)
            except ConnectionBroken as exc:
                if not exc.before_head:
                    raise
                # The keep-alive race: the replica closed the idle connection
                # as the request went out. Once more, on a fresh connection.
        connection = await self._connect(origin)
        return await self._exchange(connection, head, body, head_timeout)

    async def _exchange(
        self, connection: _Connection, head: bytes, body: bytes, head_timeout: float | None
    ) -> Response:
        # One write for a small request; a big body is not copied into the head.
        future = connection.send(head + body if len(body) < 65536 else head, head_timeout)
        if len(body) >= 65536:
            assert connection.transport is not None
            connection.transport.write(body)
        try:
            return await future
        except BaseException:
            # Cancelled (client gone, first-byte timeout) or broken: the
            # connection is mid-request and can never be reused.
            connection.abandon()
            raise

    def _reuse(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin.key)
        if not idle:
            return None
        cutoff = time.monotonic() - self.keepalive_seconds
        while idle:
            # The most recently used first: the most likely to be open still.
            connection = idle.pop()
            transport = connection.transport
            if connection.idle_since >= cutoff and not connection.closed and transport and not transport.is_closing():
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection within {self.connect_timeout:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        self._all.add(protocol)
        return protocol

    def _idle_again(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin.key, []).append(connection)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive_seconds, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle longer than the keep-alive, before the replica does."""
        self._sweeper = None
        cutoff = time.monotonic() - self.keepalive_seconds
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if c.idle_since >= cutoff and not c.closed]
            for connection in idle:
                if connection not in keep:
                    connection.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive_seconds, self._sweep)

    def _forget(self, connection: _Connection) -> None:
        self._all.discard(connection)
        idle = self._idle.get(connection.origin.key)
        if idle and connection in idle:
            idle.remove(connection)

    @property
    def open_connections(self) -> int:
        return len(self._all)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        # One loop turn so that the transports' close callbacks run.
        await asyncio.sleep(0)
