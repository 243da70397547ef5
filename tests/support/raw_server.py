"""Raw HTTP servers standing in for replicas: they count connections and requests and write each answer's bytes.

For the upstream client's tests and the gateway's; the `raw_server` fixture
(tests/conftest.py) starts them on 127.0.0.1 port 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router.http.origin import Origin

HEAD = b"POST /v1/x?a=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n"


Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class RawServer:
    """Counts connections and requests; `answer` writes the bytes of each response."""

    answer: Answer
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    eofs: int = 0
    server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    @property
    def origin(self) -> Origin:
        return Origin.parse(f"http://{self.address}")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.answer(reader, writer, len(self.requests))
                if writer.is_closing():
                    return
        except asyncio.IncompleteReadError:
            self.eofs += 1
        except (ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


StartRaw = Callable[[Answer], Awaitable[RawServer]]


def fixed(data: bytes, *, close: bool = False) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()

    return answer


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Kept: yes\r\n\r\nhello"
