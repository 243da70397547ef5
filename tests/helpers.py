"""What the test modules share: a real client's calls, waiting, scraping, raw servers, a router process.

Nothing here fakes the router: these are clients, probes and the outside
world (raw HTTP servers standing in for replicas) that the tests drive it with.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from router.http.origin import Origin
from router.run.app import RouterServer
from router.tools import ctl
from tests.wire import ending_quietly

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def in_flight(server: RouterServer) -> dict[str, int]:
    return {r.id: r.in_flight for r in server.pool}


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers or {"Content-Type": "application/json"}) as resp,
    ):
        return resp.status, resp.headers.copy(), await resp.read()


async def post_cut(url: str, body: bytes) -> tuple[int, bytes, bool]:
    """POST and read the answer as far as it goes: (status, body so far, whether it ended properly).

    A broken answer must look broken: the router closes it without the
    chunked last-chunk, which an HTTP library reports as an incomplete body.
    """
    received = bytearray()
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp,
    ):
        try:
            async for chunk in resp.content.iter_any():
                received += chunk
        except aiohttp.ClientPayloadError:
            return resp.status, bytes(received), False
        return resp.status, bytes(received), True


def free_port() -> int:
    """A port free a moment ago: only for a program that must be told its port before it listens.

    Bound, closed and named, the port may be taken by anything before the
    program binds it; whatever can bind port 0 and say where it listens does.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def held_socket() -> socket.socket:
    """A port of the test's own while it holds this socket, bound with SO_REUSEADDR and never listening.

    For a program that must be told its port before it listens: connections
    to the port are refused, no other test's listener can take it, and the
    program can still bind it (Linux lets sockets that all set SO_REUSEADDR
    share a port while none listens). `listen()` on it shows that nothing
    listens there. The caller closes it.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def held_port() -> Iterator[socket.socket]:
    """held_socket() for as long as the block runs."""
    with held_socket() as sock:
        yield sock


def said(process: subprocess.Popen[bytes], pattern: re.Pattern[str], seen: list[str] | None = None) -> re.Match[str]:
    """The first line of the process's standard output that matches `pattern`, read as it comes.

    Blocking: the test's timeout ends a process that never says it. The lines
    read go to `seen`; AssertionError with them if it exits without saying it.
    """
    assert process.stdout is not None
    lines = seen if seen is not None else []
    for raw in process.stdout:
        lines.append(raw.decode(errors="replace"))
        if (match := pattern.search(lines[-1])) is not None:
            return match
    raise AssertionError(f"it exited ({process.wait()}) without saying {pattern.pattern!r}: {''.join(lines)}")


# How often the waits below look again: often enough to add little to a test, seldom enough
# to leave the loop its work (an async check is a request or a scrape: less often).
POLL_SECONDS = 0.01
CHECK_SECONDS = 0.05


async def wait_for(condition: Any, timeout: float = 5.0) -> None:
    """Until `condition()` is true; AssertionError past `timeout`."""
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(POLL_SECONDS)


async def until(
    check: Callable[[], Awaitable[bool]], *, timeout: float = 5.0, what: str = "condition not met in time"
) -> None:
    """Until the async `check()` is true (a request's answer, a scrape); AssertionError(`what`) past `timeout`."""
    deadline = time.perf_counter() + timeout
    while not await check():
        if time.perf_counter() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(CHECK_SECONDS)


async def tick(server: RouterServer, ticks: int = 1) -> None:
    """Until the router's usage ticker has ticked `ticks` times more.

    A tick takes its snapshot and publishes it in one synchronous step, so
    what happened before the call is in every snapshot published after it:
    the usage document, the pushes, the metrics read from the snapshot.
    """
    ticker = server.ticker
    assert ticker is not None
    target = ticker.ticks + ticks
    await wait_for(lambda: ticker.ticks >= target)


async def until_cancelled() -> None:
    """What a stand-in that has fallen silent does: nothing, until its test ends it.

    Not a long sleep: a sleep's length would say something a test means never to end.
    """
    await asyncio.Event().wait()


def access_log_lines(path: Path) -> list[dict[str, Any]]:
    """The access log's lines so far, parsed (none before the file is made)."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line] if path.exists() else []


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def scrape(server: RouterServer) -> str:
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def run_ctl(*args: str) -> tuple[int, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = ctl.main(list(args))
    return code, buffer.getvalue()


# `router serve`'s line once both its ports listen (router/run/app.py), at info whatever --log-level says.
LISTENING = re.compile(r"router listening on (http://\S+) \(clients[^)]*\) and (http://\S+) \(admin\)")


class Serve:
    """`router serve` as a process, on port 0 unless told its ports: where it listens is read from its output."""

    def __init__(self, path: Path, client: int = 0, admin: int = 0) -> None:
        self.path = path
        self.ports = (client, admin)
        self.process: subprocess.Popen[bytes] | None = None
        self._lines: list[str] = []
        self._reader: threading.Thread | None = None
        self._urls: tuple[str, str] | None = None

    @property
    def client_url(self) -> str:
        assert self._urls is not None, "the router has not said where it listens yet"
        return self._urls[0]

    @property
    def admin_url(self) -> str:
        assert self._urls is not None, "the router has not said where it listens yet"
        return self._urls[1]

    def write(self, replicas: list[dict[str, str]], extra: str = "", *, tick_seconds: float = 0.1) -> None:
        client, admin = self.ports
        lines = [
            f'listen = "127.0.0.1:{client}"',
            f'admin_listen = "127.0.0.1:{admin}"',
            f"tick_seconds = {tick_seconds}",
            extra,
        ]
        for r in replicas:
            lines += ["[[replicas]]", *(f'{k} = "{v}"' for k, v in r.items())]
        self.path.write_text("\n".join(lines) + "\n")

    async def start(self, *args: str) -> None:
        """Starts it and waits until it says where it listens, then until it is ready."""
        process = self.process = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(self.path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        loop = asyncio.get_running_loop()
        listening: asyncio.Future[tuple[str, str] | None] = loop.create_future()

        def said(urls: tuple[str, str] | None) -> None:
            if not listening.done():
                listening.set_result(urls)

        # Its output drained as it comes (a full pipe would stop the router), read by a thread:
        # the pipe is a blocking file of subprocess.Popen's.
        def read() -> None:
            assert process.stdout is not None
            urls: tuple[str, str] | None = None
            for raw in process.stdout:
                line = raw.decode(errors="replace")
                self._lines.append(line)
                if urls is None and (match := LISTENING.search(line)) is not None:
                    urls = (match.group(1), match.group(2))
                    with contextlib.suppress(RuntimeError):  # the test's loop closed first
                        loop.call_soon_threadsafe(said, urls)
            if urls is None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(said, None)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        async with asyncio.timeout(20):
            self._urls = await listening
        assert self._urls is not None, self.output()

        async def ready() -> bool:
            assert process.poll() is None, self.output()
            try:
                async with session.get(self.admin_url + "/readyz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        async with aiohttp.ClientSession() as session:
            await until(ready, timeout=20, what="the router did not become ready")

    async def says(self, text: str, timeout: float = 10) -> None:
        """Until a line it printed has `text` in it."""
        await wait_for(lambda: any(text in line for line in self._lines), timeout=timeout)

    def output(self) -> str:
        """Everything the process printed; kills it first if it still runs."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        return "".join(self._lines)

    def signal(self, sig: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, sig)


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


@pytest.fixture
async def raw_server() -> AsyncIterator[StartRaw]:
    servers: list[RawServer] = []

    async def start(answer: Answer) -> RawServer:
        raw = RawServer(answer)
        raw.server = await asyncio.start_server(ending_quietly(raw.handle), "127.0.0.1", 0)
        servers.append(raw)
        return raw

    yield start
    for raw in servers:
        assert raw.server is not None
        raw.server.close()
        await raw.server.wait_closed()


def fixed(data: bytes, *, close: bool = False) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()

    return answer


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Kept: yes\r\n\r\nhello"


async def metrics(admin_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/metrics") as resp:
        return await resp.text()


async def protocol_errors(admin_url: str, side: str = "client") -> dict[str, float]:
    found = samples(await metrics(admin_url), f"router_{side}_protocol_errors_total")
    return {dict(labels)["reason"]: value for labels, value in found.items()}
