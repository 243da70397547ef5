"""A deadline for a connection's first request head (slowloris).

aiohttp reads request heads without a deadline: a client sending one header
byte a second keeps a connection, a task and a file descriptor forever. This
protocol sits in front of aiohttp's request handler and closes a connection
whose first head (up to the blank line) has not arrived within the timeout.
Everything is passed to aiohttp unchanged; once the head is complete, the
check is one attribute test per read.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

_END_OF_HEAD = b"\r\n\r\n"


class HeadDeadline(asyncio.Protocol):
    def __init__(self, inner: Any, timeout: float, on_expire: Any = None) -> None:
        self.inner = inner
        self.timeout = timeout
        self._on_expire = on_expire
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but abort() all.
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self._expire)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            # Bare-LF heads are refused by the parser anyway; CRLF CRLF ends a head.
            if _END_OF_HEAD in self._tail + data:
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = (self._tail + data)[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self.inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _expire(self) -> None:
        self._timer = None
        if self._on_expire is not None:
            self._on_expire()
        if self._transport is not None:
            self._transport.abort()
