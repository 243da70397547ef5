"""One side of a connection that switched protocols (a WebSocket): its bytes, both ways, with flow control.

After a `101 Switching Protocols` neither side speaks HTTP any more: the
transport is handed to a Pipe (`transport.set_protocol`), which queues what
arrives for `read()` (reading stops while the queue is full, so TCP pushes
back to the sender) and writes with `write()` (True: the peer's buffer is
full, `await drain()`). The client port's side (server/writer.py) and the
replica's (client/upgrade.py) are the same class; what the bytes mean is no
business of this layer.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.http.transports import reset

# Above this many bytes queued and not read, the transport stops reading.
HIGH_WATER = 256 * 1024


class Pipe(asyncio.Protocol):
    """A switched connection's bytes: read() what arrives, write() what leaves, close() when done."""

    __slots__ = ("_chunks", "_drained", "_ended", "_lost", "_paused", "_queued", "_waiter", "received", "transport")

    def __init__(self, transport: asyncio.Transport, first: bytes = b"") -> None:
        self.transport = transport
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        # The peer sent its end (or the connection is gone): read() gives b"" once the queue is empty.
        self._ended = False
        self._lost = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        # Bytes read from the peer so far: evidence of life for an idle watch.
        self.received = 0
        if first:
            self.data_received(first)

    def attach(self) -> None:
        """Take the transport over from the HTTP protocol: what arrives from now on is this pipe's."""
        self.transport.set_protocol(self)

    # asyncio callbacks ---------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > HIGH_WATER and not self._lost:
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._ended = True
        self._wake()
        # The peer has finished: the connection closes, and its other half with it.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = self._lost = True
        self._wake()
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_exception(ConnectionResetError("the connection is gone"))
            drained.exception()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # The user's side -----------------------------------------------------------------

    async def read(self) -> bytes:
        """The next bytes from the peer; b"" once it ended and everything it sent was read."""
        while not self._chunks:
            if self._ended:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        before = self._queued
        self._queued -= len(chunk)
        if before > HIGH_WATER >= self._queued and not self._lost:
            self.transport.resume_reading()
        return chunk

    def write(self, data: bytes) -> bool:
        """Send `data` to the peer; True when its buffer is full (await drain())."""
        if self._lost or self.transport.is_closing():
            raise ConnectionResetError("the connection is gone")
        self.transport.write(data)
        return self._paused

    async def drain(self) -> None:
        """Until the peer has taken enough of what was written; ConnectionResetError if it went away."""
        if self._lost:
            raise ConnectionResetError("the connection is gone")
        if self._paused:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    @property
    def lost(self) -> bool:
        return self._lost

    def close(self, linger: float | None = None) -> None:
        """Close once what was written went out; with `linger`, abort if that takes longer.

        A peer that takes nothing would hold a closing transport open for
        ever, its unsent bytes with it: one whose buffer is already full
        (the writes paused) is aborted at once, any other after `linger`.
        """
        transport = self.transport
        if linger is not None and self._paused:
            reset(transport)
            return
        transport.close()
        if linger is not None and not self._lost:
            asyncio.get_running_loop().call_later(linger, self._linger_over)

    def _linger_over(self) -> None:
        if not self._lost:
            reset(self.transport)

    def abort(self) -> None:
        self.transport.abort()
