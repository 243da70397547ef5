"""The request in progress on one upstream connection: where it is, the future of its head, its answer.

One connection carries one request at a time, and an Exchange is that
request as the connection, its reader and the client's watch see it (httpcore
gives its connection a state enum the same way). Its states:

    IDLE --send--> ACTIVE --head--> BODY --end--> DONE --released, reusable--> IDLE
    (any) --closed, aborted, lost--> CLOSED

The connection moves it on the hot path by its fields, not by a method per
step: a method call costs about as much as the step itself. What is done
once per failure (a head gone late, an end in the middle) is a method here.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Final

from router.http.client.errors import ConnectionBroken
from router.http.client.response import Response


class State(enum.Enum):
    """Where one connection is in its one request at a time."""

    # No request in progress: new, or in the pool. Any byte now is unsolicited.
    IDLE = "idle"
    # Request sent, no response head yet (the head deadline's time).
    ACTIVE = "active"
    # Head handed over, body in progress (the silence watch's time).
    BODY = "body"
    # Answer complete, not yet released. Any byte now is a second answer.
    DONE = "done"
    CLOSED = "closed"


# Module-level names: the per-read state checks are one global load and an `is`
# (Final: a compiled module reads them as constants, not from its dict).
IDLE: Final = State.IDLE
ACTIVE: Final = State.ACTIVE
BODY: Final = State.BODY
DONE: Final = State.DONE
CLOSED: Final = State.CLOSED


class Exchange:
    """One connection's request in progress: its state, the future of its head, and its answer once headed."""

    __slots__ = ("head", "head_due", "head_timeout", "reads_at_send", "response", "reusable", "state")

    def __init__(self) -> None:
        self.state = IDLE
        # The caller's wait for the head; then the answer it was given.
        self.head: asyncio.Future[Response] | None = None
        self.response: Response | None = None
        # Whether the connection may serve another request once this answer is read.
        self.reusable = False
        # When the head must have come (the watch's clock; 0: no deadline), and the deadline's length.
        self.head_due = 0.0
        self.head_timeout = 0.0
        # The connection's reads when the request was sent: any since is some of an answer.
        self.reads_at_send = 0

    def fail(self, error: ConnectionBroken) -> None:
        """The request in progress ends with `error`: its head's waiter, or its answer in the middle of its body."""
        head = self.head
        if head is not None and not head.done():
            head.set_exception(error)
        elif self.response is not None:
            self.response._finish(error)

    def lost(self, exc: Exception | None, reads: int, sending: bool) -> None:
        """The connection is gone (`exc`: how), with `reads` reads so far and part of the request unsent or not."""
        state = self.state
        self.state = CLOSED
        self.head_due = 0.0
        if state is BODY:
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
        elif state is ACTIVE:
            head = self.head
            if head is not None and not head.done():
                answered = reads != self.reads_at_send
                # A reset with nothing answered says the replica never read the
                # request whole: a TCP closed with received data still unread,
                # or met by data after its close, resets to show that data was
                # lost (RFC 1122 4.2.2.13). That is the keep-alive race as it
                # most often ends, the replica's idle timer firing with the
                # request already in its kernel; a close after reading it all
                # is a FIN, and may have run it.
                unread = sending or isinstance(exc, ConnectionResetError)
                head.set_exception(
                    ConnectionBroken(
                        f"the replica closed the connection before answering: {exc or 'EOF'}",
                        before_head=True,
                        answered=answered,
                        unsent=unread and not answered,
                    )
                )
        # IDLE and DONE lose nothing; CLOSED was ended (and the request failed) by this side.

    def broken(self, message: str, reads: int) -> ConnectionBroken:
        """The error for the request in progress, before or after its head (`reads`: the connection's so far)."""
        if self.state is ACTIVE:
            return ConnectionBroken(message, before_head=True, answered=reads != self.reads_at_send)
        return ConnectionBroken(message, before_head=False)
