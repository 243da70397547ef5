"""A request that asks the replica to switch protocols (a WebSocket): its answer, then its bytes.

Not a pooled keep-alive exchange (pool.py): a connection of its own, which
after the replica's `101` belongs to the switched session for as long as it
lasts, and is never reused. The head is read by llhttp as every answer's is
(reader.py's bounds); the replica's bytes after a 101 head are the new
protocol's first, handed to a Pipe. Any other answer is read whole (up to
`limit` bytes) for the caller to pass on.
"""

from __future__ import annotations

import asyncio
import ssl

import httptools

from router.core.origin import Origin
from router.http.client.errors import ConnectFailed, ConnectionBroken, HeadTimeout
from router.http.client.reader import MAX_HEAD_BYTES, status_line_problem
from router.http.pipe import Pipe


class Answer:
    """The replica's answer to an upgrade request: 101 with the Pipe, or another status read whole."""

    __slots__ = ("body", "headers", "pipe", "reason", "status")

    def __init__(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], body: bytes, pipe: Pipe | None
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        # Set for a 101: the replica's side of the switched connection.
        self.pipe = pipe


class _Head(asyncio.Protocol):
    """Reads one answer: its head, then the switch or a whole body."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.status == 101:
            # The switch: llhttp stops right after (HttpParserUpgrade), where the pipe begins.
            return
        if 100 <= self.status < 200:
            # An interim answer (100, 103): the real one follows.
            self._reason, self._headers, self.status = b"", [], 0
            return
        self._refusal_read()

    def _refusal_read(self) -> None:
        """A whole answer other than the switch: the client's, if its status line is one to pass on."""
        problem = status_line_problem(self.parser.get_http_version(), self.status, self._reason)
        if problem is not None:
            self._fail(ConnectionBroken(problem, before_head=True))
        else:
            self._finish(None)

    def _finish(self, pipe: Pipe | None) -> None:
        if not self.done.done():
            body = b"".join(self._body)
            self.done.set_result(Answer(self.status, self._reason, self._headers, body, pipe))

    def _fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self._size += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            problem = status_line_problem(self.parser.get_http_version(), 200, self._reason)
            if self.status != 101 or problem is not None:
                self._fail(ConnectionBroken(problem or "the replica upgraded without a 101", before_head=True))
                return
            assert self.transport is not None
            pipe = Pipe(self.transport, data[exc.args[0] :])
            pipe.attach()
            self._finish(pipe)
            return
        except httptools.HttpParserError as failure:
            if self.status == 101:
                # llhttp stops at a 101 whose Connection names no upgrade (its pause is then no
                # HttpParserUpgrade): RFC 9110 7.8 asks for both, and nothing was switched.
                self._fail(ConnectionBroken("the replica answered 101 without Connection: Upgrade", before_head=True))
                return
            self._fail(
                ConnectionBroken(f"the replica's answer is not valid HTTP: {failure}", before_head=not self.status)
            )
            return
        if not self.status and self._size > MAX_HEAD_BYTES:
            self._fail(ConnectionBroken(f"the replica's head is over {MAX_HEAD_BYTES} bytes", before_head=True))
        elif sum(len(piece) for piece in self._body) > self.limit:
            self._fail(ConnectionBroken(f"the replica's answer is over {self.limit} bytes", before_head=False))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self.status and self.parser.should_keep_alive() is False and exc is None:
            # A body that ends with the connection (RFC 9112 6.3).
            self._refusal_read()
            return
        self._fail(ConnectionBroken(f"the replica closed the connection: {exc or 'EOF'}", before_head=not self.status))


async def upgrade(
    origin: Origin, head: bytes, *, connect_timeout: float, head_timeout: float, limit: int = 1 << 20
) -> Answer:
    """Send `head` (a request without a body) on a new connection; the replica's answer.

    ConnectFailed: no connection. HeadTimeout: no whole answer within `head_timeout`.
    ConnectionBroken: the replica broke off or spoke no HTTP.
    """
    loop = asyncio.get_running_loop()
    tls = ssl.create_default_context() if origin.tls else None
    try:
        async with asyncio.timeout(connect_timeout):
            transport, protocol = await loop.create_connection(
                lambda: _Head(limit),
                origin.host,
                origin.port,
                ssl=tls,
                server_hostname=origin.host if tls else None,
            )
    except TimeoutError as exc:
        raise ConnectFailed(f"no connection within {connect_timeout:g} s") from exc
    except OSError as refused:
        raise ConnectFailed(str(refused) or type(refused).__name__) from refused
    transport.write(head)
    try:
        async with asyncio.timeout(head_timeout):
            answer = await protocol.done
    except TimeoutError as exc:
        transport.abort()
        raise HeadTimeout(f"no response head within {head_timeout:g} s") from exc
    except BaseException:
        transport.abort()
        raise
    if answer.pipe is None:
        transport.close()
    return answer
