"""deploy/scale-from-zero/wake_receiver.py as a process of a test's, stopped whatever happens.

The receiver starts engines, each in a process group of its own. A test
that stops it with a signal must not depend on how the signal is handled:
if the receiver has not exited in time it is killed, and every engine group
it said it started is killed too, so that nothing outlives the test, not
even a pipe: its standard error is closed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

RECEIVER = Path(__file__).resolve().parents[2] / "deploy" / "scale-from-zero" / "wake_receiver.py"
STARTED = re.compile(r"started (\S+) on port (\d+) \(pid (\d+)\)")
LISTENING = re.compile(r"wake receiver on (http://\S+)/wake")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Receiver:
    """The receiver's process and what it said; `url` its /wake URL, once it said where it listens."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.said: list[str] = []
        self.url = ""

    @property
    def engines(self) -> list[int]:
        """The process groups of the engines it said it started."""
        return [int(m.group(3)) for line in self.said if (m := STARTED.search(line))]

    async def line(self) -> str:
        """Its next line on standard error ('' once it has closed it)."""
        assert self.process.stderr is not None
        line = await asyncio.to_thread(self.process.stderr.readline)
        self.said.append(line)
        return line

    async def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Send `sig` and wait: its exit status, or None when it had to be killed."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await asyncio.to_thread(self.process.wait, 10)
            return None

    async def close(self) -> None:
        """Whatever happened: the receiver gone, every engine it started gone, its pipe closed."""
        if self.process.poll() is None:
            await self.stop()
        stderr = self.process.stderr
        if stderr is not None:
            # What it said after the test stopped reading names engines too. Read
            # without waiting: an engine that outlived it still holds the pipe open.
            os.set_blocking(stderr.fileno(), False)
            with contextlib.suppress(OSError, TypeError):
                self.said += stderr.readlines()
            stderr.close()
        # Its own group (it runs in a session of its own: engines it did not put
        # in theirs are there), then each engine's group, and each engine.
        for group in (self.process.pid, *self.engines):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for pid in self.engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def wake_receiver(*args: str, ignoring_sigint: bool = False) -> AsyncIterator[Receiver]:
    """The receiver with `args`, ready (it said where it listens: port 0 is fine); `ignoring_sigint`: started as a
    background job of a non-interactive shell is, with SIGINT ignored."""
    process = subprocess.Popen(
        [sys.executable, str(RECEIVER), *args],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if ignoring_sigint else None,  # noqa: PLW1509 (a signal disposition, nothing else)
        # A group of its own, for the test to end whatever is left in it.
        start_new_session=True,
    )
    receiver = Receiver(process)
    try:
        listening = LISTENING.search(await receiver.line())
        assert listening is not None, "".join(receiver.said)
        receiver.url = listening.group(1) + "/wake"
        yield receiver
    finally:
        await receiver.close()
