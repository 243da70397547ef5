"""What the scaler's tests share: two real `router serve` processes, canned admin APIs, a gRPC client as KEDA's.

The client is the stub generated from router/scaler/externalscaler.proto,
called over a real channel exactly as KEDA calls an external scaler.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from router.scaler.externalscaler_pb2 import GetMetricsRequest, ScaledObjectRef
from router.scaler.main import Scaler
from tests.support.processes import Serve, held_port
from tests.support.waiting import until as wait
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    # Only in the generated stubs: what ExternalScalerStub is over an asyncio channel.
    from router.scaler.externalscaler_pb2_grpc import ExternalScalerAsyncStub


# `router scaler`'s line once both its ports listen (router/scaler/main.py), at info whatever --log-level says.
SCALER_LISTENING = re.compile(r"router scaler: gRPC on (\S+), HTTP on (\S+), polling")


async def scaler_listening(stderr: asyncio.StreamReader) -> tuple[str, str]:
    """Where a `router scaler` process listens (its gRPC address, its HTTP URL), read from its standard error."""
    seen = []
    async for line in stderr:
        seen.append(line.decode(errors="replace"))
        if (match := SCALER_LISTENING.search(seen[-1])) is not None:
            return match.group(1), match.group(2)
    raise AssertionError("router scaler exited without saying where it listens: " + "".join(seen))


class Routers:
    """Two `router serve` processes (router-a, router-b) with the same replicas, tick 0.1 s.

    Their ports are held from the start (tests/support/processes.py's held_port): a scaler
    is given their admin addresses before they listen, and a router restarted
    comes back where the scaler polls, a port nothing else could take meanwhile.
    """

    def __init__(self, folder: Path, stack: contextlib.ExitStack) -> None:
        ports = [stack.enter_context(held_port()).getsockname()[1] for _ in range(4)]
        self.all = [Serve(folder / f"router-{name}.toml", *ports[i * 2 : i * 2 + 2]) for i, name in enumerate("ab")]

    @property
    def admins(self) -> list[str]:
        return [f"127.0.0.1:{r.ports[1]}" for r in self.all]

    def write(self, replicas: list[dict[str, str]], extra: str = "") -> None:
        for router, name in zip(self.all, ("router-a", "router-b"), strict=True):
            router.write(replicas, f'router_name = "{name}"\n{extra}')

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.all))

    async def usage(self, index: int) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.all[index].admin_url + "/api/v1/usage") as resp,
        ):
            assert resp.status == 200
            doc: dict[str, Any] = await resp.json()
            return doc

    def stop(self, index: int) -> None:
        """Kills the router (its output read and its pipes closed); start() brings it back on the same ports."""
        router = self.all[index]
        router.output()
        self.all[index] = Serve(router.path, *router.ports)

    async def restart(self, index: int) -> None:
        self.stop(index)
        await self.all[index].start()


StartScaler = Callable[..., Awaitable[Scaler]]


Keda = Callable[[Scaler], "ExternalScalerAsyncStub"]


def ref(model: str = "m", **metadata: str) -> ScaledObjectRef:
    """A ScaledObject's reference as KEDA sends it: its trigger metadata, `model` left out when empty."""
    meta = {"model": model, **metadata} if model else dict(metadata)
    return ScaledObjectRef(name=f"so-{model or 'x'}", namespace="default", scalerMetadata=meta)


async def is_active(stub: ExternalScalerAsyncStub, request: ScaledObjectRef) -> bool:
    answer = await stub.IsActive(request, timeout=5)
    return answer.result


async def metric(stub: ExternalScalerAsyncStub, request: ScaledObjectRef) -> float:
    answer = await stub.GetMetrics(GetMetricsRequest(scaledObjectRef=request, metricName="s0-metric"), timeout=5)
    (value,) = answer.metricValues
    return value.metricValueFloat


async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    """A router (for raw_server) that reads the request and answers nothing until the scaler leaves."""
    await reader.read()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> float:
    """Polls `check` until it is true; the time.time() at which it was; AssertionError past `timeout`."""
    await wait(check, timeout=timeout)
    return time.time()


class Stream:
    """StreamIsActive held open in the background: every value with the time it arrived."""

    def __init__(self, stub: ExternalScalerAsyncStub, request: ScaledObjectRef) -> None:
        self.values: list[tuple[float, bool]] = []
        self._call = stub.StreamIsActive(request)
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for answer in self._call:
            self.values.append((time.time(), answer.result))

    @property
    def last(self) -> bool | None:
        return self.values[-1][1] if self.values else None

    async def wait_for(self, value: bool, timeout: float = 15.0) -> float:
        """Waits until the newest value is `value`; the time.time() it arrived."""

        def turned() -> bool:
            assert not self._task.done() or self._task.exception() is None, self._task.exception()
            return self.last is value

        try:
            await wait_for(turned, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"StreamIsActive did not turn {value}: {self.values}") from exc
        return self.values[-1][0]

    async def close(self) -> None:
        self._call.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class CannedRouter:
    """A router's admin API answering set documents (GET /api/v1/usage and /api/v1/replicas), nothing else.

    For the rules that need exact figures (a snapshot's time, a demand entry)
    and for load: the real routers are in the tests that say so.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        now = time.time()
        self.usage: dict[str, Any] = {
            "router": name,
            "started_at": now - 3600,
            "generated_at": now,
            "tick_seconds": 5.0,
            "last_used": {},
            "watching_since": {},
            "demand": {},
        }
        self.replicas: list[dict[str, Any]] = []
        # Bytes served instead of the documents above when set (load tests, nonsense).
        self.usage_body: bytes | None = None
        self.replicas_body: bytes | None = None
        self.status = 200
        self.authorizations: list[str] = []
        self._runner: web.AppRunner | None = None
        self.address = ""

    def replica(
        self, rid: str, model: str, *, last_used: float | None, watching_since: float, in_flight: int = 0
    ) -> None:
        if last_used is not None:
            self.usage["last_used"][rid] = last_used
        self.usage["watching_since"][rid] = watching_since
        self.replicas.append({"id": rid, "model": model, "in_flight": in_flight, "state": "ready"})

    async def _usage(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization", ""))
        body = self.usage_body if self.usage_body is not None else orjson.dumps(self.usage)
        return web.Response(status=self.status, body=body, content_type="application/json")

    async def _replicas(self, request: web.Request) -> web.Response:
        body = self.replicas_body if self.replicas_body is not None else orjson.dumps(self.replicas)
        return web.Response(status=self.status, body=body, content_type="application/json")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/usage", self._usage)
        app.router.add_get("/api/v1/replicas", self._replicas)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.address = f"127.0.0.1:{self._runner.addresses[0][1]}"
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


Canned = Callable[[str], Awaitable[CannedRouter]]


class Events:
    """The KEDA stand-in's JSON lines (tests/support/keda_standin.py) as they come."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.seen: list[dict[str, Any]] = []
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.seen.append(orjson.loads(line))

    async def wait(
        self, match: Callable[[dict[str, Any]], bool], *, after: float = 0.0, timeout: float = 20.0
    ) -> dict[str, Any]:
        """The first event at or after `after` (Unix seconds) that matches."""

        def found() -> dict[str, Any] | None:
            return next((event for event in self.seen if event["t"] >= after and match(event)), None)

        def seen() -> bool:
            assert self.process.returncode is None, f"the stand-in exited: {self.seen}"
            return found() is not None

        try:
            await wait_for(seen, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"no such event: {self.seen}") from exc
        event = found()
        assert event is not None
        return event


def scaled(to: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "scaled" and e["replicas_to"] == to
