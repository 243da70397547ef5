"""Every byte of HTTP/1.1 framing the client port writes: answers, streams, 100 (Continue).

A whole answer is one write, with its Content-Length; a stream writes its
head, then chunks (chunked on HTTP/1.1; on HTTP/1.0 none, and the close ends
the body); a stream that breaks is closed without its last-chunk, so that it
looks broken. The rules hold whatever the handler does: no body on 204, 304
or a HEAD request; a declared length is met exactly (a stream that ends short
is aborted, never padded or passed off as whole); nothing after the end.
Whether the connection persists after the answer is the writer's to say
(`keep_alive`): the request asked, and a handler or the framing (an HTTP/1.0
stream) may close it.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Final, Protocol

from router.http.messages import Reply
from router.http.pipe import Pipe
from router.http.server.flow import Flow
from router.http.wire import frame_head
from router.http.writer import Meter

CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


class Written(Protocol):
    """The connection an answer is written on (connection.py), as its writer needs it."""

    transport: asyncio.Transport
    flow: Flow

    def close(self) -> None: ...
    async def drain(self) -> None: ...
    def take_switched(self) -> bytes | None:
        """What the client sent after the head of a request that may switch protocols (None: it may not),
        handed over once."""

    # The switched connection's own transport callbacks, passed on (Switched).
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...
    def connection_lost(self, exc: Exception | None, cancel: bool = True) -> None: ...


def write_continue(transport: asyncio.Transport) -> None:
    """The 100 (Continue) a request asked for, once it is the one being answered (its connection open)."""
    transport.write(CONTINUE)


class Phase(enum.Enum):
    """How far a Writer's answer is."""

    NEW = "new"  # nothing written
    STREAMING = "streaming"  # a stream's head is out
    DONE = "done"  # answered (or aborted): nothing more


# Module-level names: the per-write checks are one global load and an `is`
# (an Enum member read through its class goes through the metaclass, ~60 ns).
# (Final: a compiled module reads them as constants, not from its dict.)
NEW: Final = Phase.NEW
STREAMING: Final = Phase.STREAMING
DONE: Final = Phase.DONE


class Http11Writer:
    """One request's answer on its HTTP/1.1 connection (router.http.writer.Writer)."""

    __slots__ = (
        "_chunked",
        "_connection",
        "_flow",
        "_head_only",
        "_left",
        "_no_body",
        "_request_id",
        "_transport",
        "_version_11",
        "keep_alive",
        "meter",
        "phase",
    )

    def __init__(
        self, connection: Written, head_only: bool, request_id: bytes, version_11: bool, keep_alive: bool
    ) -> None:
        # (A request's Cycle, cycle.py, sets the same fields itself: keep the two in step.)
        self._connection = connection
        self._transport = connection.transport
        self._flow = connection.flow
        self._head_only = head_only
        # Sent back on every answer (X-Request-Id).
        self._request_id = request_id
        # The request's own version, not the connection's: the head of the next
        # request may be read (and its version with it) while this answer is written.
        self._version_11 = version_11
        # Whether the connection persists after this answer.
        self.keep_alive = keep_alive
        self.phase = NEW
        # Whoever counts this answer (the access log's entry), if anyone: the
        # writer fills in the status and counts the bytes written.
        self.meter: Meter | None = None
        # start() sets, and only a started stream reads: whether no body may
        # follow the head (_no_body), whether it is chunked (_chunked), and
        # the bytes still owed when it declared a length (_left; -1: none).

    @property
    def started(self) -> bool:
        return self.phase is not NEW

    def _persistence(self) -> bytes:
        if not self.keep_alive:
            return b"Connection: close\r\n"
        if self._version_11:
            return b""
        # HTTP/1.0 closes by default: say that this one stays open.
        return b"Connection: keep-alive\r\n"

    def answer(self, reply: Reply) -> None:
        if self.phase is not NEW:
            raise RuntimeError(f"an answer was already {'begun' if self.phase is STREAMING else 'written'}")
        self.phase = DONE
        transport = self._transport
        if transport.is_closing():
            return
        status = reply.status
        body = reply.body
        # (What _persistence() says, inline: this runs for every answer.)
        if not self.keep_alive:
            persistence = b"Connection: close\r\n"
        elif self._version_11:
            persistence = b""
        else:
            persistence = b"Connection: keep-alive\r\n"
        if status == 204 or status == 304:  # noqa: PLR1714 (two compares beat a tuple here)
            # 204 and 304 carry neither a body nor a length (RFC 9110 8.6).
            framing = b"%sX-Request-Id: %s\r\n\r\n" % (persistence, self._request_id)
            body = b""
        else:
            # One format for the framing lines: this runs for every answer.
            framing = b"Content-Length: %d\r\n%sX-Request-Id: %s\r\n\r\n" % (len(body), persistence, self._request_id)
        head = frame_head(status, reply.reason, reply.headers, framing)
        if self._head_only or not body:
            transport.write(head)
        elif len(body) > 65536:
            # A big answer (embeddings of a large batch) is not copied into the head.
            transport.writelines((head, body))
        else:
            transport.write(head + body)
        meter = self.meter
        if meter is not None:
            meter.status = status
            meter.bytes_out = len(head) if self._head_only else len(head) + len(body)

    def start(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], *, length: int | None = None
    ) -> None:
        """The head of a streamed answer; `length` when the body's size is known (Content-Length)."""
        if self.phase is not NEW:
            raise RuntimeError("the answer's head was already written")
        self.phase = STREAMING
        if self.meter is not None:
            self.meter.status = status
        self._no_body = no_body = self._head_only or status in (204, 304) or 100 <= status < 200
        self._left = -1 if length is None else length
        self._chunked = False
        if no_body:
            framing = b"Content-Length: %d\r\n" % length if length is not None and status not in (204, 304) else b""
        elif length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif self._version_11:
            framing = b"Transfer-Encoding: chunked\r\n"
            self._chunked = True
        else:
            # HTTP/1.0 has no chunks: the end of the connection ends the body.
            framing = b""
            self.keep_alive = False
        framing += self._persistence()
        transport = self._transport
        if not transport.is_closing():
            headers = [*headers, (b"X-Request-Id", self._request_id)]
            transport.write(frame_head(status, reason, headers, framing + b"\r\n"))

    def write(self, data: bytes) -> bool:
        """One piece of the body; True when the client's buffer is full (await drain())."""
        if self.phase is not STREAMING:
            raise RuntimeError("write() outside a started, unfinished stream")
        transport = self._transport
        if transport.is_closing():
            return True
        if not data or self._no_body:
            # An empty piece would be a chunked body's last-chunk; a body on a
            # HEAD, 204 or 304 answer would be read as the next answer.
            return self._flow.paused
        if self._left >= 0:
            if len(data) > self._left:
                raise RuntimeError(f"{len(data)} bytes written where {self._left} were left of the declared length")
            self._left -= len(data)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if self.meter is not None:
            self.meter.bytes_out += len(data)
        return self._flow.paused

    def body_sink(self) -> Callable[[bytes], bool]:
        """write(), made for this stream: what a stream's source calls per piece, in its own callback.

        A chunked stream with no declared length (the common one) writes with
        the framing checks done once here, not per piece; the others keep write().
        """
        if self.phase is not STREAMING:
            raise RuntimeError("body_sink() outside a started, unfinished stream")
        transport = self._transport
        if self._no_body or self._left >= 0 or not self._chunked or self.meter is not None:
            return self.write
        flow = self._flow

        def write_chunk(data: bytes) -> bool:
            if self.phase is not STREAMING:
                raise RuntimeError("a piece written after the stream's end")
            if transport.is_closing():
                return True
            if data:
                # An empty piece would be the last-chunk: never written here.
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return flow.paused

        return write_chunk

    def end(self) -> None:
        """The body is complete."""
        if self.phase is not STREAMING:
            raise RuntimeError("end() outside a started, unfinished stream")
        if self._left > 0 and not self._no_body:
            # Short of its declared length: a complete-looking answer would be a lie.
            self.abort()
            return
        self.phase = DONE
        transport = self._transport
        if self._chunked and not transport.is_closing():
            transport.write(b"0\r\n\r\n")

    def abort(self, last_words: bytes = b"") -> None:
        """The answer broke off: `last_words` (an SSE error event) if any, then close without its end.

        Without the last-chunk (or with a length unmet) the client's HTTP
        library sees the answer cut short, as it was.
        """
        if self.phase is STREAMING and last_words and not self._no_body and self._left < 0:
            self.write(last_words)
        self.phase = DONE
        self.keep_alive = False
        self._connection.close()

    def close_after(self) -> None:
        """Close the connection once this answer is out."""
        self.keep_alive = False

    async def drain(self) -> None:
        """Wait until the client took enough; WriteStalled when it takes nothing for write_stall_timeout."""
        await self._connection.drain()

    def switch(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> Pipe | None:
        """The head of a protocol switch (101), then the connection's bytes are the Pipe's, both ways.

        Only for a request the server's upgrade_check passed (its connection holds
        what the client sent after the head, and reads nothing more as HTTP); the
        connection closes when the handler returns.
        """
        transport = self._transport
        if self.phase is not NEW or transport.is_closing():
            return None
        held = self._connection.take_switched()
        if held is None:
            return None
        self.phase = DONE
        self.keep_alive = False
        head = frame_head(status, reason, [*headers, (b"X-Request-Id", self._request_id)], b"\r\n")
        transport.write(head)
        if self.meter is not None:
            self.meter.status = status
            self.meter.bytes_out = len(head)
        pipe = Switched(self._connection, held)
        pipe.attach()
        transport.resume_reading()
        return pipe


class Switched(Pipe):
    """The client's side of a switched connection: its end ends the connection as the server knows it."""

    __slots__ = ("_connection",)

    def __init__(self, connection: Written, first: bytes) -> None:
        super().__init__(connection.transport, first)
        self._connection = connection

    def pause_writing(self) -> None:
        super().pause_writing()
        self._connection.pause_writing()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._connection.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connection.connection_lost(exc, cancel=False)
