"""One client connection: requests read in order, each answered by its handler in turn.

One handler task per request (cycle.py), run in order: a pipelined request
waits (at most one is held ahead, and reading stops behind it), and a refused
request behind good ones is answered after them, then the connection closes;
when the client goes away the task is cancelled, and with it the upstream
request. Deadlines are checked by one sweep over every connection
(deadlines.py); what passing each one means is decided here.

A connection's states and every change of them are in states.py; its reading
side (what it does with what its Reader finds) is its base, Intake
(intake.py); the bytes it writes go through its writers (writer.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, cast

from router.http.messages import Request
from router.http.server.cycle import answer
from router.http.server.deadlines import Deadline
from router.http.server.flow import Flow
from router.http.server.head import Refusal
from router.http.server.intake import DISCARD_SECONDS, Intake
from router.http.server.states import ANSWERING, READING, Answering, Event, Reading, on
from router.http.server.writer import Http11Writer, write_continue
from router.http.transports import reset
from router.http.writer import WriteStalled

if TYPE_CHECKING:
    from router.http.server.server import Server

# Module-level names for the states: an Enum member read through its class
# goes through the metaclass's __getattr__, many times per request.
_R_IDLE = Reading.IDLE
_R_HEAD = Reading.HEAD
_R_BODY = Reading.BODY
_R_DISCARD = Reading.DISCARD
_R_STOPPED = Reading.STOPPED
_A_IDLE = Answering.IDLE
_A_ACTIVE = Answering.ACTIVE
_A_CLOSED = Answering.CLOSED
_A_CLOSING = Answering.CLOSING
_D_HEAD = Deadline.HEAD
_D_BODY = Deadline.BODY
_D_IDLE = Deadline.IDLE
_D_DISCARD = Deadline.DISCARD

# The transitions this module makes: the tables' columns (states.py).
_ANSWERING_ON_ANSWERED = on(ANSWERING, Event.ANSWERED)
_ANSWERING_ON_CLOSE = on(ANSWERING, Event.CLOSE)
_ANSWERING_ON_LOST = on(ANSWERING, Event.LOST)
_ANSWERING_ON_START = on(ANSWERING, Event.START)
_READING_ON_STOP = on(READING, Event.STOP)


class Connection(Intake):
    """One client connection: parse, run the handler per request in order, answer."""

    __slots__ = ("flow", "task")

    def __init__(self, server: Server) -> None:
        super().__init__(server)
        self.flow = Flow()
        # The request being answered.
        self.task: asyncio.Task[None] | None = None

    # asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
        self.server.connections.add(self)
        # The first head must start and end within the head deadline.
        self._arm(self.server.header_timeout, _D_HEAD)

    def eof_received(self) -> bool:
        # A client that closes its side has left, as for aiohttp: the
        # connection closes and its request is cancelled, with the replica's.
        return False

    def connection_lost(self, exc: Exception | None, cancel: bool = True) -> None:
        """The transport is gone; `cancel`: its request's task with it (a switched connection's
        handler sees the end itself, and ends its session its own way)."""
        self.server.connections.discard(self)
        self.answering = _ANSWERING_ON_LOST[self.answering]
        self.reading = _READING_ON_STOP[self.reading]
        self._disarm()
        self.flow.stall_deadline = 0.0
        self.pending.clear()
        self._backlog = b""
        self.drop_body()
        self.release(self.held)
        if cancel and self.task is not None and not self.task.done():
            self.task.cancel()
        self.flow.fail(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        self.flow.pause()

    def resume_writing(self) -> None:
        self.flow.resume()

    # Answering in order -------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self.answering = _ANSWERING_ON_START[self.answering]
        self.task = asyncio.get_running_loop().create_task(answer(self, request))

    def answered(self, keep_alive: bool) -> None:
        """A request was answered (cycle.py), and the connection persists after it or not:
        start the next, answer a refused one, or wait."""
        self.task = None
        answering = self.answering
        if answering is _A_ACTIVE and keep_alive and not self.pending and self.reading is _R_IDLE and self.owed is None:
            # The usual end: nothing queued, nothing owed; the connection idles.
            self.answering = _ANSWERING_ON_ANSWERED[answering]
            self._arm(self.server.keepalive_timeout, _D_IDLE)
            return
        if answering is _A_CLOSED or answering is _A_CLOSING:
            return
        self.answering = _ANSWERING_ON_ANSWERED[answering]
        if not keep_alive:
            self.close()
        elif self.pending:
            self._start(self.pending.popleft())
            if self.pending or self.reading is _R_STOPPED:
                return
            # What was read but not yet parsed, up to the next request queued;
            # then, nothing queued ahead now, read on (the next head, or the body
            # of one whose head came meanwhile). Never while anything waits.
            if self._read_backlog():
                self._resume_reading()
        elif self.owed is not None:
            self._answer_owed()
        elif self.reading is _R_STOPPED:
            self.close()
        elif self._continue_owed:
            # The request still arriving is now the one being answered.
            self._continue_owed = False
            write_continue(self.transport)
            self._arm(self.server.body_timeout, _D_BODY)
        # (A request arriving has its deadline already; none arriving, and nothing
        # queued or owed, is the usual end, above.)

    def _answer_owed(self) -> None:
        owed, self.owed = self.owed, None
        assert owed is not None
        request_id = owed.request_id or self.server.new_request_id()
        Http11Writer(self, owed.head_only, request_id, True, False).answer(owed.reply)
        if self.reading is not _R_DISCARD:
            self.close()
        # A DISCARD connection closes when the refused body ends, or at its deadline.

    def _resume_reading(self) -> None:
        """Read again after a queued request; what the client was sending gets its deadline from now.

        While the router does not read, the client cannot be late: a head or
        body begun in the read that queued a request has no deadline until here,
        nor has the window in which a refused body is read and dropped.
        """
        self.transport.resume_reading()
        # (Nothing arms a read deadline while a request is queued.)
        reading = self.reading
        if reading is _R_HEAD:
            self._arm(self.server.header_timeout, _D_HEAD)
        elif reading is _R_BODY and not self._continue_owed:
            self._arm(self.server.body_timeout, _D_BODY)
        elif reading is _R_DISCARD:
            self._arm(DISCARD_SECONDS, _D_DISCARD)

    async def drain(self) -> None:
        """Wait until the client took enough of its answer; WriteStalled when it takes nothing for long."""
        transport = self.transport
        if transport.is_closing() or self.answering is _A_CLOSED:
            raise ConnectionResetError("the client went away")
        if self.flow.paused:
            server = self.server
            await self.flow.wait(server.sweep, server.write_stall_timeout)

    # Deadlines, closing ------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        return self._deadline > 0.0 or self.flow.stall_deadline > 0.0

    def check(self, now: float) -> None:
        """The sweep: act on a deadline that passed."""
        server = self.server
        flow = self.flow
        if 0.0 < flow.stall_deadline < now:
            flow.stall_deadline = 0.0
            server.protocol_errors.record(
                "write_stall", f"{self!r} took none of its answer for {server.write_stall_timeout:g} s"
            )
            flow.fail(WriteStalled("the client read nothing of its answer"))
            # Reset: a plain abort would leave the kernel holding what the client will not take.
            reset(self.transport)
            return
        if not 0.0 < self._deadline < now:
            return
        kind = self._deadline_kind
        self._disarm()
        if kind is _D_HEAD:
            # A head that never ended: no answer is owed; the slot is freed.
            server.protocol_errors.record("head_timeout", f"{self!r} sent no whole head in time")
            if self.answering is _A_IDLE and not self.pending:
                self.transport.abort()
            else:
                # The requests before it are answered first; then the connection closes.
                self.reading = _READING_ON_STOP[self.reading]
                self.transport.pause_reading()
        elif kind is _D_BODY:
            self.refuse(
                Refusal(408, "body_timeout", f"The request body did not arrive within {server.body_timeout:g} s.")
            )
        elif kind is _D_DISCARD:
            if self.answering is _A_IDLE and self.owed is None:
                self.close()
            else:
                self.reading = _READING_ON_STOP[self.reading]
        else:
            # An idle keep-alive connection's (armed only while nothing is answered).
            self.close()

    def close(self) -> None:
        """Close once what was written has been taken; abort if the client will not take it."""
        self.reading = _READING_ON_STOP[self.reading]
        self._disarm()
        self.answering = _ANSWERING_ON_CLOSE[self.answering]
        transport = self.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size():
            # close() would wait for the client to read it, perhaps forever.
            server = self.server
            self.flow.stall_deadline = time.monotonic() + server.write_stall_timeout
            server.sweep.watch()
        transport.close()

    def close_if_idle(self) -> None:
        if self.answering is _A_IDLE:
            self.close()
