"""A request that asks the replica to switch protocols (a WebSocket): its answer, then its bytes.

Not a pooled keep-alive exchange (pool.py): a connection of its own, which
after the replica's `101` belongs to the switched session for as long as it
lasts, and is never reused. The head is read by llhttp as every answer's is
(reader.py's bounds); the replica's bytes after a 101 head are the new
protocol's first, handed to a Pipe. A 101 must switch to the protocol asked
for (RFC 9110 7.8: the client asked for one, and would be handed another's
bytes). An error answer (4xx, 5xx) is read whole (up to `limit` bytes) for
the caller to reshape; any other (a 200 event stream, say) is handed over
at its head, its body to be read as it arrives.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import cast

import httptools

from router.http.client.errors import ConnectFailed, ConnectionBroken, HeadTimeout
from router.http.client.reader import MAX_HEAD_BYTES, chunked_alone, status_line_problem
from router.http.origin import Origin
from router.http.pipe import Pipe


def names_protocol(upgrade: bytes, protocol: bytes) -> bool:
    """Whether an Upgrade field's list (RFC 9110 7.8: `name[/version]`, comma-separated) names `protocol`."""
    wanted = protocol.lower()
    return any(item.strip(b" \t").partition(b"/")[0].lower() == wanted for item in upgrade.split(b","))


class Answer:
    """The replica's answer to an upgrade request: 101 with the Pipe, an error read whole, or another streamed."""

    __slots__ = ("body", "headers", "pipe", "reason", "status", "streamed")

    def __init__(  # noqa: PLR0917 (a value object: its fields in order, made on the request path)
        self,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        pipe: Pipe | None,
        streamed: Streamed | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        # Set for a 101: the replica's side of the switched connection.
        self.pipe = pipe
        # Set for an answer that is neither a 101 nor an error: its body, as it arrives.
        self.streamed = streamed

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (`name` lower-case)."""
        return next((value for key, value in self.headers if key.lower() == name), None)


class Streamed(Pipe):
    """An answer's body as llhttp reads it off the connection: read() until b"", then `whole` says how it ended.

    A Pipe that is fed, not attached: the connection stays the head reader's,
    which hands on each piece of the body without its framing; reading stops
    while the reader of this one is behind.
    """

    __slots__ = ("whole",)

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        # The body ended as its framing says (its length met, its last chunk read).
        self.whole = False

    def ended(self) -> None:
        self.whole = True
        self.eof_received()
        self.transport.close()


class _Head(asyncio.Protocol):
    """Reads one answer: its head, then the switch, a whole error body, or a body handed on as it arrives."""

    def __init__(self, limit: int, protocol: bytes) -> None:
        self.limit = limit
        self.protocol = protocol
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._streamed: Streamed | None = None
        # The answer was found broken (and the connection aborted): its end is no body's end.
        self._broken = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: uvloop's TCPTransport has every method of
        # asyncio.Transport but is not one of its subclasses, so no isinstance.
        self.transport = cast(asyncio.Transport, transport)

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = status = self.parser.get_status_code()
        if 200 <= status < 400:
            problem = status_line_problem(self.parser.get_http_version(), status, self._reason)
            coding = next((value for name, value in self._headers if name.lower() == b"transfer-encoding"), None)
            if problem is None and coding is not None and not chunked_alone(coding):
                # As for every answer (reader.py): llhttp would read such a body to the close.
                problem = f"the replica's answer has a transfer coding other than chunked: {coding!r}"
            if problem is not None:
                self._fail(ConnectionBroken(problem, before_head=True))
                return
            # Neither the switch nor an error: the client's as it arrives, never held whole.
            assert self.transport is not None
            self._streamed = streamed = Streamed(self.transport)
            if not self.done.done():
                self.done.set_result(Answer(status, self._reason, self._headers, b"", None, streamed))

    def on_body(self, body: bytes) -> None:
        if self._streamed is not None:
            self._streamed.data_received(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self.status == 101:
            # The switch: llhttp stops right after (HttpParserUpgrade), where the pipe begins.
            return
        if 100 <= self.status < 200:
            # An interim answer (100, 103): the real one follows.
            self._reason, self._headers, self.status = b"", [], 0
            return
        if self._streamed is not None:
            self._streamed.ended()
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
        self._broken = True
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
            upgraded = next((value for name, value in self._headers if name.lower() == b"upgrade"), b"")
            if self.status != 101:
                problem = problem or "the replica upgraded without a 101"
            elif problem is None and not names_protocol(upgraded, self.protocol):
                # The client would be handed bytes of a protocol it never asked for.
                problem = f"the replica switched to {upgraded[:64]!r}, not to the {self.protocol!r} asked for"
            if problem is not None:
                self._fail(ConnectionBroken(problem, before_head=True))
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
        elif self._streamed is None and sum(len(piece) for piece in self._body) > self.limit:
            self._fail(ConnectionBroken(f"the replica's answer is over {self.limit} bytes", before_head=False))

    def _ends_with_close(self, exc: Exception | None) -> bool:
        """Whether the connection's end is the end of the answer's body (RFC 9112 6.3):
        a clean close, of a body with neither a length nor chunks, that nothing had found broken."""
        if exc is not None or self._broken or not self.status:
            return False
        return all(name.lower() not in (b"content-length", b"transfer-encoding") for name, _ in self._headers)

    def connection_lost(self, exc: Exception | None) -> None:
        streamed = self._streamed
        if streamed is not None:
            if streamed.whole:
                return
            if self._ends_with_close(exc):
                streamed.ended()
                return
            streamed.connection_lost(exc)
        if self.done.done():
            return
        if self._ends_with_close(exc):
            self._refusal_read()
            return
        self._fail(ConnectionBroken(f"the replica closed the connection: {exc or 'EOF'}", before_head=not self.status))


async def upgrade(
    origin: Origin,
    head: bytes,
    *,
    connect_timeout: float,
    head_timeout: float,
    limit: int = 1 << 20,
    protocol: bytes = b"websocket",
) -> Answer:
    """Send `head` (a request without a body, asking to switch to `protocol`) on a new connection; the answer.

    ConnectFailed: no connection. HeadTimeout: no head (no whole error answer) within `head_timeout`.
    ConnectionBroken: the replica broke off, spoke no HTTP, or switched to another protocol.
    A streamed answer's connection is the caller's to close (its `streamed` ends it once read whole).
    """
    loop = asyncio.get_running_loop()
    tls = ssl.create_default_context() if origin.tls else None
    try:
        async with asyncio.timeout(connect_timeout):
            transport, reader = await loop.create_connection(
                lambda: _Head(limit, protocol),
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
            answer = await reader.done
    except TimeoutError as exc:
        transport.abort()
        raise HeadTimeout(f"no response head within {head_timeout:g} s") from exc
    except BaseException:
        transport.abort()
        raise
    if answer.pipe is None and answer.streamed is None:
        transport.close()
    return answer
