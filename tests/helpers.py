"""What the test modules share: a real client's calls, waiting, scraping, raw servers, a router process.

Nothing here fakes the router: these are clients, probes and the outside
world (raw HTTP servers standing in for replicas) that the tests drive it with.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


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


class Serve:
    def __init__(self, path: Path, client: int, admin: int) -> None:
        self.path = path
        self.client_url = f"http://127.0.0.1:{client}"
        self.admin_url = f"http://127.0.0.1:{admin}"
        self.process: subprocess.Popen[bytes] | None = None
        self._output: str | None = None

    def write(self, replicas: list[dict[str, str]], extra: str = "") -> None:
        lines = [
            f'listen = "{self.client_url.removeprefix("http://")}"',
            f'admin_listen = "{self.admin_url.removeprefix("http://")}"',
            "tick_seconds = 0.1",
            extra,
        ]
        for r in replicas:
            lines += ["[[replicas]]", *(f'{k} = "{v}"' for k, v in r.items())]
        self.path.write_text("\n".join(lines) + "\n")

    async def start(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(self.path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.admin_url + "/readyz") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "router did not become ready"
                assert self.process.poll() is None, self.output()
                await asyncio.sleep(0.05)

    def output(self) -> str:
        """Everything the process printed; kills it first if it still runs."""
        assert self.process is not None
        if self._output is None:
            if self.process.poll() is None:
                self.process.kill()
            out, _ = self.process.communicate(timeout=10)
            self._output = out.decode()
        return self._output

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
