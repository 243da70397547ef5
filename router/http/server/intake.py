"""The reading side of a client connection: what its client sends, fed to the Reader, taken in order or refused.

Reads go to llhttp through the Reader (reader.py, this class's base), a large
one a slice at a time: a client pipelining ahead is read only up to the first
request queued behind the one being answered, and the rest waits, unparsed.
Where llhttp must read anew from a point (after an ignored Upgrade, or a
chunked coding it did not take for chunked), a fresh parser is primed with
the framing of the body still to come, and fed on. What the Reader finds
comes back here: a head judged acceptable (head.py), a request read whole,
or a reason to refuse. A body announced is first judged by the app's head
check and the limits, a `100 Continue` is sent or owed, a request read whole
is started or queued behind the one being answered, and a refused request
gets its answer in its turn (the connection closes after it); a refused body
(401, 413, 503) is read on and dropped for a short while, so that a client
that sends before it reads gets to read the answer. The answering side,
which starts requests and closes the connection, is the Connection's
(connection.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import httptools

from router.http.messages import Reply, Request
from router.http.server.deadlines import Deadline
from router.http.server.flow import buffers_full
from router.http.server.head import Refusal, parse_failed
from router.http.server.reader import Reader, new_parser
from router.http.server.states import READING, Answering, Event, Reading, on
from router.http.server.writer import write_continue
from router.http.writer import HeadCheck

if TYPE_CHECKING:
    from router.http.server.server import Server

# After a refused body: how long the client may go on sending what it started.
DISCARD_SECONDS = 2.0

# Reads larger than this are parsed in slices of it: the most a client
# pipelining ahead gets parsed behind the request being answered.
_SLICE = 4096

# Module-level names for the states: an Enum member read through its class
# goes through the metaclass's __getattr__, many times per request.
_R_IDLE = Reading.IDLE
_R_HEAD = Reading.HEAD
_R_BODY = Reading.BODY
_R_DISCARD = Reading.DISCARD
_R_STOPPED = Reading.STOPPED
_A_IDLE = Answering.IDLE
_D_NONE = Deadline.NONE
_D_HEAD = Deadline.HEAD
_D_BODY = Deadline.BODY
_D_DISCARD = Deadline.DISCARD

# The transitions this module makes: the tables' columns (states.py).
_READING_ON_BEGIN = on(READING, Event.BEGIN)
_READING_ON_DISCARDED = on(READING, Event.DISCARDED)
_READING_ON_HEAD_TAKEN = on(READING, Event.HEAD_TAKEN)
_READING_ON_MESSAGE_READ = on(READING, Event.MESSAGE_READ)
_READING_ON_LAST_MESSAGE_READ = on(READING, Event.LAST_MESSAGE_READ)
_READING_ON_REFUSED = on(READING, Event.REFUSED)
_READING_ON_REFUSED_BODY = on(READING, Event.REFUSED_BODY)
_READING_ON_STOP = on(READING, Event.STOP)


class Owed:
    """A refusal's answer, owed after the requests queued ahead of it; then the connection closes."""

    __slots__ = ("head_only", "reply", "request_id")

    def __init__(self, reply: Reply, head_only: bool, request_id: bytes) -> None:
        self.reply = reply
        self.head_only = head_only
        self.request_id = request_id


class Intake(Reader):
    """What a connection does with what its client sends: reads fed to its Reader, and what it finds."""

    __slots__ = ("_backlog", "_continue_owed", "answering", "owed", "peer", "pending", "transport")

    # Set when the connection is made, before anything is read or written.
    transport: asyncio.Transport

    def __init__(self, server: Server) -> None:
        super().__init__(server)
        # The client's address, "host:port", read once when the connection is made.
        self.peer = ""
        self.answering = _A_IDLE
        # Requests read ahead of their turn, in order; and the bytes read behind them, not parsed yet.
        self.pending: deque[Request] = deque()
        self._backlog = b""
        # The answer of a refused request, owed after those queued ahead of it.
        self.owed: Owed | None = None
        # A `100 Continue` owed to the request still arriving, sent when it is
        # the one being answered (never into another request's answer); no
        # body deadline runs until it is out, since the client waits for it.
        self._continue_owed = False

    def __repr__(self) -> str:
        return (
            f"<Connection {self.peer or '?'} {self.reading!r} {self.answering!r} pending={len(self.pending)}"
            f"{' doomed' if self.owed is not None else ''}>"
        )

    if TYPE_CHECKING:
        # The answering side's (connection.py).

        def _start(self, request: Request) -> None: ...
        def _answer_owed(self) -> None: ...
        def close(self) -> None: ...

    # Reads ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        reading = self.reading
        if reading is _R_STOPPED:
            # After `Connection: close` or a refusal: whatever follows is not read.
            return
        if len(data) > _SLICE:
            self._feed_slices(data)
            return
        body_before = self._body_size
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            data = self._upgraded(data, exc.args[0])
        except httptools.HttpParserError as exc:
            data = self._failed(exc, data, reading is _R_IDLE)
        # A whole request in one read (the usual case) ends here, between
        # requests: only what is unfinished is bounded, and given a deadline,
        # unless a request is queued: the client cannot be late for bytes the
        # router is not reading (they get theirs when it reads again).
        reading = self.reading
        if reading is _R_HEAD:
            if not self._deadline and not self.pending:
                self._arm(self.server.header_timeout, _D_HEAD)
            self._bound_head(data)
        elif reading is _R_BODY:
            if not self._deadline and not self._continue_owed and not self.pending:
                self._arm(self.server.body_timeout, _D_BODY)
            if self._chunked:
                if self._body_size != body_before:
                    self._framing = 0
                else:
                    self._bound_framing(data)

    def _feed_slices(self, data: bytes) -> None:
        """A large read, parsed a slice at a time, so that a client pipelining ahead
        is read only up to the first request queued behind the running one; the
        rest waits, unparsed, until that request starts."""
        end = len(data)
        start = 0
        while start < end:
            self.data_received(data[start : start + _SLICE])
            start += _SLICE
            if self.reading is _R_STOPPED:
                if self.switching is not None:
                    self.switching += data[start:]
                return
            if self.pending and start < end:
                self._backlog = data[start:]
                return

    def _read_backlog(self) -> bool:
        """Parse what was read behind a queued request; True when nothing is left waiting."""
        backlog, self._backlog = self._backlog, b""
        if backlog:
            self.data_received(backlog)
        return not (self._backlog or self.pending or self.reading is _R_STOPPED)

    def _arm(self, seconds: float, kind: Deadline) -> None:
        sweep = self.server.sweep
        if sweep.timer is None:
            sweep.watch()
        # By the sweep's clock, at most one sweep old: never early, and no clock read per request.
        self._deadline = sweep.now + seconds + sweep.every
        self._deadline_kind = kind

    def _disarm(self) -> None:
        self._deadline = 0.0
        self._deadline_kind = _D_NONE

    # Reading anew -------------------------------------------------------------------------

    def _upgraded(self, data: bytes, offset: int) -> bytes:
        """The request is complete (its Upgrade ignored), or its body is to be read
        anew (_unframed); what follows is HTTP/1.1 again: the body, if there is one,
        then more requests, for a fresh parser. The bytes parsed last.

        After a request whose handler may switch protocols, what follows is not HTTP:
        it is held for the switch, and no more is read until the handler decides."""
        if self.switching is not None:
            self.switching += data[offset:]
            self.transport.pause_reading()
            return b""
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
                return self._failed(exc, data, not in_body)
            return data

    def _after_upgrade(self) -> bool:
        """A fresh parser after an ignored Upgrade, primed to read the request's body if it has
        one (the same for a body to be read anew); True when primed."""
        framing = self._upgrade_framing
        self._upgrade_framing = None
        self.parser = new_parser(self)
        if framing is None or self.reading is not _R_BODY:
            return False
        self._priming = True
        # Ours and valid: llhttp takes it whole, and only its framing matters.
        self.parser.feed_data(b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n")
        return True

    def _failed(self, exc: httptools.HttpParserError, data: bytes, at_boundary: bool) -> bytes:
        """llhttp stopped in `data` (fed from a message boundary or not): refuse, or read on
        where a callback asked for it. The bytes parsed last."""
        refusal, self._refusal = self._refusal, None
        if refusal is None:
            unframed, self._unframed = self._unframed, None
            if unframed is not None:
                # The raw chunks and what follows them, read anew by a parser that knows them for chunked.
                self._upgrade_framing = b"Transfer-Encoding: chunked\r\n"
                return self._upgraded(unframed, 0)
            reading = self.reading
            if reading is _R_STOPPED or reading is _R_DISCARD:
                # Bytes after a request that closes the connection, or in a
                # dropped body: not read, and no more answers owed for them.
                self.stop_reading()
                return data
            refusal = parse_failed(exc, data, at_boundary)
        self.refuse(refusal)
        return data

    # What the reader found ---------------------------------------------------------------

    def head_taken(self, request: Request, length: int | None, chunked: bool, continue_asked: bool) -> None:
        """Its head, judged acceptable (head.py): its body (if any) is read next, unless refused from the head."""
        self.reading = _READING_ON_HEAD_TAKEN[self.reading]
        self._deadline = 0.0
        request.peer = self.peer
        if not chunked and not length:
            return
        # A body is announced. The app's head check (its keys) comes before any
        # other judgment of it: a client it refuses learns nothing more.
        head_check = self.server.head_check
        if head_check is not None and self._refused_by_head_check(head_check, request):
            return
        budget = self.server.budget
        if length is not None and length > budget.max_body:
            message = f"The request body is {length} bytes; the limit is {budget.max_body}."
            self.refuse(Refusal(413, "body_too_large", message, "request_too_large"))
        elif budget.held >= budget.limit:
            # Counted as bytes arrive, not as announced: a head that promises
            # 32 MiB and sends nothing must not take anyone's share.
            self.refuse(buffers_full())
        elif continue_asked:
            if self.answering is _A_IDLE and not self.pending:
                write_continue(self.transport)
            else:
                # The client waits for the 100 before sending its body.
                self._continue_owed = True

    def _refused_by_head_check(self, head_check: HeadCheck, request: Request) -> bool:
        """The head check, for a request whose body is still to come: True when it refused it."""
        # The id it is judged under is the one it keeps, answered or refused.
        if not request.request_id:
            request.request_id = self.server.new_request_id()
        reply = head_check(request)
        if reply is None:
            return False
        self.refuse(Refusal(reply.status, "", "", reply=reply, request_id=request.request_id))
        return True

    def body_resumed(self) -> None:
        """The body is read on by a fresh parser (after an ignored Upgrade): its deadline, if it runs, runs on."""
        if not self._deadline and not self._continue_owed and not self.pending:
            self._arm(self.server.body_timeout, _D_BODY)

    def message_read(self, request: Request, body: bytes) -> None:
        """A request read whole: answered now, or queued behind the one being answered."""
        request.body = body
        request.reserved = self.held_current
        if not request.request_id:
            request.request_id = self.server.new_request_id()
        self._continue_owed = False
        self._deadline = 0.0
        # Nothing after a request that closes the connection is read.
        on_read = _READING_ON_MESSAGE_READ if request.keep_alive else _READING_ON_LAST_MESSAGE_READ
        self.reading = on_read[self.reading]
        if self.answering is _A_IDLE and not self.pending:
            self._start(request)
        else:
            self.pending.append(request)
            # A client pipelining ahead waits for its answers: at most two
            # bodies of max_body_bytes are held per connection.
            self.transport.pause_reading()

    def discarded(self) -> None:
        """A refused body ended: the connection closes once its answers are out."""
        if self.answering is _A_IDLE and not self.pending:
            self.close()
        else:
            self.reading = _READING_ON_DISCARDED[self.reading]

    def stop_reading(self) -> None:
        """Bytes after a request that closed the connection, or garbled in a dropped body: nothing more is read."""
        self.reading = _READING_ON_STOP[self.reading]
        if self.answering is _A_IDLE and not self.pending and self.owed is None:
            self.close()

    def refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` after the requests ahead of it, then close.

        A refused body (401 from the head check, 413, 503) is read on and dropped
        for a short while, so that a client that sends before it reads gets to
        read the answer (nginx reads such a body whole and keeps the connection;
        the router gives no more of its time to a body it will not take).
        """
        server = self.server
        if refusal.reason:
            server.protocol_errors.record(refusal.reason, f"{refusal.status} to {self!r}: {refusal.message}")
        self.drop_body()
        self._continue_owed = False
        reply = refusal.reply
        if reply is None:
            reply = server.error(refusal.status, refusal.message, code=refusal.code)
        self.owed = Owed(reply, self.refused_head_only(), refusal.request_id)
        if refusal.status in (401, 413, 503) and self.reading is _R_BODY:
            self.reading = _READING_ON_REFUSED_BODY[self.reading]
            if self.pending:
                # Not read while a request is queued: the window opens when the router reads again.
                self._disarm()
            else:
                self._arm(DISCARD_SECONDS, _D_DISCARD)
        else:
            self.reading = _READING_ON_REFUSED[self.reading]
            self._disarm()
            self.transport.pause_reading()
        if self.answering is _A_IDLE and not self.pending:
            self._answer_owed()
