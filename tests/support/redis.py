"""A real `redis-server` for the tests (Debian's package), on a Unix socket of the test's own; and fakes that misbehave.

Skips, saying so, where redis-server is not installed (CI installs it: .ci/run).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests.support.waiting import until

REDIS = shutil.which("redis-server")


def need_redis() -> str:
    if REDIS is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package; CI installs it)")
    return REDIS


class RedisServer:
    """`redis-server` on a Unix socket, no persistence: started, killed, started again on the same socket."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "redis.sock"
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    async def start(self) -> None:
        self.process = subprocess.Popen(
            [
                need_redis(),
                "--port", "0",
                "--unixsocket", str(self.socket),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        await until(self.answers, timeout=10, what="redis-server did not answer PING")

    async def answers(self) -> bool:
        try:
            return await self.command(b"PING") == b"+PONG\r\n"
        except OSError:
            return False

    async def command(self, *args: bytes, db: int = 0) -> bytes:
        """One command sent raw (in database `db`), its reply read raw: a line, a bulk's head and body, or an
        array of integers."""
        reader, writer = await asyncio.open_unix_connection(str(self.socket))
        try:
            if db:
                writer.write(b"*2\r\n$6\r\nSELECT\r\n$%d\r\n%d\r\n" % (len(str(db)), db))
                assert await reader.readline() == b"+OK\r\n"
            writer.write(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
            await writer.drain()
            line = await reader.readline()
            if line.startswith(b"$") and not line.startswith(b"$-1"):
                line += await reader.readexactly(int(line[1:]) + 2)
            elif line.startswith(b"*"):
                for _ in range(int(line[1:])):
                    line += await reader.readline()
            return line
        finally:
            writer.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@contextlib.asynccontextmanager
async def redis_server(directory: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(directory)
    await server.start()
    try:
        yield server
    finally:
        server.stop()


Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_redis(answer: Answer) -> AsyncIterator[str]:
    """A TCP server on port 0 that answers as `answer` does (garbage, silence): its redis:// URL."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1)
