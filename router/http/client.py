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
was garbled; `before_head` says whether the response head had come,
`answered` whether any byte of an answer had, `unsent` whether the
connection ended before the request had gone out whole: only such a
request may be sent again), and a replica's HTTP status is never an
exception here. A replica that misbehaves (bytes nobody asked for, a head
without end, a body that stops mid-way, a protocol switch) costs its
connection, never the next request's answer, and is counted by reason in
`Client.protocol_errors`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import select
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import httptools

from router.core.origin import Origin
from router.http.protocol_errors import ProtocolErrors

# Above this many bytes queued for a reader that is not taking them, the
# replica's connection stops being read, so TCP pushes back to the replica.
_HIGH_WATER = 256 * 1024

# What a replica may send before its final response head (status line and
# header fields, interim answers included), and between two pieces of a
# chunked body (chunk framing and trailers). llhttp itself has no limit, and
# httptools joins a field's pieces with `+=`: without a bound, an endless
# line costs memory without end and CPU quadratic in its length.
MAX_HEAD_BYTES = 64 * 1024
# One line of that head.
MAX_HEAD_LINE = 16 * 1024
# The least a head takes besides its reason and fields: "HTTP/1.1 200 ",
# the status line's CRLF, and the blank line.
_HEAD_FRAMING = len(b"HTTP/1.1 200 \r\n\r\n")


class ConnectFailed(Exception):
    """No connection could be made: the request was not sent."""


class HeadTimeout(Exception):
    """The replica sent no response head within the deadline."""


class ConnectionBroken(Exception):
    """The connection ended or sent something that is not HTTP.

    `before_head`: no response head had been handed to the caller.
    `answered`: some bytes of an answer had arrived for this request, so the
    replica has seen it and may have acted on it: it must not be sent again.
    Unless given, `answered` is true exactly when the head had come.
    `unsent`: the connection ended while part of the request was still
    waiting to go out, with nothing answered: the replica never had the
    whole request, so it cannot have acted on it. Only such a request may
    be sent again; one written whole and then met by a close may have been
    read, run, and crashed the replica (Go's transport retries a POST only
    on its `nothingWrittenError`; nginx passes a POST whose request was
    sent to no next server unless told `non_idempotent`).
    """

    def __init__(self, message: str, *, before_head: bool, answered: bool | None = None, unsent: bool = False) -> None:
        super().__init__(message)
        self.before_head = before_head
        self.answered = not before_head if answered is None else answered
        self.unsent = unsent


class HeadTooLarge(ConnectionBroken):
    """The replica's response head went past MAX_HEAD_BYTES."""

    def __init__(self, message: str) -> None:
        super().__init__(message, before_head=True, answered=True)


class BodyTooLarge(ConnectionBroken):
    """An answer read whole went past the caller's limit: never buffered without bound."""

    def __init__(self, message: str) -> None:
        super().__init__(message, before_head=False, answered=True)


class UpstreamIdle(ConnectionBroken):
    """The replica sent nothing for longer than the idle timeout in the middle of a body."""

    def __init__(self, message: str) -> None:
        super().__init__(message, before_head=False, answered=True)


# What a reason phrase may not hold (RFC 9112 4: HTAB, SP, VCHAR, obs-text only).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line_problem(version: str, status: int, reason: bytes) -> str | None:
    """What is wrong with an answer's status line, if anything: the version, the status, the reason."""
    if version not in ("1.1", "1.0"):
        return f"the replica answered in HTTP/{version}"
    if not 200 <= status <= 599:
        return f"the replica answered with status {status}"
    if _CONTROL.search(reason) is not None:
        return f"the replica's reason phrase holds a control character: {reason!r}"
    return None


def _chunked_alone(coding: bytes) -> bool:
    """Whether a Transfer-Encoding value is `chunked` and nothing else (any case, any spaces)."""
    return [token.strip().lower() for token in coding.split(b",")] == [b"chunked"]


class _Stop(Exception):
    """Raised in a parser callback to stop llhttp in the middle of a read.

    The callback has already dealt with the connection (counted, failed,
    closed); httptools turns this into an HttpParserCallbackError out of
    feed_data, which data_received recognises by the closed state.
    """


class _State(enum.Enum):
    # No request in progress: new, or in the pool. Any byte now is unsolicited.
    IDLE = "idle"
    # Request sent, no response head yet (the first-byte timer's time).
    ACTIVE = "active"
    # Head handed over, body in progress (the idle sweep's time).
    BODY = "body"
    # Answer complete, not yet released. Any byte now is a second answer.
    DONE = "done"
    CLOSED = "closed"


# Module-level names: the per-read state checks are one global load and an `is`.
_IDLE = _State.IDLE
_ACTIVE = _State.ACTIVE
_BODY = _State.BODY
_DONE = _State.DONE
_CLOSED = _State.CLOSED


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
        "transfer_encoding",
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
        coding: bytes | None = None
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                try:
                    self.content_length = int(value)
                except ValueError:
                    self.content_length = None
            elif lower == b"transfer-encoding":
                coding = value if coding is None else coding + b", " + value
        # Every Transfer-Encoding field's value, joined as one list.
        self.transfer_encoding = coding
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

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; raises ConnectionBroken if it was cut short, BodyTooLarge past `limit` bytes."""
        while not self._done:
            if limit is not None and self._queued > limit:
                self._connection._abort()
                raise BodyTooLarge(f"the replica's answer is over {limit} bytes")
            self._connection.resume()
            await self._wait()
        if limit is not None and self._queued > limit:
            raise BodyTooLarge(f"the replica's answer is over {limit} bytes")
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
        self.state = _IDLE
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self._status_line = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self.reusable = False
        self.paused = False
        # Part of the request still waits in the transport's buffer: the
        # transport's high-water mark is 0, so it says so the moment a write
        # is not taken whole by the kernel, and again once all of it is.
        self.sending = False
        # Asks the kernel whether anything (an end, a reset, bytes) waits
        # unread on the connection: what the event loop may not have seen yet.
        self.readable = select.poll()
        self.idle_since = 0.0
        # Reads so far: the idle sweep's evidence of life, and (against
        # `_reads_at_send`) whether any byte came back for this request.
        self.reads = 0
        self._reads_at_send = 0
        # The sweep's view: `reads` when last seen (-1: not seen yet, or
        # paused) and since when (loop time) it has not changed.
        self.seen_reads = -1
        self.quiet_since = 0.0
        # Bytes of the head so far (as the parser reports its fields, and as
        # reads arrive), and of reads in the body that carried no body byte.
        # Interim heads count towards the bound of what may come before the
        # answer's own head: `_head_bytes` goes on across them, and
        # `_interim_bytes` is their exact size.
        self._head_bytes = 0
        self._interim_bytes = 0
        # The read being parsed while no head has come (its size bounds the
        # head; its first bytes are the status line of a head it begins).
        self._read = b""
        self._line = 0
        self._framing_bytes = 0
        # Body bytes parsed from the current read, handed on as one piece
        # after it: a read holding many SSE events costs one client write.
        self._body: list[bytes] = []
        self._deadline: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<_Connection {self.origin.key} {self.state.value}{' paused' if self.paused else ''}>"

    # asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.readable.register(sock.fileno(), select.POLLIN)

    def pause_writing(self) -> None:
        self.sending = True

    def resume_writing(self) -> None:
        self.sending = False

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        state = self.state
        if state is not _BODY:
            if state is not _ACTIVE:
                self._stray(state)
                return
            self._read = data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._body.clear()
            if self.state is not _CLOSED:  # else a callback has already stopped it
                self._fail("invalid_response", self._broken(f"the replica's answer is not valid HTTP: {exc}"))
            return
        except httptools.HttpParserUpgrade:
            # No HttpParserError, so it would escape to asyncio (a traceback
            # in the log). on_headers_complete stops a 101 before llhttp
            # raises this: a safety net.
            self._body.clear()
            if self.state is not _CLOSED:
                self._switched()
            return
        if self._body:
            self._framing_bytes = 0
            self._flush()
        elif state is _BODY and self.state is _BODY:
            # A read in the body without a byte of it, and not its end (whose
            # last piece on_message_complete took): chunk framing or trailers.
            self._framing_bytes += len(data)
            if self._framing_bytes > MAX_HEAD_BYTES:
                self._fail(
                    "trailers_too_large",
                    ConnectionBroken(
                        f"the replica sent over {MAX_HEAD_BYTES} bytes of chunk framing or trailers",
                        before_head=False,
                    ),
                )
        elif self.state is _ACTIVE:
            # Counted per read, not per completed field: an endless header
            # line never completes, and httptools grows it with `+=`.
            if not self._head_bytes:
                self._line = 0
            self._head_bytes += len(data)
            # And the line still arriving, which httptools copies whole on
            # every read that adds to it: bounded, so is the copying.
            newline = data.rfind(b"\n")
            self._line = len(data) - newline - 1 if newline >= 0 else self._line + len(data)
            if self._head_bytes > MAX_HEAD_BYTES or self._line > MAX_HEAD_LINE:
                self._fail("head_too_large", HeadTooLarge(f"the replica's head is over {MAX_HEAD_BYTES} bytes"))

    def _flush(self) -> None:
        body = self._body
        piece = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        # Never an empty piece: downstream, b"" is framed as a chunked last-chunk.
        if piece and self.response is not None:
            self.response._feed(piece)

    def _stray(self, state: _State) -> None:
        """Bytes with no request waiting for them: never parsed as the next answer."""
        if state is _IDLE:
            self._fail("unsolicited_bytes", None, "bytes arrived on an idle connection")
        elif state is _DONE:
            self._fail("bytes_after_answer", None, "bytes arrived after the end of the answer")

    def eof_received(self) -> bool:
        # Not fed to the parser: a body delimited by the end of the connection
        # ends in connection_lost, and feed_data(b"") only yields on_body(b"").
        if self.sending and self.state is _ACTIVE and self.transport is not None:
            # The replica hung up before the request had gone out whole. A
            # close would go on writing the rest to no one, and once that
            # was done the request would look sent; an abort drops it now,
            # and connection_lost finds it unsent.
            self.transport.abort()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        state = self.state
        self.state = _CLOSED
        self._stop_deadline()
        if state is _BODY:
            if self._body:
                self._flush()
            response = self.response
            assert response is not None
            # A body without a length ends with the connection (RFC 9112 6.3):
            # a clean close, that is; a reset cuts it short, and it must look so.
            if exc is None and response.content_length is None and response.transfer_encoding is None:
                response._finish()
            else:
                response._finish(
                    ConnectionBroken(f"the replica closed the connection: {exc or 'EOF'}", before_head=False)
                )
        elif state is _ACTIVE:
            head = self.head
            if head is not None and not head.done():
                answered = self.reads != self._reads_at_send
                head.set_exception(
                    ConnectionBroken(
                        f"the replica closed the connection before answering: {exc or 'EOF'}",
                        before_head=True,
                        answered=answered,
                        unsent=self.sending and not answered,
                    )
                )
        # IDLE and DONE lose nothing; CLOSED was ended (and the request failed) by this side.
        self.client._forget(self)

    # httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.state is not _ACTIVE:
            # A second answer behind the first in the same read: the first
            # was delivered (on_message_complete); this one is nobody's.
            self._stray(self.state)
            raise _Stop

    def on_status(self, status: bytes) -> None:
        self._status_line += status

    def _head_size(self) -> int:
        """The head's size as parsed: what its fields and reason hold, with the least framing they take."""
        return _HEAD_FRAMING + len(self._status_line) + sum(len(name) + len(value) + 4 for name, value in self._headers)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state is not _ACTIVE:
            # A chunked body's trailer field: never a header of the response,
            # which the proxy may already have passed on.
            return
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        # A head that came whole in one read was never counted as it arrived:
        # counted now, where that read could have held more than the bound
        # (with the interim heads before it: a stream of 103s in one read).
        read = self._read
        spanned = self._head_bytes
        if spanned + len(read) > MAX_HEAD_BYTES and self._interim_bytes + self._head_size() > MAX_HEAD_BYTES:
            self._fail("head_too_large", HeadTooLarge(f"the replica's head is over {MAX_HEAD_BYTES} bytes"))
            raise _Stop
        status = self.parser.get_status_code()
        if status < 200:
            if status < 100:
                # 099 parses as three digits, but no such status exists (RFC 9110 15).
                self._fail("invalid_response", self._broken(f"the replica answered with status {status:03d}"))
                raise _Stop
            if status == 101:
                self._switched()
                raise _Stop
            # An interim answer (100 Continue, 103 Early Hints): the real one
            # follows. Dropped, not forwarded: passing anything to the client
            # would commit it to this attempt, so no retry could follow. Its
            # bytes stay counted: the bound is on all that comes before the
            # answer, or endless 103s would be endless memory and parsing.
            self._interim_bytes += self._head_size()
            self._status_line = b""
            self._headers = []
            return
        reason = self._status_line
        # llhttp passes HTTP/2.0 and HTTP/0.9, any three digits, and any byte
        # but CR and LF in the reason, which would reach the client's status
        # line. The usual head is seen to be right by its bytes: the first of
        # this answer, begun by this read, "HTTP/1.1 ... OK" (of the versions
        # llhttp takes, 0.9, 1.0, 1.1 and 2.0, only 1.1 has a "1" at [7]).
        # Any other is checked field by field (the version costs a string).
        if status > 599 or reason != b"OK" or spanned or self._interim_bytes or read[7] != 49:
            problem = _status_line_problem(self.parser.get_http_version(), status, reason)
            if problem is not None:
                self._fail("invalid_response", self._broken(problem))
                raise _Stop
        # The next request's head is counted from nothing, and the read is
        # let go (a pooled connection would keep up to 256 KiB alive).
        self._head_bytes = 0
        self._interim_bytes = 0
        self._read = b""
        response = Response(self, status, reason, self._headers)
        coding = response.transfer_encoding
        if coding is not None and coding != b"chunked" and not _chunked_alone(coding):
            # llhttp takes off the chunks of `gzip, chunked` and reads `gzip`
            # alone to the end of the connection, and the client would get
            # the coded body under a head that no longer names the coding
            # (the hop-by-hop field is not passed on). The client side
            # refuses such codings with 501; here the replica is at fault.
            shown = coding.decode("latin-1")
            self._fail(
                "transfer_encoding",
                self._broken(f"the replica's answer has Transfer-Encoding {shown!r}; only chunked is decoded"),
            )
            raise _Stop
        self._stop_deadline()
        self.response = response
        self.state = _BODY
        client = self.client
        if client._watch is None:
            client._watch = self.loop.call_later(client._watch_every, client._watch_idle)
        head = self.head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or self.state is not _BODY:
            return  # the end of an interim answer (still ACTIVE)
        if self._body:
            self._flush()
        self.state = _DONE
        self.reusable = self.parser.should_keep_alive()
        response._finish()

    # Flow control --------------------------------------------------------------------

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and self.state is not _CLOSED:
            self.paused = False
            self.transport.resume_reading()

    # The client's side ---------------------------------------------------------------

    def send(self, data: bytes, head_timeout: float | None) -> asyncio.Future[Response]:
        assert self.transport is not None
        assert self.state is _IDLE, self
        loop = self.loop
        self.state = _ACTIVE
        self.reusable = False
        self.response = None
        self._status_line = b""
        self._headers = []
        self._reads_at_send = self.reads
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

    def went_quiet(self, seconds: float) -> None:
        """The idle sweep's verdict: the body stopped coming."""
        self._fail(
            "idle_timeout", UpstreamIdle(f"the replica sent nothing for {seconds:g} s in the middle of its answer")
        )

    def response_released(self, response: Response) -> None:
        if response is not self.response:
            return
        self.response = None
        self.head = None
        if self.state is _DONE and self.reusable and not self.sending:
            self.state = _IDLE
            self.resume()
            self.client._idle_again(self)
        elif self.sending:
            # The replica answered before it had the whole request: the rest
            # would reach it as the start of the next one. Dropped unsent.
            self._abort()
        else:
            # Half read (BODY), or the replica said close: never reused.
            self.close()

    def close(self) -> None:
        if self.state is not _CLOSED:
            self.state = _CLOSED
            self._stop_deadline()
            if self.transport is not None:
                self.transport.close()
            self.client._forget(self)

    def abandon(self) -> None:
        """The caller gave up before the head (timeout, client gone): never reuse."""
        self.response = None
        self.head = None
        self._abort()

    def _abort(self) -> None:
        if self.state is not _CLOSED:
            self.state = _CLOSED
            self._stop_deadline()
            if self.transport is not None:
                self.transport.abort()
            self.client._forget(self)

    def _switched(self) -> None:
        self._fail(
            "switched_protocols",
            ConnectionBroken(
                "the replica switched protocols (101) instead of answering", before_head=True, answered=True
            ),
        )

    def _broken(self, message: str) -> ConnectionBroken:
        """The error for the request in progress, before or after its head."""
        if self.state is _ACTIVE:
            return ConnectionBroken(message, before_head=True, answered=self.reads != self._reads_at_send)
        return ConnectionBroken(message, before_head=False)

    def _fail(self, reason: str, error: ConnectionBroken | None, detail: str = "") -> None:
        """A replica's protocol error: count it, end the request in progress with `error`, drop the connection.

        `reason` is one of a fixed set (the metric's label); the connection
        is aborted, never pooled, so nothing it sent can reach another request.
        """
        self.client.protocol_errors.record(reason, f"replica {self.origin.key}: {error or detail}")
        if error is not None:
            head = self.head
            if head is not None and not head.done():
                head.set_exception(error)
            elif self.response is not None:
                # A no-op if the answer was already complete.
                self.response._finish(error)
        self._body.clear()
        self._abort()


class Client:
    """Keep-alive connection pools, one per origin, for every replica."""

    def __init__(self, *, connect_timeout: float, keepalive_seconds: float, idle_timeout: float = 300.0) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_seconds = keepalive_seconds
        # Longest silence of a replica in the middle of a body.
        self.idle_timeout = idle_timeout
        self._idle: dict[str, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        # The one timer that watches every connection with a body in progress
        # for silence: no timer, no clock call per chunk.
        self._watch: asyncio.TimerHandle | None = None
        self._watch_every = min(max(idle_timeout / 4, 0.05), 5.0)
        self.protocol_errors = ProtocolErrors(logging.getLogger("router.http.client"), level=logging.WARNING)

    async def request(self, origin: Origin, head: bytes, body: bytes, head_timeout: float | None = None) -> Response:
        """Send one request (head already framed) and wait for the response head.

        Raises ConnectFailed; HeadTimeout when no head came within
        `head_timeout` seconds of sending; or ConnectionBroken(before_head=True)
        when the connection ended or garbled before the head (`answered` if
        any of an answer had come). A kept-alive connection that the replica
        closed before the request had gone out whole (`unsent`) is the one
        break retried, once, on a fresh connection; one the replica had
        already closed when it was picked is not used at all.
        """
        connection = self._reuse(origin)
        if connection is not None:
            try:
                return await self._exchange(connection, head, body, head_timeout)
            except ConnectionBroken as exc:
                # A request written whole may have been read and acted on,
                # answer or not (a POST, a paid generation, a prompt that
                # kills the engine): never sent again, here or elsewhere.
                if not exc.unsent:
                    raise
                # The keep-alive race: the replica closed the idle connection
                # before the request had gone out whole. Once more, on a fresh
                # connection (a refusal now is honest: nothing was sent).
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
            # Anything readable on an idle connection ends it: most often the
            # replica's close, already in the kernel but not yet seen by the
            # event loop. Found now, it costs nothing; found after the request
            # went out, it would cost the request (Go's errServerClosedIdle is
            # the same close, seen by its reader while the connection idles).
            if connection.idle_since >= cutoff and connection.state is _IDLE and not connection.readable.poll(0):
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
        if protocol.state is not _IDLE:
            # Between the connection and this line the replica spoke first
            # (counted, closed) or hung up: nothing was sent yet.
            raise ConnectFailed("the connection ended before the request went out")
        self._all.add(protocol)
        return protocol

    def _idle_again(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin.key, []).append(connection)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive_seconds, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle longer than the keep-alive, before the replica does.

        Each origin's list is replaced before any of its connections is
        closed: close() takes a connection out of the list it is in, and a
        list changed while it is walked skips every other connection, which
        then stays open for good. The next sweep is due when the oldest
        connection left reaches the keep-alive (each list is in the order
        its connections went idle), not a whole period later, so none
        outlives it by more than a timer's lateness.
        """
        self._sweeper = None
        now = time.monotonic()
        cutoff = now - self.keepalive_seconds
        stale: list[_Connection] = []
        due: float | None = None
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if c.idle_since > cutoff and c.state is _IDLE]
            if len(keep) < len(idle):
                stale.extend(c for c in idle if c.idle_since <= cutoff or c.state is not _IDLE)
            if keep:
                self._idle[key] = keep
                oldest = keep[0].idle_since
                due = oldest if due is None else min(due, oldest)
            else:
                del self._idle[key]
        for connection in stale:
            connection.close()
        if due is not None:
            delay = max(due + self.keepalive_seconds - now, 0.0)
            self._sweeper = asyncio.get_running_loop().call_later(delay, self._sweep)

    def _watch_idle(self) -> None:
        """End bodies whose replica went quiet: one sweep for every connection with a body in progress.

        A connection counts its reads; a count unchanged since the last
        sweep is silence, timed from the sweep that first saw it unchanged
        (so never cut before `idle_timeout`, at most two sweeps after). A
        paused connection is waiting for the proxy's client, not the
        replica: skipped, and its quiet time starts afresh once resumed.
        """
        self._watch = None
        busy = [c for c in self._all if c.state is _BODY]
        if not busy:
            return  # no timer while no body is in progress
        loop = asyncio.get_running_loop()
        now = loop.time()
        limit = self.idle_timeout
        quiet: list[_Connection] = []
        for connection in busy:
            if connection.paused:
                connection.seen_reads = -1
            elif connection.reads != connection.seen_reads:
                connection.seen_reads = connection.reads
                connection.quiet_since = now
            elif now - connection.quiet_since > limit:
                quiet.append(connection)
        for connection in quiet:
            connection.went_quiet(limit)
        self._watch = loop.call_later(self._watch_every, self._watch_idle)

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
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        # One loop turn so that the transports' close callbacks run.
        await asyncio.sleep(0)
