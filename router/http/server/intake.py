"""What a client connection does with what its RequestReader finds: heads checked, requests taken in order, refusals.

The reader (reader.py) hands each find here, as it comes: a head judged
acceptable (head.py), a request read whole, or a reason to refuse. A body
announced is first judged by the app's head check and the limits, a
`100 Continue` is sent or owed, a request read whole is started or queued
behind the one being answered, and a refused request gets its answer in its
turn (the connection closes after it); a refused body (401, 413, 503) is
read on and dropped for a short while, so that a client that sends before it
reads gets to read the answer. Where llhttp must read anew from a point (after
an ignored Upgrade, or a chunked coding it did not take for chunked), a fresh
parser is primed with the framing of the body still to come, and fed on.

The intake reaches the reader and the connection only through two small
interfaces (Parsing, Answerer), and changes the connection's state only by
its events (states.py); feeding reads, answering and closing are the
connection's (connection.py).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

import httptools

from router.http.messages import Request
from router.http.server.deadlines import D_BODY, D_DISCARD, D_HEAD, ReadDeadline
from router.http.server.flow import Holding, buffers_full
from router.http.server.head import Refusal, parse_failed
from router.http.server.port import Port
from router.http.server.states import R_DISCARD, R_HEAD, R_STOPPED, ConnectionState, Owed
from router.http.server.writer import write_continue
from router.http.writer import HeadCheck

# After a refused body: how long the client may go on sending what it started.
DISCARD_SECONDS: Final = 2.0


class Parsing(Protocol):
    """What the intake needs of the reader (reader.py): its parser, and what its callbacks left behind."""

    parser: httptools.HttpRequestParser
    # The bytes after the head of a request that may switch protocols, held (None: no such request).
    switching: bytearray | None

    def drop_body(self) -> None: ...
    def refused_head_only(self) -> bool: ...
    def take_refusal(self) -> Refusal | None: ...
    def take_unframed(self) -> bytes | None: ...
    def renew(self) -> bool: ...
    def bound(self, data: bytes, body_before: int) -> None: ...


class Answerer(Protocol):
    """What the intake needs of the connection (connection.py): its transport, and to answer and close."""

    transport: asyncio.Transport

    def start(self, request: Request) -> None: ...
    def answer_owed(self) -> None: ...
    def close(self) -> None: ...


class Intake:
    """What a connection does with what its client sends, as its reader finds it."""

    __slots__ = ("connection", "deadline", "holding", "peer", "port", "reader", "state")

    # Set by the connection once the reader that calls this one is made.
    reader: Parsing

    def __init__(
        self, port: Port, state: ConnectionState, deadline: ReadDeadline, holding: Holding, connection: Answerer
    ) -> None:
        self.port = port
        self.state = state
        self.deadline = deadline
        self.holding = holding
        self.connection = connection
        # The client's address, "host:port", read once when the connection is made.
        self.peer = ""

    def unfinished(self, data: bytes, body_before: int) -> None:
        """A read left a request unfinished, its head or its body (`body_before`: the body's size
        before the read): bounded, and given a deadline unless one runs, or a request is queued
        (the client cannot be late for bytes the router is not reading: they get theirs when it
        reads again), or a 100 (Continue) is owed (the client waits for it)."""
        state = self.state
        if not self.deadline.due and not state.pending:
            if state.reading is R_HEAD:
                self.deadline.arm(self.port.header_timeout, D_HEAD)
            elif not state.continue_owed:
                self.deadline.arm(self.port.body_timeout, D_BODY)
        self.reader.bound(data, body_before)

    # Reading anew -------------------------------------------------------------------------

    def upgraded(self, data: bytes, offset: int) -> bytes:
        """The request is complete (its Upgrade ignored), or its body is to be read
        anew (take_unframed); what follows is HTTP/1.1 again: the body, if there is one,
        then more requests, for a fresh parser. The bytes parsed last.

        After a request whose handler may switch protocols, what follows is not HTTP:
        it is held for the switch, and no more is read until the handler decides."""
        reader = self.reader
        switching = reader.switching
        if switching is not None:
            switching.extend(data[offset:])
            self.connection.transport.pause_reading()
            return b""
        while True:
            data = data[offset:]
            in_body = reader.renew()
            if not data or self.state.reading is R_STOPPED:
                return data
            try:
                reader.parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                offset = exc.args[0]
                continue
            except httptools.HttpParserError as failure:
                return self.failed(failure, data, not in_body)
            return data

    def failed(self, exc: httptools.HttpParserError, data: bytes, at_boundary: bool) -> bytes:
        """llhttp stopped in `data` (fed from a message boundary or not): refuse, or read on
        where a callback asked for it. The bytes parsed last."""
        reader = self.reader
        refusal = reader.take_refusal()
        if refusal is None:
            unframed = reader.take_unframed()
            if unframed is not None:
                # The raw chunks and what follows them, read anew by a parser that knows them for chunked.
                return self.upgraded(unframed, 0)
            reading = self.state.reading
            if reading is R_STOPPED or reading is R_DISCARD:
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
        self.state.head_taken()
        self.deadline.due = 0.0
        request.peer = self.peer
        if not chunked and not length:
            return
        # A body is announced. The app's head check (its keys) comes before any
        # other judgment of it: a client it refuses learns nothing more.
        port = self.port
        head_check = port.head_check
        if head_check is not None and self._refused_by_head_check(head_check, request):
            return
        budget = port.budget
        if length is not None and length > budget.max_body:
            message = f"The request body is {length} bytes; the limit is {budget.max_body}."
            self.refuse(Refusal(413, "body_too_large", message, "request_too_large"))
        elif budget.held >= budget.limit:
            # Counted as bytes arrive, not as announced: a head that promises
            # 32 MiB and sends nothing must not take anyone's share.
            self.refuse(buffers_full())
        elif continue_asked and self.state.continue_asked():
            # (Else owed: the client waits for the 100 before sending its body.)
            write_continue(self.connection.transport)

    def _refused_by_head_check(self, head_check: HeadCheck, request: Request) -> bool:
        """The head check, for a request whose body is still to come: True when it refused it."""
        # The id it is judged under is the one it keeps, answered or refused.
        if not request.request_id:
            request.request_id = self.port.new_request_id()
        reply = head_check(request)
        if reply is None:
            return False
        self.refuse(Refusal(reply.status, "", "", reply=reply, request_id=request.request_id))
        return True

    def body_resumed(self) -> None:
        """The body is read on by a fresh parser (after an ignored Upgrade): its deadline, if it runs, runs on."""
        state = self.state
        if not self.deadline.due and not state.continue_owed and not state.pending:
            self.deadline.arm(self.port.body_timeout, D_BODY)

    def message_read(self, request: Request, body: bytes) -> None:
        """A request read whole: answered now, or queued behind the one being answered."""
        request.body = body
        request.reserved = self.holding.current
        if not request.request_id:
            request.request_id = self.port.new_request_id()
        self.deadline.due = 0.0
        if self.state.read(request):
            self.connection.start(request)
        else:
            # A client pipelining ahead waits for its answers: at most two
            # bodies of max_body_bytes are held per connection.
            self.connection.transport.pause_reading()

    def discarded(self) -> None:
        """A refused body ended: the connection closes once its answers are out."""
        if self.state.discarded():
            self.connection.close()

    def stop_reading(self) -> None:
        """Bytes after a request that closed the connection, or garbled in a dropped body: nothing more is read."""
        if self.state.stopped():
            self.connection.close()

    def refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` after the requests ahead of it, then close.

        A refused body (401 from the head check, 413, 503) is read on and dropped
        for a short while, so that a client that sends before it reads gets to
        read the answer (nginx reads such a body whole and keeps the connection;
        the router gives no more of its time to a body it will not take).
        """
        port = self.port
        if refusal.reason:
            port.protocol_errors.record(refusal.reason, f"{refusal.status} to {self.connection!r}: {refusal.message}")
        reader = self.reader
        reader.drop_body()
        reply = refusal.reply
        if reply is None:
            reply = port.error(refusal.status, refusal.message, code=refusal.code)
        state = self.state
        owed = Owed(reply, reader.refused_head_only(), refusal.request_id)
        if state.refused(owed, refusal.status in (401, 413, 503)):
            if state.pending:
                # Not read while a request is queued: the window opens when the router reads again.
                self.deadline.disarm()
            else:
                self.deadline.arm(DISCARD_SECONDS, D_DISCARD)
        else:
            self.deadline.disarm()
            self.connection.transport.pause_reading()
        if state.quiet():
            self.connection.answer_owed()
