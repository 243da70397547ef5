"""deploy/scale-from-zero/wake_receiver.py stops the engines it started when it is stopped.

Under systemd or Kubernetes the receiver gets SIGTERM; in a terminal, SIGINT.
Either way an engine it started must not outlive it: re-parented to PID 1, a
vLLM would hold its GPU with nothing left that knows of it. The engine here
is a shell that starts the fake replica as its child, as vLLM starts its
workers, so that the whole process group has to go, not only its leader.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import StartRouter
from tests.support.receiver import wake_receiver
from tests.support.waiting import until, wait_for


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for whoever inherited it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


async def wait_until(condition: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    try:
        await wait_for(condition, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(what) from exc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_the_receiver_stops_its_engine_and_the_engine_s_children_on_sigterm_and_sigint(
    start_router: StartRouter, tmp_path: Path, sig: signal.Signals
) -> None:
    """Started with SIGINT ignored, as a background job of a non-interactive shell is: SIGINT stops it all the same."""
    server = await start_router([], models={"m": {"cold_start_seconds": 30}})
    child_pid_file = tmp_path / "engine-child.pid"
    engine = (
        f"sh -c '{sys.executable} -m router.tools.fake --port {{port}} --model m & echo $! > {child_pid_file}; wait'"
    )
    child: int | None = None
    args = ("--listen", "127.0.0.1:0", "--router-admin", server.admin_url)
    try:
        async with wake_receiver(
            *args, "--model", f"m={engine}", "--stop-grace-seconds", "10", ignoring_sigint=True
        ) as receiver:
            async with aiohttp.ClientSession() as session:
                wake = {"router": "r", "model": "m", "held": 1, "since": time.time()}
                async with session.post(receiver.url, json=wake) as resp:
                    assert resp.status == 200, await resp.text()
            started = await receiver.line()
            match = re.search(r"started m on port (\d+) \(pid (\d+)\)", started)
            assert match is not None, started
            engine_port, leader = int(match.group(1)), int(match.group(2))
            await wait_until(lambda: child_pid_file.exists() and child_pid_file.read_text().strip(), "no child pid")
            child = int(child_pid_file.read_text())
            # The engine answers: it is the replica the receiver pushed.
            async with aiohttp.ClientSession() as session:

                async def answers() -> bool:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(f"http://127.0.0.1:{engine_port}/v1/models") as resp:
                            return resp.status == 200
                    return False

                await until(answers, timeout=20, what="the engine never answered")
            assert [c.url for c in server.pool.configs()] == [f"http://127.0.0.1:{engine_port}"]
            assert os.getpgid(child) == leader != os.getpgid(receiver.process.pid)

            assert await receiver.stop(sig) == 0
            assert not alive(leader), "the engine outlived the receiver"
            await wait_until(lambda: not alive(child), "the engine's child outlived the receiver", timeout=5)
    finally:
        # The engine's child is in the engine's group, which the receiver's close kills; the pid
        # file's is killed by itself too, in case it left the group.
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_without_aiohttp_the_receiver_says_to_run_it_with_the_router_s_python() -> None:
    """A system Python has no aiohttp: one clear line naming the fix, not a traceback."""
    from tests.support.receiver import RECEIVER

    # -S: no site-packages at all, as a system Python without the router's dependencies.
    done = subprocess.run(
        [sys.executable, "-S", str(RECEIVER), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "wake_receiver.py needs aiohttp (No module named 'aiohttp')" in done.stderr
    assert ".venv/bin/python" in done.stderr
