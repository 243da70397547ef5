"""The client port's HTTP/1.1 server, on asyncio.Protocol and llhttp (httptools).

aiohttp's server spent, per short request, about as much CPU in Python as
the whole router's own logic: a request object with lazy properties, a task
and a response object per request, header multidicts both ways. The client
port needs a few routes of plain HTTP/1.1, so this module does only that,
and holds the line a hostile client pushes on:

- requests are parsed by llhttp in strict mode (the parser aiohttp uses):
  conflicting lengths, bare LF, obs-fold, NUL, a negative length are 400
  and the connection is closed. RFC 9110's and 9112's other rules are
  checked on top: one valid Host on HTTP/1.1 (400), no userinfo in the
  target (400), Transfer-Encoding on HTTP/1.0 (400), a final coding other
  than chunked or chunked twice (400), any coding but chunked (501), a
  method other than RFC 9110's and PATCH (501), HTTP/1.x above 1.1 served
  as 1.1 and other majors refused (505), CONNECT (405); an Upgrade is
  ignored and the request answered as HTTP/1.1 (RFC 9110 7.8);
- heads are bounded as their bytes arrive, not once a field is complete
  (httptools joins a field's pieces with `+=`, quadratic for an endless
  line): a target over 8 KiB is 414, a header line over 8 KiB, a head over
  64 KiB or more than 100 fields 431;
- deadlines, all checked by one sweep (no timer per request): a head must
  arrive whole within `header_timeout` of its first byte (slowloris), a body
  within `body_timeout` of its head (408), an idle keep-alive connection is
  closed after `keepalive_timeout`, and an answer the client does not read
  for `write_stall_timeout` is cut off (whole answers and streams alike);
- bodies are bounded per request (413) and across all connections together
  (`max_buffered_body_bytes`: 503 at once beyond it); a refused body is read
  and dropped so that the client reads the answer, then the connection closes;
- trailer fields of a chunked body are dropped, never merged into the head
  (RFC 9110 6.5.1); so is the fragment of a request target;
- one handler task per request, run in order: a pipelined request waits (at
  most one is held ahead), `Expect: 100-continue` is answered only when its
  request is the one being answered, and a bad request behind good ones is
  answered after them, then the connection closes; when the client goes
  away the task is cancelled, and with it the upstream request;
- a whole answer is one write; a stream writes its head, then chunks
  (chunked framing on HTTP/1.1, delimited by close on HTTP/1.0); a stream
  that breaks is closed without its last-chunk, so that it looks broken;
- shutdown: stop accepting, close idle connections, let running requests
  finish within the grace, then cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import enum
import itertools
import logging
import os
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import Protocol, cast

import httptools

from router.http.protocol_errors import ProtocolErrors

MAX_LINE = 8190
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
# The method, spaces and version around a target: a request line longer than
# the longest target by more than this is a header line, answered 431.
_REQUEST_LINE_SLACK = 32
# Reads larger than this are parsed in slices of it (see data_received):
# the most a client pipelining ahead gets parsed behind the running request.
_SLICE = 4096
# After a refused body: how long the client may go on sending what it started.
_DISCARD_SECONDS = 2.0

log = logging.getLogger("router.http.server")

_REASONS = {
    100: b"Continue",
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    501: b"Not Implemented",
    505: b"HTTP Version Not Supported",
}

# The request fields the server itself reads, by name as sent (the usual
# spellings) or lowered; any other name is passed over with one lookup.
_F_HOST, _F_LENGTH, _F_CODINGS, _F_EXPECT, _F_CONNECTION, _F_UPGRADE, _F_REQUEST_ID, _F_CAPTURED = range(8)
_FIELDS: dict[bytes, int] = {}


def _spellings(lower: bytes) -> tuple[bytes, bytes]:
    """A lowered name as clients usually send it: lowered, and capitalized (Content-Length)."""
    return lower, b"-".join(part.capitalize() for part in lower.split(b"-"))


for _kind, _name in (
    (_F_HOST, b"host"),
    (_F_LENGTH, b"content-length"),
    (_F_CODINGS, b"transfer-encoding"),
    (_F_EXPECT, b"expect"),
    (_F_CONNECTION, b"connection"),
    (_F_UPGRADE, b"upgrade"),
    (_F_REQUEST_ID, b"x-request-id"),
):
    for _spelling in _spellings(_name):
        _FIELDS[_spelling] = _kind

# A client's X-Request-Id is kept when it is short and visible ASCII; else the server makes one.
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")

# Bytes tested by value (`b"#" in x` raises and clears a TypeError inside).
_HASH = ord("#")
_SLASH = ord("/")

# uri-host [ ":" port ] (RFC 9110 7.2, RFC 3986 3.2.2): a reg-name, an IPv4
# address or a bracketed IP literal. Empty is allowed (no authority).
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.vV]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::[0-9]*)?")

# RFC 9110's methods and PATCH (RFC 5789): any other is one the router does not
# implement, 501 (RFC 9110 9.1); llhttp knows more (WebDAV's, QUERY, ...) and
# refuses the rest outright.
_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"})
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
# A request line (RFC 9112 3, split on runs of SP as RFC 9112 3 allows), and
# the start of one: a method token and the space after it.
_REQUEST_LINE = re.compile(_TOKEN + rb" +[!-~]+ +HTTP/[0-9]\.[0-9]")
_METHOD_SP = re.compile(_TOKEN + rb" ")
# An absolute-form target with userinfo (RFC 9110 4.2.4: to be treated as an error).
_USERINFO = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@]*@")
# llhttp's settings, the same for every parser of a request stream. Whether a
# connection persists is decided from the head (RFC 9112 9.3): llhttp's own
# view heeds Proxy-Connection and trailers. Versions and transfer codings are
# judged by on_headers_complete (RFC 9110 2.5: HTTP/1.2 is served as 1.1;
# RFC 9112 6.1 and 6.3), never left to llhttp's lenient reading: a request
# whose coding llhttp does not take for chunked, but RFC 9110 does (OWS,
# an empty list element), is read as chunked by a fresh parser (on_body).
_LENIENCIES = {"lenient_keep_alive": True, "lenient_version": True, "lenient_transfer_encoding": True}


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


# The id of the request whose handler runs in the current task (b"": none), for
# its log lines: set once per request, read only when a line is written.
current_request_id: ContextVar[bytes] = ContextVar("current_request_id", default=b"")


class WriteStalled(ConnectionResetError):
    """The client took no bytes of its answer for the write-stall timeout: cut off."""


class Request:
    """One parsed request, body included."""

    __slots__ = (
        "body",
        "keep_alive",
        "method",
        "path",
        "peer",
        "captured",
        "raw_headers",
        "request_id",
        "reserved",
        "target",
        "version_11",
    )

    def __init__(
        self,
        peer: str,
        method: str,
        target: bytes,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        version_11: bool,
        reserved: int = 0,
        request_id: bytes = b"",
        captured: dict[bytes, bytes] | None = None,
    ) -> None:
        # The client's address as "host:port" (for the access log); "" when the transport has none.
        self.peer = peer
        self.method = method
        # The request target as sent (path and query), passed on as it is.
        self.target = target
        self.path = target.split(b"?", 1)[0].decode("utf-8", "surrogateescape")
        self.raw_headers = raw_headers
        self.body = body
        self.keep_alive = keep_alive
        self.version_11 = version_11
        # Body bytes counted against the server's max_buffered_body_bytes until it ends.
        self.reserved = reserved
        # The client's X-Request-Id, or one the server made: on every answer and log line.
        self.request_id = request_id
        # The server's `captured` headers this request has, by lowered name; None: none of them.
        self.captured = captured

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


Handler = Callable[[Request, "Writer"], Awaitable[None]]

# Judges a request by its head, before any of its body is read or a 100 sent
# (the app's API keys): a Reply refuses it. Called only for a head that announces
# a body, with the Request as it will be (its id and target) but no body yet.
HeadCheck = Callable[[Request], "Reply | None"]


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


def _request_target(pieces: list[bytes]) -> bytes:
    """The target as the handler gets it: no fragment, in origin form."""
    target = b"".join(pieces) if len(pieces) != 1 else pieces[0]
    if _HASH in target:
        # A fragment is the client's own business (RFC 9110 7.1).
        target = target.split(b"#", 1)[0]
    if target[0] != _SLASH and target[:4].lower() == b"http":
        target = _origin_form(target)
    return target


def _origin_form(target: bytes) -> bytes:
    """`http://host/path?q` as `/path?q`: a server MUST accept the absolute form (RFC 9112 3.2.2)."""
    scheme_end = target.find(b"://")
    if scheme_end < 0:
        return target
    rest = target[scheme_end + 3 :]
    ends = [i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0]
    if not ends:
        return b"/"
    start = min(ends)
    return rest[start:] if rest[start : start + 1] == b"/" else b"/" + rest[start:]


class _Refused(Exception):
    """Raised in a parser callback: the request gets `status`, then the connection closes.

    `reason` names the protocol error counted and logged (none for a head check's
    refusal, `reply`, which is no protocol error); `request_id` is the refused
    request's own, when it got one.
    """

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        code: str | None = None,
        *,
        reply: Reply | None = None,
        request_id: bytes = b"",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.code = code
        self.reply = reply
        self.request_id = request_id


class _StopParsing(Exception):
    """Raised in a parser callback to stop parsing what follows a request that ended the reading."""


class _Unframed(Exception):
    """Raised in on_body: llhttp reads a chunked body as one that runs to the close (see _LENIENCIES)."""


class _Begins:
    """A probe parser's protocol: counts the messages begun."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def on_message_begin(self) -> None:
        self.count += 1


def _begins(data: bytes) -> int:
    counter = _Begins()
    parser = httptools.HttpRequestParser(counter)
    parser.set_dangerous_leniencies(**_LENIENCIES)
    with contextlib.suppress(httptools.HttpParserError, httptools.HttpParserUpgrade):
        parser.feed_data(data)
    return counter.count


def unknown_method(data: bytes) -> bool:
    """`data` was read from a message boundary, and llhttp refused a method in it: is that
    method a token, in a request line (or the start of one still arriving)? Then it is a
    method the router does not know (501), not bytes that are no request at all (400).

    llhttp says neither where the refused message began nor what its method was; a
    probe parser fed ever longer starts of `data` finds the byte that began it. This runs
    only for a refused method, at most a dozen probes over a read's 4 KiB slice. (A
    method split across reads before its space is judged as it stands, and is 400.)
    """
    total = _begins(data)
    low, high = 1, len(data)
    while low < high:
        middle = (low + high) // 2
        if _begins(data[:middle]) >= total:
            high = middle
        else:
            low = middle + 1
    start = low - 1
    end = data.find(b"\r\n", start)
    if end < 0:
        return _METHOD_SP.match(data, start) is not None
    return _REQUEST_LINE.fullmatch(data, start, end) is not None


class Reading(enum.Enum):
    """What the connection expects from the client next."""

    HEAD = "head"  # a request head (or nothing yet: between requests)
    BODY = "body"  # the body of the request whose head arrived
    DISCARD = "discard"  # the rest of a refused body, read and dropped
    STOPPED = "stopped"  # nothing more: the connection closes after its answers


class Answering(enum.Enum):
    """What the connection does for the client."""

    IDLE = "idle"  # nothing to answer
    ACTIVE = "active"  # a handler runs
    CLOSING = "closing"  # the last answer is written; closing once it drained
    CLOSED = "closed"


class _Deadline(enum.Enum):
    NONE = 0
    HEAD = 1
    BODY = 2
    IDLE = 3
    DISCARD = 4


# Module-level names for the states: an Enum member read through its class
# goes through the metaclass's __getattr__ (about 60 ns), many times per request.
_R_HEAD = Reading.HEAD
_R_BODY = Reading.BODY
_R_DISCARD = Reading.DISCARD
_R_STOPPED = Reading.STOPPED
_A_IDLE = Answering.IDLE
_A_ACTIVE = Answering.ACTIVE
_A_CLOSING = Answering.CLOSING
_A_CLOSED = Answering.CLOSED
_D_NONE = _Deadline.NONE
_D_HEAD = _Deadline.HEAD
_D_BODY = _Deadline.BODY
_D_IDLE = _Deadline.IDLE
_D_DISCARD = _Deadline.DISCARD


class Connection(asyncio.Protocol):
    """One client connection: parse, run the handler per request in order, answer."""

    # Slots: thousands of connections may wait at once (held requests, open
    # streams), and a dict per connection would be most of their memory.
    __slots__ = (
        "_backlog",
        "_body",
        "_body_size",
        "_chunk_framed",
        "_chunked",
        "_continue_owed",
        "_deadline",
        "_deadline_kind",
        "_doomed",
        "_doomed_head_only",
        "_doomed_request_id",
        "_drained",
        "_framing",
        "_headers",
        "_in_head",
        "_keep_alive",
        "_keep_alive_request",
        "_line",
        "_method",
        "_paused",
        "_pending",
        "_refusal",
        "_captured",
        "_request_id",
        "_reserved",
        "_reserved_current",
        "_synthetic",
        "_target",
        "_target_size",
        "_unframed",
        "_upgrade_framing",
        "_head_version_11",
        "_write_deadline",
        "answering",
        "parser",
        "peer",
        "reading",
        "server",
        "task",
        "transport",
    )

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = self._new_parser()
        self.reading = _R_HEAD
        self.answering = _A_IDLE
        self._target: list[bytes] = []
        self._target_size = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        # Bytes of the current head: complete fields, and the line still arriving.
        self._in_head = False
        self._line = 0
        self._keep_alive_request = True
        self._method = b""
        self._request_id = b""
        self._captured: dict[bytes, bytes] | None = None
        # The body being read is chunked; bytes of framing read since its last data.
        self._chunked = False
        self._framing = 0
        # llhttp has read a chunk-size line of the chunked body being read (on_chunk_header):
        # until then, body bytes may be the raw chunks of a coding llhttp did not take for
        # chunked, and are handed to a fresh parser that does (_unframed).
        self._chunk_framed = False
        self._unframed: bytes | None = None
        # The version of the head being read; an answer's own is its Writer's.
        self._head_version_11 = True
        # An ignored Upgrade: llhttp hands the body over as the new protocol's
        # bytes, so a fresh parser is fed this framing to read it as a body.
        self._upgrade_framing: bytes | None = None
        self._synthetic = False
        # Set by a parser callback that refuses the request.
        self._refusal: _Refused | None = None
        self._pending: deque[Request] = deque()
        # Bytes read but not parsed: what came behind a queued request.
        self._backlog = b""
        self.task: asyncio.Task[None] | None = None
        # An answer owed after those queued ahead of it, then the connection
        # closes: a bad request behind good ones is answered in its turn.
        self._doomed: Reply | None = None
        self._doomed_head_only = False
        self._doomed_request_id = b""
        # A `100 Continue` owed to the request still arriving, sent when it is
        # the one being answered (never into another request's answer).
        self._continue_owed = False
        # Body bytes of this connection counted against the server's cap.
        self._reserved = 0
        self._reserved_current = 0
        # The read side's deadline and what it is for (monotonic; 0 = none), and
        # the write side's; one sweep over all connections checks both.
        self._deadline = 0.0
        self._deadline_kind = _D_NONE
        self._write_deadline = 0.0
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._keep_alive = True
        # The client's address, "host:port", read once when the connection is made.
        self.peer = ""

    @property
    def stopped(self) -> bool:
        """Nothing more is read on this connection."""
        return self.reading is _R_STOPPED

    def _new_parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(**_LENIENCIES)
        return parser

    def __repr__(self) -> str:
        return (
            f"<Connection {self.peer or '?'} reading={self.reading.value} answering={self.answering.value} "
            f"pending={len(self._pending)}{' doomed' if self._doomed is not None else ''}>"
        )

    # asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
        self.server.connections.add(self)
        # The first head must start and end within the head deadline.
        self._arm(self.server.header_timeout, _D_HEAD)

    def data_received(self, data: bytes) -> None:
        reading = self.reading
        if reading is _R_STOPPED:
            # After `Connection: close` or a refusal: whatever follows is not read.
            return
        if len(data) > _SLICE:
            self._feed_slices(data)
            return
        body_before = self._body_size
        in_head = self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            data = self._upgraded(data, exc.args[0])
        except httptools.HttpParserError as exc:
            data = self._parse_failed(exc, data, reading is _R_HEAD and not in_head)
        # A whole request in one read (the usual case) ends here: reading the
        # next head, not in one. Deadlines are armed only for what is unfinished.
        reading = self.reading
        if reading is _R_HEAD:
            if self._in_head:
                self._count_head_bytes(data)
        elif reading is _R_BODY:
            if not self._deadline and not self._continue_owed and not self._pending:
                self._arm(self.server.body_timeout, _D_BODY)
            if self._chunked:
                if self._body_size != body_before:
                    self._framing = 0
                else:
                    self._count_framing_bytes(data)

    def _feed_slices(self, data: bytes) -> None:
        """A large read, parsed a slice at a time, so that a client pipelining ahead
        is read only up to the first request queued behind the running one; the
        rest waits, unparsed, until that request starts."""
        end = len(data)
        start = 0
        while start < end:
            self.data_received(data[start : start + _SLICE])
            start += _SLICE
            if self.stopped:
                return
            if self._pending and start < end:
                self._backlog = data[start:]
                return

    def _upgraded(self, data: bytes, offset: int) -> bytes:
        """The request is complete (its Upgrade ignored), or its body is to be read
        anew (_unframed); what follows is HTTP/1.1 again: the body, if there is one,
        then more requests, for a fresh parser. The bytes parsed last."""
        while True:
            data = data[offset:]
            in_body = self._after_upgrade()
            if not data or self.reading is _R_STOPPED:
                return data
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                offset = exc.args[0]
                continue
            except httptools.HttpParserError as exc:
                return self._parse_failed(exc, data, not in_body)
            return data

    def _count_framing_bytes(self, data: bytes) -> None:
        """A read of a chunked body that carried none of it: chunk framing or trailers, bounded as a head is.

        Trailer fields are dropped, but httptools still gathers each one, with
        `+=`: without a bound an endless trailer line costs memory and CPU
        without end.
        """
        self._framing += len(data)
        newline = data.rfind(b"\n")
        self._line = len(data) - newline - 1 if newline >= 0 else self._line + len(data)
        if self._line > MAX_LINE or self._framing > MAX_HEAD:
            self._refuse(
                _Refused(431, "trailers_too_large", f"Chunk framing or trailers over {MAX_HEAD} bytes without data.")
            )

    def _head_size(self) -> int:
        """Bytes of the head's fields so far: counted only when it matters, not per field."""
        return self._target_size + sum(len(name) + len(value) + 4 for name, value in self._headers)

    def _count_head_bytes(self, data: bytes) -> None:
        """A head still arriving: its deadline runs; its current line and whole size are bounded now."""
        if self._deadline_kind is not _D_HEAD or not self._deadline:
            # The head's first read that did not end it: its line count begins, and
            # its deadline too, unless the router stopped reading behind a queued
            # request (then it begins when the router reads again: _resume_reading).
            if not self._pending:
                self._arm(self.server.header_timeout, _D_HEAD)
            self._line = 0
        newline = data.rfind(b"\n")
        self._line = len(data) - newline - 1 if newline >= 0 else self._line + len(data)
        if self._line > MAX_LINE + _REQUEST_LINE_SLACK:
            self._refuse(_Refused(431, "header_line_too_long", f"A header line is longer than {MAX_LINE} bytes."))
        elif self._head_size() + self._line > MAX_HEAD:
            self._refuse(_Refused(431, "head_too_large", f"The request head is larger than {MAX_HEAD} bytes."))

    def eof_received(self) -> bool:
        # A client that closes its side has left, as for aiohttp: the
        # connection closes and its request is cancelled, with the replica's.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.answering = _A_CLOSED
        self.reading = _R_STOPPED
        self._disarm()
        self._write_deadline = 0.0
        self._pending.clear()
        self._backlog = b""
        self._body = []
        self._unreserve(self._reserved)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._wake_drain(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._write_deadline = 0.0
        self._wake_drain(None)

    # llhttp callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._synthetic:
            return
        if self.reading is _R_STOPPED:
            # Nothing more is read on this connection: stop the parser here.
            raise _StopParsing
        # (The body list is emptied where the last one was taken; the line
        # count is begun where a head or a body's framing spans reads.)
        self._target = []
        self._target_size = 0
        self._headers = []
        self._body_size = 0
        self._reserved_current = 0
        self._in_head = True
        if self.reading is not _R_DISCARD:
            self.reading = _R_HEAD
            # An idle connection's deadline ends here; a head that does not
            # arrive whole in this read gets its own (data_received).
            self._deadline = 0.0

    def on_url(self, url: bytes) -> None:
        if self._synthetic:
            return
        self._target.append(url)
        self._target_size += len(url)
        if self._target_size > MAX_LINE:
            raise self._refused(414, "target_too_long", f"The request target is longer than {MAX_LINE} bytes.")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            # A trailer field of a chunked body: never merged into the head
            # (RFC 9110 6.5.1), where it could pass for Authorization.
            return
        if len(name) + len(value) > MAX_LINE:
            raise self._refused(431, "header_line_too_long", f"A header line is longer than {MAX_LINE} bytes.")
        self._headers.append((name, value))
        if len(self._headers) > MAX_HEADERS:
            raise self._refused(431, "too_many_headers", f"The request has more than {MAX_HEADERS} header fields.")

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._synthetic:
            # The same body read on by a fresh parser: its deadline, if it runs, runs on.
            self._synthetic = False
            self.reading = _R_BODY
            if not self._deadline and not self._continue_owed and not self._pending:
                self._arm(self.server.body_timeout, _D_BODY)
            return
        self._deadline = 0.0
        if self.reading is _R_DISCARD:
            return
        headers = self._headers
        # A whole head read at once was bounded field by field; in all, only
        # when its fields could add up past the bound at all.
        if self._target_size + len(headers) * MAX_LINE > MAX_HEAD and self._head_size() > MAX_HEAD:
            raise self._refused(431, "head_too_large", f"The request head is larger than {MAX_HEAD} bytes.")
        parser = self.parser
        version = parser.get_http_version()
        if version == "1.1":
            version_11 = True
        elif version == "1.0":
            version_11 = False
        elif version[:2] == "1.":
            # RFC 9110 2.5: a higher minor version is read as the highest one the
            # router speaks, and answered in it.
            version_11 = True
        else:
            raise self._refused(505, "http_version", f"HTTP/{version} is not supported; use HTTP/1.1.")
        self._head_version_11 = version_11
        # The method as this head says it: after an ignored Upgrade another
        # parser reads the body, and its method is not the request's.
        self._method = method = parser.get_method()
        if method not in _METHODS:
            shown = method.decode("latin-1")
            raise self._refused(501, "unknown_method", f"The method {shown!r} is not implemented.")
        if self._target and self._target[0][0] != _SLASH and _USERINFO.match(b"".join(self._target)):
            raise self._refused(400, "userinfo", "The request target has userinfo (user@host): refused.")
        # One pass over the names: most are none of these, told by one lookup.
        hosts = 0
        host = b""
        self._request_id = b""
        self._captured = None
        fields = self.server.fields
        length: int | None = None
        codings: list[bytes] | None = None
        expect = False
        upgrade = False
        connection: bytes | None = None
        for name, value in headers:
            kind = fields.get(name)
            if kind is None:
                if len(name) not in self.server.field_lengths:
                    continue
                kind = fields.get(name.lower())
                if kind is None:
                    continue
            if kind == _F_HOST:
                hosts += 1
                host = value
            elif kind == _F_LENGTH:
                length = int(value)  # llhttp has checked the digits
            elif kind == _F_CODINGS:
                if codings is None:
                    codings = []
                # A list (RFC 9110 5.6.1): OWS around elements, empty elements ignored.
                codings += [c.strip(b" \t") for c in value.lower().split(b",") if c.strip(b" \t")]
            elif kind == _F_EXPECT:
                expect = value.lower() == b"100-continue"
            elif kind == _F_CONNECTION:
                connection = value.lower() if connection is None else connection + b"," + value.lower()
            elif kind == _F_UPGRADE:
                upgrade = True
            elif kind == _F_REQUEST_ID:
                if _REQUEST_ID.fullmatch(value):
                    self._request_id = value
            elif self._captured is None:
                self._captured = {name.lower(): value}
            else:
                self._captured[name.lower()] = value
        if hosts != 1:
            if version_11 or hosts:
                detail = "no Host header" if hosts == 0 else f"{hosts} Host headers"
                raise self._refused(400, "host", f"The request has {detail}; HTTP/1.1 requires exactly one.")
        elif host not in self.server.hosts and not self.server.valid_host(host):
            raise self._refused(400, "host", "The Host header is not a valid host[:port].")
        # RFC 9112 9.3, from the head alone (not llhttp's view, which heeds
        # Proxy-Connection and trailers): close wins; HTTP/1.1 persists
        # unless told to close; HTTP/1.0 only when it asks for keep-alive.
        if connection is None:
            self._keep_alive_request = version_11
        else:
            tokens = {t.strip() for t in connection.split(b",")}
            self._keep_alive_request = b"close" not in tokens and (version_11 or b"keep-alive" in tokens)
        self.reading = _R_BODY
        if codings is not None:
            if not version_11:
                raise self._refused(400, "transfer_encoding_http_1_0", "Transfer-Encoding is not allowed in HTTP/1.0.")
            if codings != [b"chunked"]:
                raise self._transfer_codings_refused(codings)
            self._chunked = True
            self._chunk_framed = False
            self._framing = 0
            self._line = 0
        elif self._chunked:
            self._chunked = False
        # llhttp upgrades on CONNECT, and on Upgrade with Connection: upgrade.
        if (upgrade or method == b"CONNECT") and parser.should_upgrade():
            if method == b"CONNECT":
                raise self._refused(405, "connect", "CONNECT is not supported: this is not a forward proxy.")
            # RFC 9110 7.8: a server may ignore Upgrade and answer in HTTP/1.1.
            if length:
                self._upgrade_framing = b"Content-Length: %d\r\n" % length
            elif codings is not None:
                self._upgrade_framing = b"Transfer-Encoding: chunked\r\n"
        server = self.server
        if length is not None:
            if not length:
                return
        elif codings is None:
            return
        # A body is announced. The app's head check (its keys) comes before any
        # other judgment of it: a client it refuses learns nothing more.
        if server.head_check is not None and self._refused_by_head_check(server.head_check):
            return
        if length is not None and length > server.max_body_bytes:
            message = f"The request body is {length} bytes; the limit is {server.max_body_bytes}."
            self._refuse(_Refused(413, "body_too_large", message, "request_too_large"))
            return
        if server.buffered >= server.max_buffered_body_bytes:
            # Counted as bytes arrive, not as announced: a head that promises
            # 32 MiB and sends nothing must not take anyone's share.
            self._refuse(self._buffers_full())
            return
        if expect and version_11:
            # Never a 1xx to an HTTP/1.0 client (RFC 9110 15.2): it sends its body anyway.
            if self.answering is _A_IDLE and not self._pending:
                self._write_continue()
            else:
                # The client waits for the 100 before sending its body: no body
                # deadline runs until the 100 is out.
                self._continue_owed = True

    def _refused_by_head_check(self, head_check: HeadCheck) -> bool:
        """The head check, for a request whose body is still to come: True when it refused it."""
        # The id it is judged under is the one it keeps, answered or refused.
        self._request_id = request_id = self._request_id or self.server.new_request_id()
        request = Request(
            self.peer,
            self._method.decode("ascii", "replace"),
            _request_target(self._target),
            self._headers,
            b"",
            self._keep_alive_request,
            self._head_version_11,
            0,
            request_id,
            self._captured,
        )
        reply = head_check(request)
        if reply is None:
            return False
        self._refuse(_Refused(reply.status, "", "", reply=reply, request_id=request_id))
        return True

    def on_chunk_header(self) -> None:
        self._chunk_framed = True

    def on_body(self, body: bytes) -> None:
        if self.reading is not _R_BODY:
            return
        if self._chunked and not self._chunk_framed:
            # llhttp did not take the coding for chunked (a trailing HTAB or
            # comma): it reads to the close, and these are the raw chunks.
            self._unframed = body
            raise _Unframed
        self._body_size += len(body)
        server = self.server
        if self._body_size > server.max_body_bytes:
            self._refuse(
                _Refused(
                    413,
                    "body_too_large",
                    f"The request body exceeds the limit of {server.max_body_bytes} bytes.",
                    "request_too_large",
                )
            )
            return
        # Counted as it arrives, against every connection's bodies together.
        size = len(body)
        if server.buffered + size > server.max_buffered_body_bytes:
            self._refuse(self._buffers_full())
            return
        self._reserved_current += size
        self._reserved += size
        server.buffered += size
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.reading is _R_DISCARD:
            if self.answering is _A_IDLE and not self._pending:
                self._close()
            else:
                self.reading = _R_STOPPED
            return
        if self._upgrade_framing is not None:
            # Not the end: llhttp skipped an upgraded request's body; the
            # fresh parser reads it (see _after_upgrade).
            return
        request = Request(
            self.peer,
            self._method.decode("ascii", "replace"),
            _request_target(self._target),
            self._headers,
            b"".join(self._body),
            self._keep_alive_request,
            self._head_version_11,
            self._reserved_current,
            self._request_id or self.server.new_request_id(),
            self._captured,
        )
        self._body = []
        self._continue_owed = False
        self._deadline = 0.0
        if request.keep_alive:
            self.reading = _R_HEAD
        else:
            # Nothing after a request that closes the connection is read.
            self.reading = _R_STOPPED
        if self.answering is _A_IDLE and not self._pending:
            self._start(request)
        else:
            self._pending.append(request)
            if self.transport is not None:
                # A client pipelining ahead waits for its answers: at most two
                # bodies of max_body_bytes are held per connection.
                self.transport.pause_reading()

    def _after_upgrade(self) -> bool:
        """A fresh parser after an ignored Upgrade, primed to read the request's body if it has
        one (the same for a body to be read anew); True when primed."""
        framing = self._upgrade_framing
        self._upgrade_framing = None
        self.parser = self._new_parser()
        if framing is None or self.reading is not _R_BODY:
            return False
        self._synthetic = True
        head = b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n"
        try:
            self.parser.feed_data(head)
        except httptools.HttpParserError as exc:  # pragma: no cover (the framing is ours and valid)
            self._parse_failed(exc, head, False)
        return True

    # Running requests ---------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self.answering = _A_ACTIVE
        self.task = asyncio.get_running_loop().create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        self._keep_alive = request.keep_alive and not self.server.stopping
        writer = Writer(self, request.method == "HEAD", request.request_id, request.version_11)
        # For the log lines the handler causes, in this task only; unset before
        # the next request starts from this task (its task copies this context).
        token = current_request_id.set(request.request_id)
        try:
            await self.server.handler(request, writer)
        except asyncio.CancelledError:
            self._unreserve(request.reserved)
            raise
        except Exception:  # noqa: BLE001 (the root of a request: answered 500, logged, connection lives on)
            self.server.log_exception("request handler failed")
        finally:
            current_request_id.reset(token)
        size = request.reserved
        if size and self.answering is not _A_CLOSED:
            # (A connection lost meanwhile counted all of its bodies out already.)
            self._reserved -= size
            self.server.buffered -= size
        request.body = b""
        phase = writer.phase
        if phase is not _DONE:
            if phase is _NEW:
                writer.answer(self.server.internal_error())
            else:
                # Bytes of a stream are out: a 500 now would corrupt it; it ends broken.
                writer.abort()
        if self._paused and self.answering is not _A_CLOSED:
            # An answer the client does not read is not kept forever.
            try:
                await self.drain()
            except ConnectionError:
                self.task = None
                return
        self.task = None
        if (
            self.answering is _A_ACTIVE
            and self._keep_alive
            and not self._pending
            and self.reading is _R_HEAD
            and not self._in_head
            and self._doomed is None
        ):
            # The usual end: nothing queued, nothing owed; the connection idles.
            self.answering = _A_IDLE
            self._arm(self.server.keepalive_timeout, _D_IDLE)
            return
        self._next()

    def _next(self) -> None:
        """A request was answered: start the next, answer a doomed one, or wait."""
        if self.answering is _A_CLOSED:
            return
        self.answering = _A_IDLE
        if not self._keep_alive:
            self._close()
            return
        if self._pending:
            self._start(self._pending.popleft())
            if self._pending or self.reading is _R_STOPPED:
                return
            if self._backlog:
                # What was read but not yet parsed, up to the next request queued.
                backlog, self._backlog = self._backlog, b""
                self.data_received(backlog)
                if self._backlog or self._pending or self.stopped:
                    return
            # Nothing queued ahead now: read on (the next head, or the body of
            # one whose head came meanwhile). Never while anything waits.
            self._resume_reading()
            return
        if self._doomed is not None:
            self._answer_doomed()
            return
        if self.reading is _R_STOPPED:
            self._close()
            return
        if self._continue_owed:
            # The request still arriving is now the one being answered.
            self._continue_owed = False
            self._write_continue()
            self._arm(self.server.body_timeout, _D_BODY)
        elif not self._in_head and self.reading is _R_HEAD:
            self._arm(self.server.keepalive_timeout, _D_IDLE)

    def _resume_reading(self) -> None:
        """Read again after a queued request; what the client was sending gets its deadline from now.

        While the router does not read, the client cannot be late: a head or
        body begun in the read that queued a request has no deadline until here,
        nor has the window in which a refused body is read and dropped.
        """
        if self.transport is not None:
            self.transport.resume_reading()
        if self._deadline:
            return
        if self._in_head:
            self._arm(self.server.header_timeout, _D_HEAD)
        elif self.reading is _R_BODY and not self._continue_owed:
            self._arm(self.server.body_timeout, _D_BODY)
        elif self.reading is _R_DISCARD:
            self._arm(_DISCARD_SECONDS, _D_DISCARD)

    def _write_continue(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _write_stream_head(
        self,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        length: int | None,
        no_body: bool,
        version_11: bool,
    ) -> bool:
        """A stream's head; True when its body is chunked."""
        chunked = False
        if no_body:
            framing = b"Content-Length: %d\r\n" % length if length is not None and status not in (204, 304) else b""
        elif length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif version_11:
            framing = b"Transfer-Encoding: chunked\r\n"
            chunked = True
        else:
            # HTTP/1.0 has no chunks: the end of the connection ends the body.
            framing = b""
            self._keep_alive = False
        if not self._keep_alive:
            framing += b"Connection: close\r\n"
        elif not version_11:
            framing += b"Connection: keep-alive\r\n"
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_head(status, reason, headers, framing + b"\r\n"))
        return chunked

    def close_after_answer(self) -> None:
        self._keep_alive = False

    async def drain(self) -> None:
        """Wait until the client took enough of its answer; WriteStalled when it takes nothing for long."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.answering is _A_CLOSED:
            raise ConnectionResetError("the client went away")
        if not self._paused:
            return
        self._write_deadline = time.monotonic() + self.server.write_stall_timeout
        self.server.watch()
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await self._drained
        finally:
            self._drained = None

    def _wake_drain(self, error: Exception | None) -> None:
        drained = self._drained
        if drained is None or drained.done():
            return
        if error is None:
            drained.set_result(None)
        else:
            drained.set_exception(error)
            # Retrieved or not, never logged as unretrieved.
            drained.exception()

    # Refusals, timers, closing ------------------------------------------------------------------

    def _refused(self, status: int, reason: str, message: str) -> _Refused:
        """The refusal a callback raises; kept here, since httptools wraps what callbacks raise."""
        self._refusal = _Refused(status, reason, message)
        return self._refusal

    def _parse_failed(self, exc: httptools.HttpParserError, data: bytes, at_boundary: bool) -> bytes:
        """llhttp stopped in `data` (fed from a message boundary or not): refuse, or read on
        where a callback asked for it. The bytes parsed last."""
        refusal, self._refusal = self._refusal, None
        if refusal is None:
            unframed, self._unframed = self._unframed, None
            if unframed is not None:
                # The raw chunks and what follows them, read anew by a parser that knows them for chunked.
                self._upgrade_framing = b"Transfer-Encoding: chunked\r\n"
                return self._upgraded(unframed, 0)
            if self.reading is _R_STOPPED or self.reading is _R_DISCARD:
                # Bytes after a request that closes the connection, or in a
                # dropped body: not read, and no more answers owed for them.
                self.reading = _R_STOPPED
                if self.answering is _A_IDLE and not self._pending and self._doomed is None:
                    self._close()
                return data
            if isinstance(exc, httptools.HttpParserInvalidMethodError) and at_boundary and unknown_method(data):
                refusal = _Refused(501, "unknown_method", "The request's method is not implemented.")
            else:
                refusal = _Refused(400, "invalid_http", f"The request is not valid HTTP/1.1: {exc}.")
        self._refuse(refusal)
        return data

    def _transfer_codings_refused(self, codings: list[bytes]) -> _Refused:
        shown = ", ".join(c.decode("latin-1") for c in codings) or "(none)"
        if not codings or codings[-1] != b"chunked":
            # RFC 9112 6.3: the body's length cannot be known: 400, then close.
            return self._refused(
                400, "transfer_encoding", f"Transfer-Encoding {shown!r} does not end in chunked: no length."
            )
        if b"chunked" in codings[:-1]:
            # RFC 9112 6.1: never chunked twice (one reader would decode it once, another twice).
            return self._refused(400, "transfer_encoding", f"Transfer-Encoding {shown!r} applies chunked twice.")
        # RFC 9112 6.1: a coding the router does not decode (forwarding the body would mislabel it).
        return self._refused(501, "transfer_encoding", f"Transfer-Encoding {shown!r} is not supported; only chunked.")

    def _buffers_full(self) -> _Refused:
        return _Refused(
            503,
            "buffers_full",
            "The router holds too many request bodies at once; retry shortly.",
            "server_overloaded",
        )

    def _refuse(self, refusal: _Refused) -> None:
        """Answer `refusal` after the requests ahead of it, then close.

        A refused body (401 from the head check, 413, 503) is read on and dropped
        for a short while, so that a client that sends before it reads gets to
        read the answer (nginx reads such a body whole and keeps the connection;
        the router gives no more of its time to a body it will not take).
        """
        server = self.server
        if refusal.reason:
            server.protocol_errors.record(refusal.reason, f"{refusal.status} to {self!r}: {refusal.message}")
        self._body = []
        self._unreserve(self._reserved_current)
        self._reserved_current = 0
        self._continue_owed = False
        self._upgrade_framing = None
        self._in_head = False
        discard = refusal.status in (401, 413, 503) and self.reading is _R_BODY
        reply = refusal.reply
        self._doomed = reply if reply is not None else server.error(refusal.status, refusal.message, code=refusal.code)
        self._doomed_request_id = refusal.request_id
        # A refused HEAD gets its answer's head only (RFC 9110 9.3.2), as any HEAD does.
        # (llhttp keeps the previous request's method until a new one is read:
        # only a request line begun, its target arriving, has its own.)
        self._doomed_head_only = bool(self._target) and self.parser.get_method() == b"HEAD"
        if discard:
            self.reading = _R_DISCARD
            if self._pending:
                # Not read while a request is queued: the window opens when the router reads again.
                self._disarm()
            else:
                self._arm(_DISCARD_SECONDS, _D_DISCARD)
        else:
            self.reading = _R_STOPPED
            self._disarm()
            if self.transport is not None:
                self.transport.pause_reading()
        if self.answering is _A_IDLE and not self._pending:
            self._answer_doomed()

    def _answer_doomed(self) -> None:
        reply, self._doomed = self._doomed, None
        assert reply is not None
        self._keep_alive = False
        request_id = self._doomed_request_id or self.server.new_request_id()
        Writer(self, self._doomed_head_only, request_id, True).answer(reply)
        if self.reading is not _R_DISCARD:
            self._close()
        # A DISCARD connection closes when the refused body ends, or at its deadline.

    def _reserve(self, size: int) -> None:
        self._reserved_current += size
        self._reserved += size
        self.server.buffered += size

    def _unreserve(self, size: int) -> None:
        # Never below zero: a request cancelled after its connection was lost
        # was already counted out with the rest of the connection.
        size = min(size, self._reserved)
        if size:
            self._reserved -= size
            self.server.buffered -= size

    def _arm(self, seconds: float, kind: _Deadline) -> None:
        server = self.server
        if server._sweeper is None:
            server.watch()
        # The sweep's clock, at most one sweep old: a deadline is never early,
        # and no clock is read per request.
        self._deadline = server.now + seconds + server.every
        self._deadline_kind = kind

    def _disarm(self) -> None:
        self._deadline = 0.0
        self._deadline_kind = _D_NONE

    @property
    def waiting(self) -> bool:
        return self._deadline > 0.0 or self._write_deadline > 0.0

    def check(self, now: float) -> None:
        """The sweep: act on a deadline that passed."""
        if 0.0 < self._write_deadline < now:
            self._write_deadline = 0.0
            self.server.protocol_errors.record(
                "write_stall", f"{self!r} took none of its answer for {self.server.write_stall_timeout:g} s"
            )
            self._wake_drain(WriteStalled("the client read nothing of its answer"))
            if self.transport is not None:
                self.transport.abort()
            return
        if not 0.0 < self._deadline < now:
            return
        kind = self._deadline_kind
        self._disarm()
        if kind is _D_HEAD:
            # A head that never ended: no answer is owed; the slot is freed.
            self.server.protocol_errors.record("head_timeout", f"{self!r} sent no whole head in time")
            if self.answering is _A_IDLE and not self._pending:
                if self.transport is not None:
                    self.transport.abort()
            else:
                # The requests before it are answered first; then the connection closes.
                self.reading = _R_STOPPED
                self._in_head = False
                if self.transport is not None:
                    self.transport.pause_reading()
        elif kind is _D_BODY:
            self._refuse(
                _Refused(408, "body_timeout", f"The request body did not arrive within {self.server.body_timeout:g} s.")
            )
        elif kind is _D_DISCARD:
            if self.answering is _A_IDLE and self._doomed is None:
                self._close()
            else:
                self.reading = _R_STOPPED
        elif self.answering is _A_IDLE:
            self._close()

    def _close(self) -> None:
        """Close once what was written has been taken; abort if the client will not take it."""
        self.reading = _R_STOPPED
        self._disarm()
        transport = self.transport
        if self.answering is not _A_CLOSED:
            self.answering = _A_CLOSING
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():
            # close() would wait for the client to read it, perhaps forever.
            self._write_deadline = time.monotonic() + self.server.write_stall_timeout
            self.server.watch()
        transport.close()

    def close_if_idle(self) -> None:
        if self.answering is _A_IDLE:
            self._close()


class Phase(enum.Enum):
    """How far a Writer's answer is."""

    NEW = "new"  # nothing written
    STREAMING = "streaming"  # a stream's head is out
    DONE = "done"  # answered (or aborted): nothing more


# Module-level names: the per-write checks are one global load and an `is`.
_NEW = Phase.NEW
_STREAMING = Phase.STREAMING
_DONE = Phase.DONE


class Meter(Protocol):
    """What a writer counts of its answer for whoever watches it (the gateway's access log)."""

    status: int
    bytes_out: int


class Writer:
    """One request's answer, written through its connection: the only way a handler answers.

    Either `answer(reply)` (a whole answer, one write) or a stream:
    `start()`, then `write()` each piece (True: the client's buffer is full,
    `await drain()`), then `end()`, or `abort()` when the source broke off.
    The framing rules are kept here, whatever the handler does: no body on
    204, 304 or a HEAD request; a declared length is met exactly (a stream
    that ends short is aborted, never padded or passed off as whole);
    nothing after the end. A second transport (HTTP/2) would be a second
    writer, with no change in the handler.
    """

    __slots__ = (
        "_chunked",
        "_connection",
        "_head_only",
        "_left",
        "_no_body",
        "_request_id",
        "_version_11",
        "meter",
        "phase",
    )

    def __init__(self, connection: Connection, head_only: bool, request_id: bytes, version_11: bool) -> None:
        self._connection = connection
        self._head_only = head_only
        # Sent back on every answer (X-Request-Id).
        self._request_id = request_id
        # The request's own version, not the connection's: the head of the next
        # request may be read (and its version with it) while this answer is written.
        self._version_11 = version_11
        self.phase = _NEW
        # Whoever counts this answer (the access log's entry), if anyone: the
        # writer fills in the status and counts the bytes written.
        self.meter: Meter | None = None
        # start() sets, and only a started stream reads: whether no body may
        # follow the head (_no_body), whether it is chunked (_chunked), and
        # the bytes still owed when it declared a length (_left; -1: none).

    @property
    def started(self) -> bool:
        """Whether anything of the answer was written: past this, no other answer can be given."""
        return self.phase is not _NEW

    def answer(self, reply: Reply) -> None:
        if self.phase is not _NEW:
            raise RuntimeError(f"an answer was already {'begun' if self.phase is _STREAMING else 'written'}")
        self.phase = _DONE
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            return
        status = reply.status
        body = reply.body
        if not connection._keep_alive:
            persistence = b"Connection: close\r\n"
        elif self._version_11:
            persistence = b""
        else:
            # HTTP/1.0 closes by default: say that this one stays open.
            persistence = b"Connection: keep-alive\r\n"
        meter = self.meter
        if status == 204 or status == 304:  # noqa: PLR1714 (two compares beat a tuple here)
            # 204 and 304 carry neither a body nor a length (RFC 9110 8.6).
            framing = b"%sX-Request-Id: %s\r\n\r\n" % (persistence, self._request_id)
            body = b""
        else:
            # One format for the framing lines: this runs for every answer.
            framing = b"Content-Length: %d\r\n%sX-Request-Id: %s\r\n\r\n" % (len(body), persistence, self._request_id)
        head = _head(status, reply.reason, reply.headers, framing)
        if self._head_only or not body:
            transport.write(head)
        elif len(body) > 65536:
            # A big answer (embeddings of a large batch) is not copied into the head.
            transport.writelines((head, body))
        else:
            transport.write(head + body)
        if meter is not None:
            meter.status = status
            meter.bytes_out = len(head) if self._head_only else len(head) + len(body)

    def start(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], *, length: int | None = None
    ) -> None:
        """The head of a streamed answer; `length` when the body's size is known (Content-Length)."""
        if self.phase is not _NEW:
            raise RuntimeError("the answer's head was already written")
        self.phase = _STREAMING
        if self.meter is not None:
            self.meter.status = status
        self._no_body = self._head_only or status in (204, 304) or 100 <= status < 200
        self._left = -1 if length is None else length
        headers = [*headers, (b"X-Request-Id", self._request_id)]
        self._chunked = self._connection._write_stream_head(
            status, reason, headers, length, self._no_body, self._version_11
        )

    def write(self, data: bytes) -> bool:
        """One piece of the body; True when the client's buffer is full (await drain())."""
        if self.phase is not _STREAMING:
            raise RuntimeError("write() outside a started, unfinished stream")
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            return True
        if not data or self._no_body:
            # An empty piece would be a chunked body's last-chunk; a body on a
            # HEAD, 204 or 304 answer would be read as the next answer.
            return connection._paused
        if self._left >= 0:
            if len(data) > self._left:
                raise RuntimeError(f"{len(data)} bytes written where {self._left} were left of the declared length")
            self._left -= len(data)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if self.meter is not None:
            self.meter.bytes_out += len(data)
        return connection._paused

    def body_sink(self) -> Callable[[bytes], bool]:
        """write(), made for this stream: what a stream's source calls per piece, in its own callback.

        A chunked stream with no declared length (the common one) writes with
        the framing checks done once here, not per piece; the others keep write().
        """
        if self.phase is not _STREAMING:
            raise RuntimeError("body_sink() outside a started, unfinished stream")
        connection = self._connection
        transport = connection.transport
        if transport is None or self._no_body or self._left >= 0 or not self._chunked or self.meter is not None:
            return self.write

        def write_chunk(data: bytes) -> bool:
            if self.phase is not _STREAMING:
                raise RuntimeError("a piece written after the stream's end")
            if transport.is_closing():
                return True
            if data:
                # An empty piece would be the last-chunk: never written here.
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return connection._paused

        return write_chunk

    def end(self) -> None:
        """The body is complete."""
        if self.phase is not _STREAMING:
            raise RuntimeError("end() outside a started, unfinished stream")
        if self._left > 0 and not self._no_body:
            # Short of its declared length: a complete-looking answer would be a lie.
            self.abort()
            return
        self.phase = _DONE
        transport = self._connection.transport
        if self._chunked and transport is not None and not transport.is_closing():
            transport.write(b"0\r\n\r\n")

    def abort(self, last_words: bytes = b"") -> None:
        """The answer broke off: `last_words` (an SSE error event) if any, then close without its end.

        Without the last-chunk (or with a length unmet) the client's HTTP
        library sees the answer cut short, as it was.
        """
        if self.phase is _STREAMING and last_words and not self._no_body and self._left < 0:
            self.write(last_words)
        self.phase = _DONE
        connection = self._connection
        connection._keep_alive = False
        connection._close()

    def close_after(self) -> None:
        """Close the connection once this answer is out."""
        self._connection.close_after_answer()

    async def drain(self) -> None:
        """Wait until the client took enough; WriteStalled when it takes nothing for write_stall_timeout."""
        await self._connection.drain()


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
        body_timeout: float = 60.0,
        write_stall_timeout: float = 30.0,
        max_buffered_body_bytes: int = 1 << 30,
        captured: Iterable[bytes] = (),
        head_check: HeadCheck | None = None,
    ) -> None:
        """`captured`: header names whose values the handler reads (Request.captured), picked out
        in the pass over the head that the server makes anyway, instead of a search per request.
        `head_check`: see HeadCheck; None costs nothing per request."""
        self.handler = handler
        self.head_check = head_check
        # The request fields the server reads, and those it captures for the handler.
        self.fields = dict(_FIELDS)
        for name in captured:
            for spelling in _spellings(name.lower()):
                self.fields.setdefault(spelling, _F_CAPTURED)
        self.field_lengths = frozenset(len(name) for name in self.fields)
        self.max_body_bytes = max_body_bytes
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self.write_stall_timeout = write_stall_timeout
        self.max_buffered_body_bytes = max_buffered_body_bytes
        # Request body bytes held by every connection together.
        self.buffered = 0
        # error(status, message, code=...) -> an OpenAI-shaped Reply.
        self.error = error
        self.log_exception = log_exception
        self.protocol_errors = ProtocolErrors(log)
        self.connections: set[Connection] = set()
        self.stopping = False
        self._sweeper: asyncio.TimerHandle | None = None
        # Monotonic time as of the last sweep (or the start of one): the clock deadlines are set by.
        self.now = time.monotonic()
        # Host values already found valid: a connection sends the same one on every request.
        self.hosts: set[bytes] = set()
        # Request ids this server makes are UUIDs (version 4 shape): engines validate the header
        # (llama.cpp's server answers 400 with an empty body to anything else). Random per
        # process, then a counter in the last group: unique, and cheap to make (no uuid4 per request).
        seed = bytearray(os.urandom(10))
        seed[6] = 0x40 | (seed[6] & 0x0F)
        seed[8] = 0x80 | (seed[8] & 0x3F)
        hexed = seed.hex().encode()
        self._id_prefix = b"%s-%s-%s-%s-" % (hexed[:8], hexed[8:12], hexed[12:16], hexed[16:20])
        self._ids = itertools.count(1)
        # Deadlines are checked this often: a few times per the shortest of them.
        shortest = min(header_timeout, keepalive_timeout, body_timeout, write_stall_timeout)
        self.every = max(0.05, min(1.0, shortest / 4))

    def __call__(self) -> Connection:
        return Connection(self)

    def new_request_id(self) -> bytes:
        return self._id_prefix + b"%012x" % (next(self._ids) & 0xFFFF_FFFF_FFFF)

    def valid_host(self, value: bytes) -> bool:
        if _HOST.fullmatch(value) is None:
            return False
        if len(self.hosts) < 256:
            self.hosts.add(value)
        return True

    def watch(self) -> None:
        """Make sure the sweep runs while any connection waits on a deadline."""
        if self._sweeper is None:
            self.now = time.monotonic()
            self._sweeper = asyncio.get_running_loop().call_later(self.every, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self.now = now = time.monotonic()
        waiting = False
        for connection in list(self.connections):
            connection.check(now)
            waiting = waiting or connection.waiting
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
