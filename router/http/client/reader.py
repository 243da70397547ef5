"""One upstream connection's reading: each answer parsed by llhttp, its status line checked, within bounds.

A replica that misbehaves (bytes nobody asked for, a head without end, a
body that stops mid-way, a protocol switch, a status line llhttp lets through
but no HTTP/1.1 client should take) costs its connection, never the next
request's answer, and is counted by reason. What may come before an answer's
head (its status line, header fields, interim answers) is bounded, and so is
what comes between two pieces of a chunked body (chunk framing, trailers):
llhttp has no limit of its own, and httptools joins a field's pieces with
`+=`, so an endless line would cost memory without end and CPU quadratic in
its length. Body bytes parsed from one read are handed on as one piece.

ResponseReader is the object llhttp calls back: it reads into its
connection's Exchange (exchange.py), and hands what a replica does wrong to
the connection (connection.py) through a small interface, Faulted; it
imports neither the connection nor the pool.
"""

from __future__ import annotations

import re
from typing import Final, Protocol

import httptools

from router.http.client.errors import ConnectionBroken, HeadTooLarge
from router.http.client.exchange import ACTIVE, BODY, CLOSED, DONE, IDLE, Exchange, State
from router.http.client.response import Response, Source
from router.http.client.watch import Watch

# What a replica may send before its final response head (status line and
# header fields, interim answers included), and between two pieces of a
# chunked body (chunk framing and trailers).
# (Final, here and below: a compiled module reads them as constants, not from its dict.)
MAX_HEAD_BYTES: Final = 64 * 1024
# One line of that head.
MAX_HEAD_LINE: Final = 16 * 1024
# The least a head takes besides its reason and fields: "HTTP/1.1 200 ",
# the status line's CRLF, and the blank line.
_HEAD_FRAMING: Final = len(b"HTTP/1.1 200 \r\n\r\n")

# What a reason phrase may not hold (RFC 9112 4: HTAB, SP, VCHAR, obs-text only).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def status_line_problem(version: str, status: int, reason: bytes) -> str | None:
    """What is wrong with an answer's status line, if anything: the version, the status, the reason."""
    if version not in ("1.1", "1.0"):
        return f"the replica answered in HTTP/{version}"
    if not 200 <= status <= 599:
        return f"the replica answered with status {status}"
    if _CONTROL.search(reason) is not None:
        return f"the replica's reason phrase holds a control character: {reason!r}"
    return None


def chunked_alone(coding: bytes) -> bool:
    """Whether a Transfer-Encoding value is `chunked` and nothing else (any case, any spaces)."""
    return [token.strip().lower() for token in coding.split(b",")] == [b"chunked"]


class _Stop(Exception):
    """Raised in a parser callback to stop llhttp in the middle of a read.

    The callback has already dealt with the connection (counted, failed,
    closed); httptools turns this into an HttpParserCallbackError out of
    feed_data, which data_received recognises by the closed state.
    """


class Faulted(Source, Protocol):
    """What the reader needs of its connection: the source of the answers it reads, and where a
    replica's faults go (each costs the connection, counted by reason)."""

    def fail(self, reason: str, error: ConnectionBroken | None, detail: str = "") -> None: ...
    def broken(self, message: str) -> ConnectionBroken: ...
    def switched(self) -> None: ...


class ResponseReader:
    """What llhttp calls back on one upstream connection: each answer read, checked within bounds, and handed on."""

    __slots__ = (
        "_body",
        "_framing_bytes",
        "_head_bytes",
        "_headers",
        "_interim_bytes",
        "_line",
        "_read",
        "_status_line",
        "connection",
        "exchange",
        "parser",
        "watch",
    )

    def __init__(self, connection: Faulted, exchange: Exchange, watch: Watch) -> None:
        self.connection = connection
        self.exchange = exchange
        # Started when a head comes, if not running: the silence of a body is watched for.
        self.watch = watch
        self.parser = httptools.HttpResponseParser(self)
        self._status_line = b""
        self._headers: list[tuple[bytes, bytes]] = []
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

    def drop(self) -> None:
        """The connection failed: body bytes of the read in progress go to no one."""
        self._body.clear()

    # Reads ----------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """One read off the connection, parsed; whatever it holds of an answer handed on."""
        exchange = self.exchange
        state = exchange.state
        if state is not BODY:
            if state is not ACTIVE:
                self._stray(state)
                return
            self._read = data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._body.clear()
            if exchange.state is not CLOSED:  # else a callback has already stopped it
                self.connection.fail(
                    "invalid_response", self.connection.broken(f"the replica's answer is not valid HTTP: {exc}")
                )
            return
        if self._body:
            self._framing_bytes = 0
            self._flush()
        elif state is BODY and exchange.state is BODY:
            # A read in the body without a byte of it, and not its end (whose
            # last piece on_message_complete took): chunk framing or trailers.
            self._framing_bytes += len(data)
            if self._framing_bytes > MAX_HEAD_BYTES:
                self.connection.fail(
                    "trailers_too_large",
                    ConnectionBroken(
                        f"the replica sent over {MAX_HEAD_BYTES} bytes of chunk framing or trailers",
                        before_head=False,
                    ),
                )
        elif exchange.state is ACTIVE:
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
                self.connection.fail(
                    "head_too_large", HeadTooLarge(f"the replica's head is over {MAX_HEAD_BYTES} bytes")
                )

    def _flush(self) -> None:
        body = self._body
        piece = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        # (Body bytes come only after the head, and llhttp hands no empty span:
        # downstream, b"" would be a chunked last-chunk, and every writer drops it.)
        response = self.exchange.response
        assert response is not None
        response._feed(piece)

    def _stray(self, state: State) -> None:
        """Bytes with no request waiting for them (IDLE, or DONE: a closed connection is
        read no more): never parsed as the next answer."""
        if state is IDLE:
            self.connection.fail("unsolicited_bytes", None, "bytes arrived on an idle connection")
        else:
            self.connection.fail("bytes_after_answer", None, "bytes arrived after the end of the answer")

    # httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        state = self.exchange.state
        if state is not ACTIVE:
            # A second answer behind the first in the same read: the first
            # was delivered (on_message_complete); this one is nobody's.
            self._stray(state)
            raise _Stop

    def on_status(self, status: bytes) -> None:
        self._status_line += status

    def _head_size(self) -> int:
        """The head's size as parsed: what its fields and reason hold, with the least framing they take."""
        return _HEAD_FRAMING + len(self._status_line) + sum(len(name) + len(value) + 4 for name, value in self._headers)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.exchange.state is not ACTIVE:
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
            self.connection.fail("head_too_large", HeadTooLarge(f"the replica's head is over {MAX_HEAD_BYTES} bytes"))
            raise _Stop
        status = self.parser.get_status_code()
        if status < 200:
            if status < 100:
                # 099 parses as three digits, but no such status exists (RFC 9110 15).
                self.connection.fail(
                    "invalid_response", self.connection.broken(f"the replica answered with status {status:03d}")
                )
                raise _Stop
            if status == 101:
                self.connection.switched()
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
            problem = status_line_problem(self.parser.get_http_version(), status, reason)
            if problem is not None:
                self.connection.fail("invalid_response", self.connection.broken(problem))
                raise _Stop
        # The next request's head is counted from nothing, and the read is
        # let go (a pooled connection would keep up to 256 KiB alive).
        self._head_bytes = 0
        self._interim_bytes = 0
        self._read = b""
        headers = self._headers
        self._status_line = b""
        self._headers = []
        response = Response(self.connection, status, reason, headers)
        coding = response.transfer_encoding
        if coding is not None and coding != b"chunked" and not chunked_alone(coding):
            # llhttp takes off the chunks of `gzip, chunked` and reads `gzip`
            # alone to the end of the connection, and the client would get
            # the coded body under a head that no longer names the coding
            # (the hop-by-hop field is not passed on). The client side
            # refuses such codings with 501; here the replica is at fault.
            shown = coding.decode("latin-1")
            self.connection.fail(
                "transfer_encoding",
                self.connection.broken(
                    f"the replica's answer has Transfer-Encoding {shown!r}; only chunked is decoded"
                ),
            )
            raise _Stop
        exchange = self.exchange
        exchange.head_due = 0.0
        exchange.response = response
        exchange.state = BODY
        # The replica's silence in the middle of the body is watched for from here
        # (by the sweep that watched for the head, if one did).
        watch = self.watch
        if watch.timer is None:
            watch.start()
        head = exchange.head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        response = exchange.response
        if response is None or exchange.state is not BODY:
            return  # the end of an interim answer (still ACTIVE)
        if self._body:
            self._flush()
        exchange.state = DONE
        exchange.reusable = self.parser.should_keep_alive()
        response._finish()
