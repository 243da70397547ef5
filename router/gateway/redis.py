"""A small Redis client on asyncio: RESP2 over one connection, commands pipelined, every call bounded in time.

Only what the shared limits need (router.gateway.redis_limits): a command is
an array of bulk strings; a reply is a simple string, an error, an integer,
a bulk string or an array of those (RESP2, redis.io's protocol spec and
Redis's own `src/networking.c` writer). Commands of concurrent requests go
out on one connection as they come and their replies are matched in order
(Redis answers a connection's commands in order), so a request costs one
round trip and no connection of its own. The connection is an asyncio
Protocol: replies are parsed from its buffer as bytes arrive, by a plain
function (`parse`), with no task or coroutine per reply.

Whatever goes wrong is a `RedisUnavailable` with a `reason` (timeout,
connect, reset, protocol), and the connection is dropped: a reply not read
in time, or that does not parse, leaves nothing that can be trusted on it.
Replies are bounded (a bulk string, an array, the nesting) so that a wrong
server cannot make the router buffer without end. A `-ERR ...` reply is not
a failure of the connection: it is returned as a `RedisError` value.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import cast

from router.core.config.limits import RedisTarget

MAX_BULK = 1 << 20
MAX_ARRAY = 1024
MAX_DEPTH = 4
MAX_LINE = 64 * 1024


class RedisError:
    """An error reply (`-NOSCRIPT No matching script...`): Redis's answer, not a broken connection."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    @property
    def code(self) -> str:
        return self.message.partition(" ")[0]

    def __repr__(self) -> str:
        return f"RedisError({self.message!r})"


# A reply is one of these (a RESP2 array holds any of them, nested).
RespValue = bytes | int | list["RespValue"] | RedisError | None


class RedisUnavailable(Exception):
    """No reply could be had: `reason` is timeout, connect, reset or protocol."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(args: Sequence[bytes]) -> bytes:
    """One command as RESP2: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def parse(buffer: bytes | bytearray, at: int = 0, depth: int = 0) -> tuple[RespValue, int]:
    """One whole reply from `buffer` at `at`: (it, where the next begins), or (None, -1) while it is incomplete;
    RedisUnavailable("protocol") for anything RESP2 does not say or a reply past its bounds."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        if len(buffer) - at > MAX_LINE:
            raise RedisUnavailable("protocol", "a reply line past its bound")
        return None, -1
    kind = buffer[at]
    line = bytes(buffer[at + 1 : end])
    after = end + 2
    if kind == 0x2B:  # +
        return line, after
    if kind == 0x2D:  # -
        return RedisError(line.decode("utf-8", "replace")), after
    if kind == 0x3A:  # :
        return _number(line), after
    if kind == 0x24:  # $
        size = _number(line)
        if size == -1:
            return None, after
        if not 0 <= size <= MAX_BULK:
            raise RedisUnavailable("protocol", f"a bulk string of {size} bytes")
        if len(buffer) < after + size + 2:
            return None, -1
        if buffer[after + size : after + size + 2] != b"\r\n":
            raise RedisUnavailable("protocol", "a bulk string not ended by CRLF")
        return bytes(buffer[after : after + size]), after + size + 2
    if kind == 0x2A:  # *
        count = _number(line)
        if count == -1:
            return None, after
        if not 0 <= count <= MAX_ARRAY or depth >= MAX_DEPTH:
            raise RedisUnavailable("protocol", f"an array of {count} at depth {depth}")
        items: list[RespValue] = []
        for _ in range(count):
            item, after = parse(buffer, after, depth + 1)
            if after < 0:
                return None, -1
            items.append(item)
        return items, after
    raise RedisUnavailable("protocol", f"a reply starting {bytes(buffer[at : at + 40])!r}")


def _number(text: bytes) -> int:
    body = text[1:] if text[:1] == b"-" else text
    if not body.isdigit() or len(text) > 20:
        raise RedisUnavailable("protocol", f"not a number: {text[:40]!r}")
    return int(text)


class RedisConnection(asyncio.Protocol):
    """One connection: commands written as they come, replies parsed as they arrive (no task, no coroutine per
    reply) and matched in order, each call with a deadline."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiting: collections.deque[asyncio.Future[RespValue]] = collections.deque()
        # Where the replies of calls whose callers were cancelled once they were sent go (call's `abandoned`).
        self._handoffs: dict[asyncio.Future[RespValue], Callable[[RespValue], None]] = {}
        self.broken: RedisUnavailable | None = None
        # Given no more calls: closed once the replies it owes are read (retire()).
        self.retiring = False

    @classmethod
    async def open(cls, target: RedisTarget, timeout: float) -> RedisConnection:  # noqa: ASYNC109 (a deadline per call, below the loop's)
        loop = asyncio.get_running_loop()
        try:
            if target.path:
                opening = loop.create_unix_connection(cls, target.path)
            else:
                opening = loop.create_connection(cls, target.host, target.port)
            _, connection = await asyncio.wait_for(opening, timeout)
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable("connect", f"cannot connect to {target}: {exc or 'timed out'}") from exc
        return connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses, but are one.
        self._transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        try:
            while at < len(buffer):
                reply, end = parse(buffer, at)
                if end < 0:
                    break
                at = end
                if not self._waiting:
                    raise RedisUnavailable("protocol", "a reply nobody asked for")
                future = self._waiting.popleft()
                if not future.done():
                    future.set_result(reply)
                elif self._handoffs:
                    # Its caller was cancelled while it waited: its reply to where the call said.
                    handoff = self._handoffs.pop(future, None)
                    if handoff is not None:
                        asyncio.get_running_loop().call_soon(handoff, reply)
        except RedisUnavailable as exc:
            self._fail(exc)
            return
        del buffer[:at]
        if self.retiring and not self._waiting and self._transport is not None:
            self._transport.close()

    def retire(self) -> None:
        """Take no more calls, and close once the replies owed to calls already sent are read: a
        server that refuses them all (READONLY) still answers each, and each caller learns why."""
        self.retiring = True
        if not self._waiting and self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisUnavailable("reset", str(exc) if exc else "the connection closed"))

    def _fail(self, exc: RedisUnavailable) -> None:
        if self.broken is None:
            self.broken = exc
        # No reply comes now: what the abandoned calls did is not known.
        self._handoffs.clear()
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(self.broken)
        if self._transport is not None:
            self._transport.abort()

    async def call(
        self,
        args: Sequence[bytes],
        timeout: float,  # noqa: ASYNC109 (one timer, no task per call)
        abandoned: Callable[[RespValue], None] | None = None,
    ) -> RespValue:
        """Send one command, wait for its reply at most `timeout` seconds.

        `abandoned`: where its reply goes if the caller is cancelled once the command is sent (a
        command that changes something, whose caller must learn what it did); else that reply is
        read and dropped.
        """
        if self.broken is not None:
            raise self.broken
        if self.retiring:
            raise RedisUnavailable("reset", "the connection is being closed")
        assert self._transport is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RespValue] = loop.create_future()
        self._waiting.append(future)
        if abandoned is not None:
            # Registered before the wait: a cancellation may come before its reply is read, or after.
            self._handoffs[future] = abandoned
        self._transport.write(encode(args))
        late = loop.call_later(timeout, self._late, future, timeout)
        try:
            return await future
        except asyncio.CancelledError:
            # Read in the same turn as the cancellation, before this caller woke: handed on here.
            # (Cancelled before it was read, data_received hands it on when it is; another call's
            # deadline still ends a Redis that never answers it.)
            if abandoned is not None and future.done() and not future.cancelled() and future.exception() is None:
                loop.call_soon(abandoned, future.result())
            raise
        finally:
            late.cancel()
            if abandoned is not None and not future.cancelled():
                self._handoffs.pop(future, None)

    def _late(self, future: asyncio.Future[RespValue], timeout: float) -> None:
        if not future.done():
            # The replies after it would be matched to the wrong calls: the connection goes.
            self._fail(RedisUnavailable("timeout", f"no reply within {timeout:g} s"))

    async def close(self) -> None:
        if self.broken is None:
            self._fail(RedisUnavailable("reset", "closed by the router"))
