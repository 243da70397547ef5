"""One keep-alive connection to a replica, one request at a time: sent, answered, released or dropped.

A request is written in one `transport.write()`; the request in progress is
the connection's Exchange (exchange.py), and its answer is read by its
ResponseReader (reader.py), which llhttp calls back. The pool (pool.py) is
reached through two methods (Keeper); the watch on late heads and silent
bodies (watch.py) is the pool's, one for all its connections. A connection
whose answer was not read to its end, or whose replica misbehaved, is never reused: it is closed,
or aborted, so that nothing it sent can reach another request.
"""

from __future__ import annotations

import asyncio
import select
from typing import Protocol, cast

from router.http.client.errors import ConnectionBroken, HeadTimeout, UpstreamIdle
from router.http.client.exchange import ACTIVE, CLOSED, DONE, IDLE, Exchange
from router.http.client.reader import ResponseReader
from router.http.client.response import Response
from router.http.client.watch import Watch
from router.http.origin import Origin
from router.http.protocol_errors import ProtocolErrors


class Keeper(Protocol):
    """What a connection needs of its pool (pool.py): to be pooled again, and to be forgotten."""

    def idle_again(self, connection: Connection) -> None: ...
    def forget(self, connection: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; one request at a time."""

    # Set when the connection is made, before the connection is handed out.
    transport: asyncio.Transport

    def __init__(self, keeper: Keeper, watch: Watch, protocol_errors: ProtocolErrors, origin: Origin) -> None:
        self.keeper = keeper
        self.watch = watch
        self.protocol_errors = protocol_errors
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.exchange = exchange = Exchange()
        self.reader = ResponseReader(self, exchange, watch)
        # Reads so far: the watch's evidence of life, and (against the
        # exchange's `reads_at_send`) whether any byte came back for a request.
        self.reads = 0
        self.paused = False
        # Part of the request still waits in the transport's buffer: the
        # transport's high-water mark is 0, so it says so the moment a write
        # is not taken whole by the kernel, and again once all of it is.
        self.sending = False
        # Asks the kernel whether anything (an end, a reset, bytes) waits
        # unread on the connection: what the event loop may not have seen yet.
        self.readable = select.poll()
        self.idle_since = 0.0
        # The watch's view: `reads` when last seen (-1: not seen yet, or
        # paused) and since when (its clock) it has not changed.
        self.seen_reads = -1
        self.quiet_since = 0.0

    def __repr__(self) -> str:
        return f"<Connection {self.origin.key} {self.exchange.state.value}{' paused' if self.paused else ''}>"

    # asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(0)
        # (A stream transport, plain or TLS, under asyncio or uvloop, has its socket.)
        self.readable.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        self.reader.feed(data)

    def pause_writing(self) -> None:
        self.sending = True

    def resume_writing(self) -> None:
        self.sending = False

    def eof_received(self) -> bool:
        # Not fed to the parser: a body delimited by the end of the connection
        # ends in connection_lost, and feed_data(b"") only yields on_body(b"").
        if self.sending and self.exchange.state is ACTIVE:
            # The replica hung up before the request had gone out whole. A
            # close would go on writing the rest to no one, and once that
            # was done the request would look sent; an abort drops it now,
            # and connection_lost finds it unsent.
            self.transport.abort()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.exchange.lost(exc, self.reads, self.sending)
        self.keeper.forget(self)

    # Flow control --------------------------------------------------------------------

    def pause(self) -> None:
        """The answer's reader is full (Response._feed): no more is read until it takes some.
        (Called once per read at most, and reading stops at once: never twice in a row.)"""
        self.paused = True
        self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.exchange.state is not CLOSED:
            self.paused = False
            self.transport.resume_reading()

    # The client's side ---------------------------------------------------------------

    def send(self, data: bytes, head_timeout: float | None) -> asyncio.Future[Response]:
        exchange = self.exchange
        assert exchange.state is IDLE, self
        # The exchange's fields, set here rather than by a method of its: this runs per request.
        exchange.state = ACTIVE
        exchange.reusable = False
        exchange.response = None
        exchange.reads_at_send = self.reads
        exchange.head = head = self.loop.create_future()
        if head_timeout is not None:
            # Checked by the one watch (watch.py), never a timer per request.
            exchange.head_due = self.watch.head_due(head_timeout)
            exchange.head_timeout = head_timeout
        self.transport.write(data)
        return head

    def head_late(self) -> None:
        """The watch's verdict: no head came before its deadline."""
        exchange = self.exchange
        exchange.head_due = 0.0
        head = exchange.head
        if head is not None and not head.done():
            head.set_exception(HeadTimeout(f"no response head within {exchange.head_timeout:g} s"))

    def went_quiet(self, seconds: float) -> None:
        """The watch's verdict: the body stopped coming."""
        self.fail(
            "idle_timeout", UpstreamIdle(f"the replica sent nothing for {seconds:g} s in the middle of its answer")
        )

    def response_released(self, response: Response) -> None:
        exchange = self.exchange
        if response is not exchange.response:
            return
        exchange.response = None
        exchange.head = None
        if exchange.state is DONE and exchange.reusable and not self.sending:
            exchange.state = IDLE
            self.resume()
            self.keeper.idle_again(self)
        elif self.sending:
            # The replica answered before it had the whole request: the rest
            # would reach it as the start of the next one. Dropped unsent.
            self.abort()
        else:
            # Half read (BODY), or the replica said close: never reused.
            self.close()

    def close(self) -> None:
        exchange = self.exchange
        if exchange.state is not CLOSED:
            exchange.state = CLOSED
            exchange.head_due = 0.0
            self.transport.close()
            self.keeper.forget(self)

    def abandon(self) -> None:
        """The caller gave up before the head (timeout, client gone): never reuse."""
        exchange = self.exchange
        exchange.response = None
        exchange.head = None
        self.abort()

    def abort(self) -> None:
        exchange = self.exchange
        if exchange.state is not CLOSED:
            exchange.state = CLOSED
            exchange.head_due = 0.0
            self.transport.abort()
            self.keeper.forget(self)

    # The reader's faults (reader.Faulted) ----------------------------------------------

    def switched(self) -> None:
        self.fail(
            "switched_protocols",
            ConnectionBroken(
                "the replica switched protocols (101) instead of answering", before_head=True, answered=True
            ),
        )

    def broken(self, message: str) -> ConnectionBroken:
        """The error for the request in progress, before or after its head."""
        return self.exchange.broken(message, self.reads)

    def fail(self, reason: str, error: ConnectionBroken | None, detail: str = "") -> None:
        """A replica's protocol error: count it, end the request in progress with `error`, drop the connection.

        `reason` is one of a fixed set (the metric's label); the connection
        is aborted, never pooled, so nothing it sent can reach another request.
        """
        self.protocol_errors.record(reason, f"replica {self.origin.key}: {error or detail}")
        if error is not None:
            self.exchange.fail(error)
        self.reader.drop()
        self.abort()
