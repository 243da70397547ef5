"""Programs a test runs as processes, and the ports they listen on.

`Serve` is `router serve` on port 0, its addresses read from what it says;
`said` reads a process's output up to a line; `held_socket`/`held_port` keep
a port for a program that must be told it, and `free_port` is the race that
is left only where nothing else can do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from tests.support.waiting import until, wait_for


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


# `router serve`'s line once both its ports listen (router/run/app.py), at info whatever --log-level says.
# How long a router stopped at the end of a test may take to finish its shutdown before it is killed.
STOP_SECONDS = 5.0
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
        """Everything the process printed; stops it first if it still runs.

        Stopped as a person at a terminal would (SIGINT: no wait for a load balancer), so that
        it exits through its own shutdown and its coverage data is written (a killed process
        writes none: the supervisor's code would never count as run); killed if it hangs."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
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
