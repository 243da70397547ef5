"""Raw HTTP/1.1 on real sockets, both ways: hostile clients of the client port, misbehaving replicas.

`Wire` is a client that writes exact bytes to the router and reads each
answer the way a strict client would: by its Content-Length, by its chunks
(noting whether the last-chunk came), or to the end of the connection.
`RawReplica` is a replica that reads each request and answers with exact
bytes chosen by the test: the misbehaving upstream that no real engine is
kind enough to be on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def post(
    body: bytes | None = None,
    *,
    path: bytes = b"/v1/chat/completions",
    version: bytes = b"1.1",
    extra: bytes = b"",
    host: bytes | None = b"router",
) -> bytes:
    """A POST with a Content-Length, as bytes; `extra` is put among the headers."""
    if body is None:
        body = orjson.dumps(CHAT)
    head = b"POST " + path + b" HTTP/" + version + b"\r\n"
    if host is not None:
        head += b"Host: " + host + b"\r\n"
    head += b"Content-Type: application/json\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body)
    return head + body


def stream_post(*, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return post(orjson.dumps({**CHAT, "stream": True}), extra=extra, version=version)


@dataclass
class Answer:
    """One answer read off the wire, as the client received it, with how its body was delimited."""

    status: int
    head: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    # How the body was delimited: "length", "chunked", "close" or "none".
    framing: str
    # False when a chunked body ended without its last-chunk, or a length was not met.
    complete: bool

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def json(self) -> dict[str, object]:
        loaded = orjson.loads(self.body)
        assert isinstance(loaded, dict)
        return loaded


class Wire:
    """One raw client connection to the router."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, address: tuple[str, int] | None) -> Wire:
        assert address is not None
        reader, writer = await asyncio.open_connection(*address, limit=1 << 24)
        return cls(reader, writer)

    async def __aenter__(self) -> Wire:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self, *, timeout: float = 5.0, head_request: bool = False) -> Answer:
        return await asyncio.wait_for(self._answer(head_request), timeout)

    async def _answer(self, head_request: bool) -> Answer:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(b":") for line in lines[1:])]
        names = {k.lower(): v for k, v in headers}
        if head_request or 100 <= status < 200 or status in (204, 304):
            return Answer(status, head, headers, b"", "none", True)
        if b"content-length" in names:
            length = int(names[b"content-length"])
            try:
                body = await self.reader.readexactly(length)
            except asyncio.IncompleteReadError as exc:
                return Answer(status, head, headers, exc.partial, "length", False)
            return Answer(status, head, headers, body, "length", True)
        if names.get(b"transfer-encoding", b"").lower() == b"chunked":
            chunks = bytearray()
            try:
                while True:
                    size_line = await self.reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        # No trailers from the router: the last-chunk ends with CRLF.
                        assert await self.reader.readexactly(2) == b"\r\n"
                        return Answer(status, head, headers, bytes(chunks), "chunked", True)
                    chunks += await self.reader.readexactly(size)
                    assert await self.reader.readexactly(2) == b"\r\n"
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if isinstance(exc, asyncio.IncompleteReadError):
                    chunks += exc.partial
                return Answer(status, head, headers, bytes(chunks), "chunked", False)
        return Answer(status, head, headers, await self.reader.read(), "close", True)

    async def closed(self, timeout: float = 5.0) -> bytes:
        """Everything until the router closes the connection (fails the test if it does not)."""
        try:
            return await asyncio.wait_for(self.reader.read(), timeout)
        except ConnectionError:
            return b""


@dataclass
class Exchange:
    """One request as a RawReplica received it, and the means to answer it."""

    head: bytes
    body: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    index: int  # 1 for the first request the replica received

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


Script = Callable[[Exchange], Awaitable[None]]

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ending_quietly(handler: ConnectionHandler) -> ConnectionHandler:
    """`handler` for asyncio.start_server, ending quietly when the test's end cancels it mid-answer.

    Its task is start_server's, whose done callback (Python 3.11) asks a
    cancelled task for its exception and logs the raise as an error of the
    loop, which the suite fails a test for (tests/support/loops.py).
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except asyncio.CancelledError:
            writer.close()

    return handle


@dataclass
class RawReplica:
    """A replica that answers each request with the bytes `script` writes."""

    script: Script
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    server: asyncio.Server | None = None
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while not writer.is_closing():
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.script(Exchange(head, body, reader, writer, len(self.requests)))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.handlers.discard(task)
            writer.close()


StartRaw = Callable[[Script], Awaitable[RawReplica]]


@contextlib.asynccontextmanager
async def raw_replicas() -> AsyncIterator[StartRaw]:
    started: list[RawReplica] = []

    async def start(script: Script) -> RawReplica:
        replica = RawReplica(script)
        replica.server = await asyncio.start_server(ending_quietly(replica.handle), "127.0.0.1", 0)
        started.append(replica)
        return replica

    try:
        yield start
    finally:
        for replica in started:
            assert replica.server is not None
            replica.server.close()
            for task in list(replica.handlers):
                task.cancel()
            await asyncio.gather(*replica.handlers, return_exceptions=True)
            await replica.server.wait_closed()


def sse_head(extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n" + extra + b"\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


JSON_OK = orjson.dumps({"id": "x", "object": "chat.completion", "choices": []})


def json_answer(body: bytes = JSON_OK, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
