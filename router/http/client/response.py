"""A replica's answer: its head at once, its body as it arrives, read whole or piped into a sink."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol

from router.http.client.errors import BodyTooLarge, ConnectionBroken

# Above this many bytes queued for a reader that is not taking them, the
# replica's connection stops being read, so TCP pushes back to the replica.
_HIGH_WATER = 256 * 1024
# Compiled, a class named in a call is looked up in the module's dict each time; a Final
# name is a static. One queue is made per answer.
_QUEUE: Final = deque


class Source(Protocol):
    """What an answer needs of the connection it is read from (connection.py)."""

    paused: bool

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def abort(self) -> None: ...
    def response_released(self, response: Response) -> None: ...


class Response:
    """A replica's answer: the head at once, the body as it arrives.

    Read it whole with `read()`, or `pipe()` each chunk into a sink; then
    `release()` hands the connection back (or closes it if the body was not
    read to the end, so that a half-read answer never lingers).
    """

    __slots__ = (
        "_chunks",
        "_connection",
        "_done",
        "_error",
        "_queued",
        "_sink",
        "_waiter",
        "content_length",
        "headers",
        "reason_bytes",
        "status",
        "transfer_encoding",
    )

    def __init__(self, connection: Source, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self._connection = connection
        self.status = status
        # As the replica sent it, for the answer to the client.
        self.reason_bytes = reason
        # Raw (name, value) pairs in the replica's order and spelling.
        self.headers = headers
        self.content_length: int | None = None
        coding: bytes | None = None
        for name, value in headers:
            # (Told by length first: a lowered copy of every name costs more.)
            size = len(name)
            if size == 14:
                if name.lower() == b"content-length":
                    # llhttp has checked the digits; leading zeros are no part of the
                    # value (RFC 9110 8.6), and int() reads at most 4,300 digits: a value
                    # padded past that is stripped first, the usual one read as it is.
                    self.content_length = int(value) if len(value) < 20 else int(value.lstrip(b"0") or b"0")
            elif size == 17 and name.lower() == b"transfer-encoding":
                coding = value if coding is None else coding + b", " + value
        # Every Transfer-Encoding field's value, joined as one list.
        self.transfer_encoding = coding
        self._chunks: deque[bytes] = _QUEUE()
        self._queued = 0
        self._done = False
        self._error: ConnectionBroken | None = None
        self._waiter: asyncio.Future[None] | None = None
        # pipe(): called with each chunk in the protocol callback; True = the
        # sink's buffer is full and the replica should wait.
        self._sink: Callable[[bytes], bool] | None = None

    @property
    def reason(self) -> str:
        """The reason phrase as text, made when asked (the proxy passes `reason_bytes` on)."""
        return self.reason_bytes.decode("latin-1")

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header, by lower-case name."""
        size = len(name)
        for key, value in self.headers:
            # (Told by length first: a lowered copy of every name costs more.)
            if len(key) == size and key.lower() == name:
                return value
        return None

    # Fed by the connection ------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None and not self._chunks:
            if sink(data):
                self._connection.pause()
                self._wake()
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > _HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _finish(self, error: ConnectionBroken | None = None) -> None:
        # (Once: at its end, or when its connection fails in its body.)
        self._done = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # The proxy's side -------------------------------------------------------------

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; raises ConnectionBroken if it was cut short, BodyTooLarge past `limit` bytes."""
        while not self._done:
            if limit is not None and self._queued > limit:
                self._connection.abort()
                raise BodyTooLarge(f"the replica's answer is over {limit} bytes")
            self._connection.resume()
            await self._wait()
        if limit is not None and self._queued > limit:
            raise BodyTooLarge(f"the replica's answer is over {limit} bytes")
        if self._error is not None:
            raise self._error
        chunks, self._chunks = self._chunks, _QUEUE()
        self._queued = 0
        return b"".join(chunks)

    async def pipe(self, sink: Callable[[bytes], bool], drain: Callable[[], Any]) -> None:
        """Pass every chunk to `sink` as it arrives, until the body ends.

        `sink(chunk)` returns True when its buffer is full; reading from the
        replica then stops until `await drain()` returns. Raises
        ConnectionBroken if the replica broke off.
        """
        self._sink = sink
        try:
            while True:
                while self._chunks:
                    chunk = self._chunks.popleft()
                    self._queued -= len(chunk)
                    if sink(chunk):
                        await drain()
                if self._done:
                    break
                self._connection.resume()
                await self._wait()
                if self._connection.paused and not self._chunks and not self._done:
                    # The sink said full inside the callback.
                    await drain()
        finally:
            self._sink = None
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        self._sink = None
        self._connection.response_released(self)
