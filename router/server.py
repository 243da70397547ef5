"""The client port's HTTP/1.1 server, on asyncio.Protocol and llhttp (httptools).

aiohttp's server spent, per short request, about as much CPU in Python as
the whole router's own logic: a request object with lazy properties, a task
and a response object per request, header multidicts both ways. The client
port needs four routes of plain HTTP/1.1, so this module does only that:

- requests are parsed by llhttp in strict mode (the parser aiohttp uses):
  conflicting lengths, chunked with anything after it, bare LF, obs-fold,
  NUL, a negative length are 400 and the connection is closed; so are heads
  with a line over 8 KiB or more than 100 headers;
- a head must arrive whole within `header_timeout` seconds of its first
  byte (slowloris), on every request of a connection, not only the first;
  an idle keep-alive connection is closed after `keepalive_timeout`;
- bodies are bounded (413, then the rest of the body is read and dropped so
  that the client reads the answer, then the connection closes);
  `Expect: 100-continue` is answered when the body is within the limit;
- one handler task per request, run in order (pipelined requests wait);
  when the client goes away, the task is cancelled, and with it the
  upstream request;
- a whole answer is one write; a stream writes its head, then chunks
  (chunked framing on HTTP/1.1, delimited by close on HTTP/1.0);
- shutdown: stop accepting, close idle connections, let running requests
  finish within the grace, then cancel them.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import cast

import httptools

MAX_LINE = 8190
MAX_HEADERS = 100

_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


def reason_of(status: int) -> bytes:
    return _REASONS.get(status, b"Unknown")


class _Date:
    """The Date header, formatted once a second rather than per answer."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode()
        return self._value


http_date = _Date()


class Request:
    """One parsed request, body included."""

    __slots__ = ("body", "connection", "keep_alive", "method", "path", "raw_headers", "target", "version_11")

    def __init__(
        self,
        connection: Connection,
        method: str,
        target: bytes,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        version_11: bool,
    ) -> None:
        self.connection = connection
        self.method = method
        # The request target as sent (path and query), passed on as it is.
        self.target = target
        self.path = target.split(b"?", 1)[0].decode("utf-8", "surrogateescape")
        self.raw_headers = raw_headers
        self.body = body
        self.keep_alive = keep_alive
        self.version_11 = version_11

    def header(self, lower_name: bytes) -> bytes | None:
        for name, value in self.raw_headers:
            if name.lower() == lower_name:
                return value
        return None


class Reply:
    """A whole answer: written in one piece, Content-Length and Date added."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]], reason: bytes | None = None
    ) -> None:
        self.status = status
        self.body = body
        # End-to-end headers only; the server adds the framing ones.
        self.headers = headers
        self.reason = reason if reason is not None else reason_of(status)


Handler = Callable[[Request], Awaitable[Reply | None]]


def _head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    has_date = False
    for name, value in headers:
        if not has_date and name.lower() == b"date":
            has_date = True
        lines.append(name + b": " + value + b"\r\n")
    if not has_date:
        lines.append(b"Date: " + http_date() + b"\r\n")
    lines.append(framing)
    return b"".join(lines)


class Connection(asyncio.Protocol):
    """One client connection: parse, run the handler per request in order, answer."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._target = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._pending: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        # When this connection's current wait ends (monotonic; 0 = none), and
        # whether it waits for a head (slowloris) or idles. One sweep over all
        # connections checks these: no timer to arm and cancel per request.
        self._deadline = 0.0
        self._slow = False
        self._closing = False
        self._discarding = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        # Set while a stream is being written: that its head is out, its framing.
        self._streaming = False
        self._chunked = False
        self._keep_alive = True

    # asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        # The first head must start and end within the head deadline.
        self._arm(self.server.header_timeout, slow=True)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            # After a 413: the rest of the body is read and dropped, then the
            # connection closes once the message ends (or the timer fires).
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self._close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "Protocol upgrades are not supported.")
        except httptools.HttpParserError as exc:
            self._fail(400, f"The request is not valid HTTP/1.1: {exc}.")

    def eof_received(self) -> bool:
        # A client that closes its side has left, as for aiohttp: the
        # connection closes and its request is cancelled, with the replica's.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._disarm()
        self._closing = True
        self._pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))
            # Retrieved or not, never logged as unretrieved.
            self._drained.exception()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # llhttp callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._target = b""
        self._headers = []
        self._body = []
        self._body_size = 0
        if not self._discarding:
            self._arm(self.server.header_timeout, slow=True)

    def on_url(self, url: bytes) -> None:
        self._target += url
        if len(self._target) > MAX_LINE:
            raise httptools.HttpParserError("request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_LINE:
            raise httptools.HttpParserError("header line too long")
        self._headers.append((name, value))
        if len(self._headers) > MAX_HEADERS:
            raise httptools.HttpParserError("too many headers")

    def on_headers_complete(self) -> None:
        if self._discarding:
            return
        self._disarm()
        limit = self.server.max_body_bytes
        length = self._content_length()
        if length is not None and length > limit:
            self._too_large(f"The request body is {length} bytes; the limit is {limit}.")
            return
        for name, value in self._headers:
            if name.lower() == b"expect" and value.lower() == b"100-continue" and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._discarding:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body_bytes:
            self._too_large(f"The request body exceeds the limit of {self.server.max_body_bytes} bytes.")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._discarding:
            self._close()
            return
        parser = self.parser
        request = Request(
            self,
            parser.get_method().decode("ascii", "replace"),
            self._target,
            self._headers,
            b"".join(self._body),
            parser.should_keep_alive(),
            parser.get_http_version() == "1.1",
        )
        self._body = []
        if self.task is None:
            self._start(request)
        else:
            self._pending.append(request)
            if self.transport is not None:
                # A client pipelining ahead waits for its answers: at most two
                # bodies of max_body_bytes are held per connection.
                self.transport.pause_reading()

    # Running requests ---------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        self._keep_alive = request.keep_alive and not self.server.stopping
        self._streaming = False
        try:
            reply = await self.server.handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 (the root of a request: answered 500, logged, connection lives on)
            self.server.log_exception("request handler failed")
            if self._streaming:
                # Bytes of a stream are out: a 500 now would corrupt it; the close ends it.
                self._keep_alive = False
                reply = None
            else:
                reply = self.server.internal_error()
        if reply is not None:
            self.write_reply(reply, head_only=request.method == "HEAD")
        self.task = None
        if self._closing or not self._keep_alive:
            self._close()
            return
        if self._pending:
            if self.transport is not None:
                self.transport.resume_reading()
            self._start(self._pending.popleft())
        else:
            self._arm(self.server.keepalive_timeout, slow=False)

    def write_reply(self, reply: Reply, *, head_only: bool = False) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        status = reply.status
        # 204 and 304 carry neither a body nor a length (RFC 9110 8.6).
        framing = b"" if status in (204, 304) else b"Content-Length: %d\r\n" % len(reply.body)
        if not self._keep_alive:
            framing += b"Connection: close\r\n"
        head = _head(status, reply.reason, reply.headers, framing + b"\r\n")
        if head_only or not framing:
            self.transport.write(head)
        elif len(reply.body) > 65536:
            # A big answer (embeddings of a large batch) is not copied into the head.
            self.transport.writelines((head, reply.body))
        else:
            self.transport.write(head + reply.body)

    # Streams --------------------------------------------------------------------------------

    def start_stream(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], version_11: bool) -> None:
        """Write a stream's head; then write_chunk() each piece and end_stream()."""
        assert self.transport is not None
        self._streaming = True
        self._chunked = version_11
        if version_11:
            framing = b"Transfer-Encoding: chunked\r\n"
            if not self._keep_alive:
                framing += b"Connection: close\r\n"
        else:
            # HTTP/1.0 has no chunks: the end of the connection ends the body.
            framing = b"Connection: close\r\n"
            self._keep_alive = False
        self.transport.write(_head(status, reason, headers, framing + b"\r\n"))

    def write_chunk(self, data: bytes) -> bool:
        """Write one piece; True when the client's buffer is full (await drain())."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return self._paused

    def end_stream(self) -> None:
        if self._chunked and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"0\r\n\r\n")

    def close_after_answer(self) -> None:
        self._keep_alive = False

    async def drain(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self._closing:
            raise ConnectionResetError("the client went away")
        if not self._paused:
            return
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await self._drained
        finally:
            self._drained = None

    # Errors, timers, closing ------------------------------------------------------------------

    def _content_length(self) -> int | None:
        for name, value in self._headers:
            if name.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def _fail(self, status: int, message: str) -> None:
        """A request that cannot be parsed: answer, then close (nothing left to smuggle)."""
        self._keep_alive = False
        self._pending.clear()
        if self.task is None:
            self.write_reply(self.server.error(status, message))
        self._close()

    def _too_large(self, message: str) -> None:
        self._keep_alive = False
        self._discarding = True
        self._disarm()
        if self.task is None:
            self.write_reply(self.server.error(413, message, code="request_too_large"))
        # Long enough for a client to finish sending what it started.
        self._arm(2.0, slow=False)

    def _arm(self, seconds: float, *, slow: bool) -> None:
        self._deadline = time.monotonic() + seconds
        self._slow = slow
        self.server.watch()

    def _disarm(self) -> None:
        self._deadline = 0.0

    def expired(self, now: float) -> bool:
        return 0.0 < self._deadline < now

    @property
    def waiting(self) -> bool:
        return self._deadline > 0.0

    def expire(self) -> None:
        slow = self._slow
        self._deadline = 0.0
        if self.task is not None:
            return
        if slow and not self._discarding:
            # A head that never ended: no answer is owed; the slot is freed.
            if self.transport is not None:
                self.transport.abort()
            return
        self._close()

    def _close(self) -> None:
        self._closing = True
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close_if_idle(self) -> None:
        if self.task is None:
            self._close()


class Server:
    """Owns the client connections: the handler, the limits, and shutdown."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        header_timeout: float,
        error: Callable[..., Reply],
        log_exception: Callable[[str], None],
        keepalive_timeout: float = 75.0,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        # error(status, message, code=...) -> an OpenAI-shaped Reply.
        self.error = error
        self.log_exception = log_exception
        self.connections: set[Connection] = set()
        self.stopping = False
        self._sweeper: asyncio.TimerHandle | None = None
        # Deadlines are checked this often: a few times per head deadline.
        self._every = max(0.05, min(1.0, header_timeout / 4))

    def __call__(self) -> Connection:
        return Connection(self)

    def watch(self) -> None:
        """Make sure the sweep runs while any connection waits on a deadline."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self._every, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        waiting = False
        for connection in list(self.connections):
            if connection.expired(now):
                connection.expire()
            elif connection.waiting:
                waiting = True
        if waiting:
            self.watch()

    def internal_error(self) -> Reply:
        return self.error(500, "The router failed to handle the request.", code="internal_error")

    async def shutdown(self, grace: float) -> None:
        """Close idle connections, let requests finish within `grace`, then cancel them."""
        self.stopping = True
        for connection in list(self.connections):
            connection.close_if_idle()
        deadline = time.monotonic() + grace
        while (running := [c.task for c in self.connections if c.task is not None]) and time.monotonic() < deadline:
            # A pipelined request may start as one ends: look again until none runs.
            await asyncio.wait(running, timeout=max(0.0, deadline - time.monotonic()))
        tasks = [c.task for c in self.connections if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
        await asyncio.sleep(0)
