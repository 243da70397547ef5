"""One keep-alive connection to a replica, one request at a time: sent, answered, released or dropped.

A request is written in one `transport.write()`; its answer is read by the
connection's Reader (reader.py, its base). A connection whose answer was not
read to its end, or whose replica misbehaved, is never reused: it is closed,
or aborted, so that nothing it sent can reach another request.
"""

from __future__ import annotations

import asyncio
import select
from typing import TYPE_CHECKING, cast

from router.http.client.errors import ConnectionBroken, HeadTimeout, UpstreamIdle
from router.http.client.reader import _ACTIVE, _BODY, _CLOSED, _DONE, _IDLE, Reader
from router.http.client.response import Response
from router.http.origin import Origin

if TYPE_CHECKING:
    from router.http.client.pool import Client


class Connection(Reader):
    """One keep-alive connection to a replica; one request at a time."""

    # Set when the connection is made, before the connection is handed out.
    transport: asyncio.Transport

    def __init__(self, client: Client, origin: Origin) -> None:
        super().__init__(client)
        self.origin = origin
        self.paused = False
        # Part of the request still waits in the transport's buffer: the
        # transport's high-water mark is 0, so it says so the moment a write
        # is not taken whole by the kernel, and again once all of it is.
        self.sending = False
        # Asks the kernel whether anything (an end, a reset, bytes) waits
        # unread on the connection: what the event loop may not have seen yet.
        self.readable = select.poll()
        self.idle_since = 0.0
        # The sweep's view: `reads` when last seen (-1: not seen yet, or
        # paused) and since when (loop time) it has not changed.
        self.seen_reads = -1
        self.quiet_since = 0.0
        # The head deadline's length, for the error that says it passed.
        self.head_timeout = 0.0

    def __repr__(self) -> str:
        return f"<Connection {self.origin.key} {self.state.value}{' paused' if self.paused else ''}>"

    # asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(0)
        # (A stream transport, plain or TLS, under asyncio or uvloop, has its socket.)
        self.readable.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def pause_writing(self) -> None:
        self.sending = True

    def resume_writing(self) -> None:
        self.sending = False

    def eof_received(self) -> bool:
        # Not fed to the parser: a body delimited by the end of the connection
        # ends in connection_lost, and feed_data(b"") only yields on_body(b"").
        if self.sending and self.state is _ACTIVE:
            # The replica hung up before the request had gone out whole. A
            # close would go on writing the rest to no one, and once that
            # was done the request would look sent; an abort drops it now,
            # and connection_lost finds it unsent.
            self.transport.abort()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        state = self.state
        self.state = _CLOSED
        self.head_due = 0.0
        if state is _BODY:
            # (Body bytes of a read are handed on at its end: none are left here.)
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
                answered = self.reads != self.reads_at_send
                head.set_exception(
                    ConnectionBroken(
                        f"the replica closed the connection before answering: {exc or 'EOF'}",
                        before_head=True,
                        answered=answered,
                        unsent=self.sending and not answered,
                    )
                )
        # IDLE and DONE lose nothing; CLOSED was ended (and the request failed) by this side.
        self.client.forget(self)

    # Flow control --------------------------------------------------------------------

    def pause(self) -> None:
        """The answer's reader is full (Response._feed): no more is read until it takes some.
        (Called once per read at most, and reading stops at once: never twice in a row.)"""
        self.paused = True
        self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.state is not _CLOSED:
            self.paused = False
            self.transport.resume_reading()

    # The client's side ---------------------------------------------------------------

    def send(self, data: bytes, head_timeout: float | None) -> asyncio.Future[Response]:
        assert self.state is _IDLE, self
        loop = self.loop
        self.state = _ACTIVE
        self.reusable = False
        self.response = None
        self._status_line = b""
        self._headers = []
        self.reads_at_send = self.reads
        self.head = loop.create_future()
        if head_timeout is not None:
            # Checked by the client's one sweep (pool.py), never a timer per
            # request: a timer set and cancelled costs the loop more than the
            # rest of sending the request.
            self.head_due = self.client.head_due(head_timeout)
            self.head_timeout = head_timeout
        self.transport.write(data)
        return self.head

    def head_late(self) -> None:
        """The sweep's verdict: no head came before its deadline."""
        self.head_due = 0.0
        head = self.head
        if head is not None and not head.done():
            head.set_exception(HeadTimeout(f"no response head within {self.head_timeout:g} s"))

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
            self.client.idle_again(self)
        elif self.sending:
            # The replica answered before it had the whole request: the rest
            # would reach it as the start of the next one. Dropped unsent.
            self.abort()
        else:
            # Half read (BODY), or the replica said close: never reused.
            self.close()

    def close(self) -> None:
        if self.state is not _CLOSED:
            self.state = _CLOSED
            self.head_due = 0.0
            self.transport.close()
            self.client.forget(self)

    def abandon(self) -> None:
        """The caller gave up before the head (timeout, client gone): never reuse."""
        self.response = None
        self.head = None
        self.abort()

    def abort(self) -> None:
        if self.state is not _CLOSED:
            self.state = _CLOSED
            self.head_due = 0.0
            self.transport.abort()
            self.client.forget(self)

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
            return ConnectionBroken(message, before_head=True, answered=self.reads != self.reads_at_send)
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
                # In its body: the answer ends broken.
                self.response._finish(error)
        self._body.clear()
        self.abort()
