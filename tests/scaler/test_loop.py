"""The whole loop, every part a process of its own: two routers, `router scaler`, and KEDA's stand-in.

quiet -> IsActive false -> scaled to 0 -> a request held -> StreamIsActive
true -> scaled to 1 -> the replica pushed to the routers -> the held request
served; then the HPA's part: requests in flight size the Deployment.
tests/support/keda_standin.py is the stand-in, scaling a "Deployment" of fake
replicas on the scaler's answers as KEDA would.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.scaler import Events, Routers, scaled, scaler_listening
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def process(*argv: str, **kwargs: Any) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, cwd=ROOT, **kwargs)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def wait_healthy(url: str, proc: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as session:

        async def healthy() -> bool:
            assert proc.returncode is None, "router scaler exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/healthz") as resp:
                    return resp.status == 200
            return False

        await until(healthy, timeout=20, what="router scaler did not come up")


async def ask(client_url: str, *, max_tokens: int, stream: bool = False) -> tuple[int, dict[str, str], float]:
    """A chat completion for model m, read to its end: status, headers, and when it ended."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}
    async with (
        aiohttp.ClientSession() as session,
        session.post(client_url + "/v1/chat/completions", json=body) as resp,
    ):
        await resp.read()
        return resp.status, dict(resp.headers), time.time()


@pytest.mark.slow
async def test_keda_s_stand_in_scales_a_model_to_zero_and_back_on_the_scaler_s_answers(routers: Routers) -> None:
    # One file configures both: each router's own, with the scaler's [scaler] table (router serve skips it).
    scaler_table = (
        f'[scaler]\nservers = {orjson.dumps(routers.admins).decode()}\nlisten = "127.0.0.1:0"\n'
        'http_listen = "127.0.0.1:0"\npoll_seconds = 0.2\n'
    )
    routers.write([], f'[models."m"]\ncold_start_seconds = 30\n{scaler_table}')
    scaler_argv = ["-m", "router", "scaler", "--config", str(routers.all[0].path), "--log-level", "warning"]
    # The scaler first, on port 0 (the routers' ports are held: it may name them before they
    # listen); then the routers, told the wake URL it said.
    async with process(*scaler_argv, stderr=subprocess.PIPE) as scaler:
        assert scaler.stderr is not None
        grpc_address, http_url = await scaler_listening(scaler.stderr)
        await wait_healthy(http_url, scaler)
        routers.write([], f'wake_url = "{http_url}/wake"\n[models."m"]\ncold_start_seconds = 30\n{scaler_table}')
        await routers.start()
        a, b = (r.client_url for r in routers.all)
        standin_argv = [
            *("-m", "tests.support.keda_standin", "--scaler", grpc_address),
            *(arg for admin in routers.admins for arg in ("--router-admin", admin)),
            *("--model", "m", "--idle-after", "2", "--cooldown", "1", "--polling-interval", "0.5"),
            *("--max-replicas", "3", "--target-in-flight", "2", "--replicas", "1"),
            *("--tokens", "100", "--token-delay", "0.05"),
        ]
        async with process(*standin_argv, stdout=subprocess.PIPE) as standin:
            events = Events(standin)
            await events.wait(lambda e: e["event"] == "pushed" and e["replicas"] == ["m-0"])
            # Active once the routers watch the new pod (before that the model had no replica: inactive).
            await events.wait(lambda e: e["event"] == "active")

            # Used once through router-a, then quiet: inactive idleAfter later, scaled to 0 a cooldown after that.
            status, _, used = await ask(a, max_tokens=2)
            assert status == 200
            inactive = await events.wait(lambda e: e["event"] == "inactive", after=used)
            assert inactive["t"] >= used + 2 - 0.3
            to_zero = await events.wait(scaled(0), after=used)
            assert to_zero["t"] >= inactive["t"] + 1
            await events.wait(lambda e: e["event"] == "pushed" and e["replicas"] == [], after=used)

            # A request through router-b is held; the scaler pushes active at once; one replica comes and serves it.
            asked = time.time()
            status, headers, _ = await ask(b, max_tokens=2)
            assert status == 200 and float(headers["X-Router-Held-Seconds"]) > 0
            active = await events.wait(lambda e: e["event"] == "active", after=asked)
            assert active["via"] == "StreamIsActive"
            assert active["t"] - asked < 1.0
            to_one = await events.wait(scaled(1), after=asked)
            pushed = await events.wait(lambda e: e["event"] == "pushed" and e["replicas"] == ["m-1"], after=asked)
            assert active["t"] <= to_one["t"] <= pushed["t"]

            # The HPA's part: five 5-second streams with a target of 2 in flight per replica: three replicas (the max).
            began = time.time()
            streams = [asyncio.create_task(ask(a if i % 2 else b, max_tokens=100, stream=True)) for i in range(5)]
            up = await events.wait(scaled(3), after=began)
            assert "metric 5 / target 2" in up["why"]
            await events.wait(lambda e: e["event"] == "pushed" and len(e["replicas"]) == 3, after=began)
            assert all(status == 200 for status, _, _ in await asyncio.gather(*streams))

            standin.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(standin.wait(), 20) == 0
            await events.task
            assert events.seen[-1]["event"] == "stopped"
        scaler.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(scaler.wait(), 20) == 0
