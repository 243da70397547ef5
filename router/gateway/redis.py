"""A small Redis client on asyncio: RESP2 over one connection, commands pipelined, every call bounded in time.

Only what the shared limits need (router.gateway.redis_limits): a command is
an array of bulk strings; a reply is a simple string, an error, an integer,
a bulk string or an array of those (RESP2, redis.io's protocol spec and
Redis's own `src/networking.c` writer). Commands of concurrent requests go
out on one connection as they come and their replies are matched in order
(Redis answers a connection's commands in order), so a request costs one
round trip and no connection of its own.

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
from collections.abc import Sequence

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


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError as overrun:
        raise RedisUnavailable("protocol", "a reply line past its bound") from overrun
    except asyncio.IncompleteReadError as cut:
        raise RedisUnavailable("reset", "the connection closed mid-reply") from cut
    return line[:-2]


def _number(text: bytes) -> int:
    body = text[1:] if text[:1] == b"-" else text
    if not body.isdigit() or len(text) > 20:
        raise RedisUnavailable("protocol", f"not a number: {text[:40]!r}")
    return int(text)


async def read_reply(reader: asyncio.StreamReader, depth: int = 0) -> RespValue:
    """One whole reply, bounded; RedisUnavailable("protocol") for anything RESP2 does not say."""
    line = await _line(reader)
    kind = line[:1]
    rest = line[1:]
    if kind == b"+":
        return rest
    if kind == b"-":
        return RedisError(rest.decode("utf-8", "replace"))
    if kind == b":":
        return _number(rest)
    if kind == b"$":
        size = _number(rest)
        if size == -1:
            return None
        if not 0 <= size <= MAX_BULK:
            raise RedisUnavailable("protocol", f"a bulk string of {size} bytes")
        try:
            data = await reader.readexactly(size + 2)
        except asyncio.IncompleteReadError as exc:
            raise RedisUnavailable("reset", "the connection closed mid-reply") from exc
        if data[-2:] != b"\r\n":
            raise RedisUnavailable("protocol", "a bulk string not ended by CRLF")
        return data[:-2]
    if kind == b"*":
        count = _number(rest)
        if count == -1:
            return None
        if not 0 <= count <= MAX_ARRAY or depth >= MAX_DEPTH:
            raise RedisUnavailable("protocol", f"an array of {count} at depth {depth}")
        return [await read_reply(reader, depth + 1) for _ in range(count)]
    raise RedisUnavailable("protocol", f"a reply starting {line[:40]!r}")


class RedisConnection:
    """One connection: commands written as they come, replies read in order by one task, each call with a deadline."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._waiting: collections.deque[asyncio.Future[RespValue]] = collections.deque()
        self.broken: RedisUnavailable | None = None
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, target: RedisTarget, timeout: float) -> RedisConnection:  # noqa: ASYNC109 (a deadline per call, below the loop's)
        try:
            if target.path:
                opening = asyncio.open_unix_connection(target.path, limit=MAX_LINE)
            else:
                opening = asyncio.open_connection(target.host, target.port, limit=MAX_LINE)
            reader, writer = await asyncio.wait_for(opening, timeout)
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable("connect", f"cannot connect to {target}: {exc or 'timed out'}") from exc
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while True:
                reply = await read_reply(self._reader)
                if not self._waiting:
                    raise RedisUnavailable("protocol", "a reply nobody asked for")
                future = self._waiting.popleft()
                if not future.done():
                    future.set_result(reply)
        except RedisUnavailable as unavailable:
            self._fail(unavailable)
        except (OSError, asyncio.IncompleteReadError) as broken:
            self._fail(RedisUnavailable("reset", str(broken) or "the connection closed"))

    def _fail(self, exc: RedisUnavailable) -> None:
        if self.broken is None:
            self.broken = exc
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(self.broken)
        self._writer.close()

    async def call(self, args: Sequence[bytes], timeout: float) -> RespValue:  # noqa: ASYNC109 (one timer, no task per call)
        """Send one command, wait for its reply at most `timeout` seconds."""
        if self.broken is not None:
            raise self.broken
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RespValue] = loop.create_future()
        self._waiting.append(future)
        self._writer.write(encode(args))
        late = loop.call_later(timeout, self._late, future, timeout)
        try:
            return await future
        finally:
            late.cancel()

    def _late(self, future: asyncio.Future[RespValue], timeout: float) -> None:
        if not future.done():
            # The replies after it would be matched to the wrong calls: the connection goes.
            self._fail(RedisUnavailable("timeout", f"no reply within {timeout:g} s"))
            self._task.cancel()

    async def close(self) -> None:
        self._task.cancel()
        if self.broken is None:
            self._fail(RedisUnavailable("reset", "closed by the router"))
        try:
            await self._task
        except asyncio.CancelledError:
            pass
