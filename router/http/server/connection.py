"""One client connection: its reads fed to llhttp, its requests answered one at a time in order, its deadlines.

A composition, as h11 and uvicorn shape theirs: the connection is the
asyncio protocol, and holds its parts by reference. Its ConnectionState
(states.py) is the state machine; its RequestReader (reader.py) is what
llhttp calls back, within the byte bounds; its Intake (intake.py) acts on
what the reader finds; each request is a Cycle (cycle.py), its handler's
task and its writer; what every connection shares is the Port (port.py).

The connection feeds llhttp its reads itself (a large read a slice at a
time: a client pipelining ahead is read only up to the first request queued
behind the one being answered, and the rest waits, unparsed, as its
backlog). One handler task runs per request, in order: a pipelined request
waits (at most one is held ahead, and reading stops behind it), and a refused
request behind good ones is answered after them, then the connection closes;
when the client goes away the task is cancelled, and with it the upstream
request. Deadlines are checked by one sweep over every connection
(deadlines.py); what passing each one means is decided here.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final, cast

import httptools

from router.http.messages import Request
from router.http.server.cycle import Cycle
from router.http.server.deadlines import D_BODY, D_DISCARD, D_HEAD, D_IDLE, ReadDeadline
from router.http.server.flow import Flow, Holding
from router.http.server.head import Refusal
from router.http.server.intake import DISCARD_SECONDS, Intake
from router.http.server.port import Port
from router.http.server.reader import RequestReader
from router.http.server.states import (
    A_CLOSED,
    A_IDLE,
    N_CLOSE,
    N_CONTINUE,
    N_OWED,
    N_START,
    N_WAIT,
    R_BODY,
    R_DISCARD,
    R_HEAD,
    R_IDLE,
    R_STOPPED,
    ConnectionState,
)
from router.http.server.writer import Http11Writer, write_continue
from router.http.transports import reset
from router.http.writer import WriteStalled

# Reads larger than this are parsed in slices of it: the most a client
# pipelining ahead gets parsed behind the request being answered.
_SLICE: Final = 4096


class Connection(asyncio.Protocol):
    """One client connection: parse, run the handler per request in order, answer."""

    # Slots: thousands of connections may wait at once (held requests, open
    # streams), and a dict per connection would be most of their memory.
    __slots__ = ("_backlog", "deadline", "flow", "holding", "intake", "port", "reader", "state", "task", "transport")

    # Set when the connection is made, before anything is read or written.
    transport: asyncio.Transport

    def __init__(self, port: Port) -> None:
        self.port = port
        self.state = state = ConnectionState()
        self.deadline = deadline = ReadDeadline(port.sweep)
        self.holding = holding = Holding(port.budget)
        self.flow = Flow()
        self.intake = intake = Intake(port, state, deadline, holding, self)
        self.reader = reader = RequestReader(port, state, deadline, holding, intake)
        intake.reader = reader
        # The request being answered.
        self.task: asyncio.Task[None] | None = None
        # The bytes read behind a queued request, not parsed yet.
        self._backlog = b""

    def __repr__(self) -> str:
        return f"<Connection {self.intake.peer or '?'} {self.state!r}>"

    # asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.intake.peer = f"{peer[0]}:{peer[1]}"
        self.port.connections.add(self)
        # The first head must start and end within the head deadline.
        self.deadline.arm(self.port.header_timeout, D_HEAD)

    def data_received(self, data: bytes) -> None:
        state = self.state
        reading = state.reading
        if reading is R_STOPPED:
            # After `Connection: close` or a refusal: whatever follows is not read.
            return
        if len(data) > _SLICE:
            self._feed_slices(data)
            return
        reader = self.reader
        body_before = reader.body_size
        try:
            reader.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            data = self.intake.upgraded(data, exc.args[0])
        except httptools.HttpParserError as failure:
            data = self.intake.failed(failure, data, reading is R_IDLE)
        # A whole request in one read (the usual case) ends here, between
        # requests: only what is unfinished is bounded and given a deadline.
        reading = state.reading
        if reading is R_HEAD or reading is R_BODY:
            self.intake.unfinished(data, body_before)

    def eof_received(self) -> bool:
        # A client that closes its side has left, as for aiohttp: the
        # connection closes and its request is cancelled, with the replica's.
        return False

    def connection_lost(self, exc: Exception | None, cancel: bool = True) -> None:
        """The transport is gone; `cancel`: its request's task with it (a switched connection's
        handler sees the end itself, and ends its session its own way)."""
        self.port.connections.discard(self)
        self.state.lost()
        self.deadline.disarm()
        self.flow.stall_deadline = 0.0
        self._backlog = b""
        self.reader.drop_body()
        holding = self.holding
        holding.release(holding.held)
        if cancel and self.task is not None and not self.task.done():
            self.task.cancel()
        self.flow.fail(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        self.flow.pause()

    def resume_writing(self) -> None:
        self.flow.resume()

    # Reads -------------------------------------------------------------------------------

    def _feed_slices(self, data: bytes) -> None:
        """A large read, parsed a slice at a time, so that a client pipelining ahead
        is read only up to the first request queued behind the running one; the
        rest waits, unparsed, until that request starts."""
        end = len(data)
        start = 0
        state = self.state
        while start < end:
            self.data_received(data[start : start + _SLICE])
            start += _SLICE
            if state.reading is R_STOPPED:
                switching = self.reader.switching
                if switching is not None:
                    switching.extend(data[start:])
                return
            if state.pending and start < end:
                self._backlog = data[start:]
                return

    def _read_backlog(self) -> bool:
        """Parse what was read behind a queued request; True when nothing is left waiting."""
        backlog, self._backlog = self._backlog, b""
        if backlog:
            self.data_received(backlog)
        state = self.state
        return not (self._backlog or state.pending or state.reading is R_STOPPED)

    def _resume_reading(self) -> None:
        """Read again after a queued request; what the client was sending gets its deadline from now.

        While the router does not read, the client cannot be late: a head or
        body begun in the read that queued a request has no deadline until here,
        nor has the window in which a refused body is read and dropped.
        """
        self.transport.resume_reading()
        # (Nothing arms a read deadline while a request is queued.)
        reading = self.state.reading
        port = self.port
        if reading is R_HEAD:
            self.deadline.arm(port.header_timeout, D_HEAD)
        elif reading is R_BODY and not self.state.continue_owed:
            self.deadline.arm(port.body_timeout, D_BODY)
        elif reading is R_DISCARD:
            self.deadline.arm(DISCARD_SECONDS, D_DISCARD)

    def take_switched(self) -> bytes | None:
        """What the client sent after the head of a request that may switch protocols, handed over once."""
        reader = self.reader
        held = reader.switching
        if held is None:
            return None
        reader.switching = None
        return bytes(held)

    # Answering in order -------------------------------------------------------------

    def start(self, request: Request) -> None:
        """Run the request's cycle: it is the one being answered (ConnectionState.read or take_next said so)."""
        self.task = asyncio.get_running_loop().create_task(Cycle(self, self.holding, self.port, request).run())

    def answered(self, keep_alive: bool) -> None:
        """A request was answered (cycle.py), and the connection persists after it or not:
        what comes next is the state's to say (ConnectionState.answered), and done here."""
        self.task = None
        state = self.state
        then = state.answered(keep_alive)
        if then is N_WAIT:
            # The usual end: the connection idles under the keep-alive deadline, armed
            # here as ReadDeadline.arm would (this runs for every request).
            port = self.port
            sweep = port.sweep
            if sweep.timer is None:
                sweep.watch()
            deadline = self.deadline
            deadline.due = sweep.now + port.keepalive_timeout + sweep.every
            deadline.kind = D_IDLE
        elif then is N_CLOSE:
            self.close()
        elif then is N_START:
            self.start(state.take_next())
            if state.pending or state.reading is R_STOPPED:
                return
            # What was read but not yet parsed, up to the next request queued;
            # then, nothing queued ahead now, read on (the next head, or the body
            # of one whose head came meanwhile). Never while anything waits.
            if self._read_backlog():
                self._resume_reading()
        elif then is N_OWED:
            self.answer_owed()
        elif then is N_CONTINUE:
            write_continue(self.transport)
            self.deadline.arm(self.port.body_timeout, D_BODY)
        # (N_NOTHING: closing already, or a request arriving has its deadline.)

    def answer_owed(self) -> None:
        """Answer the refusal owed, now that the requests ahead of it are answered."""
        owed = self.state.take_owed()
        request_id = owed.request_id or self.port.new_request_id()
        Http11Writer(self, owed.head_only, request_id, True, False).answer(owed.reply)
        if self.state.reading is not R_DISCARD:
            self.close()
        # A DISCARD connection closes when the refused body ends, or at its deadline.

    async def drain(self) -> None:
        """Wait until the client took enough of its answer; WriteStalled when it takes nothing for long."""
        transport = self.transport
        if transport.is_closing() or self.state.answering is A_CLOSED:
            raise ConnectionResetError("the client went away")
        if self.flow.paused:
            port = self.port
            await self.flow.wait(port.sweep, port.write_stall_timeout)

    # Deadlines, closing ------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        return self.deadline.due > 0.0 or self.flow.stall_deadline > 0.0

    def check(self, now: float) -> None:
        """The sweep: act on a deadline that passed."""
        port = self.port
        flow = self.flow
        if 0.0 < flow.stall_deadline < now:
            flow.stall_deadline = 0.0
            port.protocol_errors.record(
                "write_stall", f"{self!r} took none of its answer for {port.write_stall_timeout:g} s"
            )
            flow.fail(WriteStalled("the client read nothing of its answer"))
            # Reset: a plain abort would leave the kernel holding what the client will not take.
            reset(self.transport)
            return
        deadline = self.deadline
        if not 0.0 < deadline.due < now:
            return
        kind = deadline.kind
        deadline.disarm()
        state = self.state
        if kind is D_HEAD:
            # A head that never ended: no answer is owed; the slot is freed.
            port.protocol_errors.record("head_timeout", f"{self!r} sent no whole head in time")
            if state.quiet():
                self.transport.abort()
            else:
                # The requests before it are answered first; then the connection closes.
                state.stop()
                self.transport.pause_reading()
        elif kind is D_BODY:
            self.intake.refuse(
                Refusal(408, "body_timeout", f"The request body did not arrive within {port.body_timeout:g} s.")
            )
        elif kind is D_DISCARD:
            if state.answering is A_IDLE and state.owed is None:
                self.close()
            else:
                state.stop()
        else:
            # An idle keep-alive connection's (armed only while nothing is answered).
            self.close()

    def close(self) -> None:
        """Close once what was written has been taken; abort if the client will not take it."""
        self.state.close()
        self.deadline.disarm()
        transport = self.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size():
            # close() would wait for the client to read it, perhaps forever.
            port = self.port
            self.flow.stall_deadline = time.monotonic() + port.write_stall_timeout
            port.sweep.watch()
        transport.close()

    def close_if_idle(self) -> None:
        if self.state.answering is A_IDLE:
            self.close()
