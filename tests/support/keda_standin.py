"""A stand-in for KEDA: scales a "Deployment" of fake replicas on `router scaler`'s answers, as KEDA does.

    python -m tests.support.keda_standin --scaler 127.0.0.1:9091 \\
        --router-admin 127.0.0.1:9090 --router-admin 127.0.0.1:9190 \\
        --model m --idle-after 30 --cooldown 10 --polling-interval 1 --max-replicas 3

What it does is what KEDA does with a ScaledObject whose trigger is
`external-push` (shared facts: KEDA's external scaler interface), on a
Deployment with `minReplicaCount: 0`:

- it keeps StreamIsActive open and acts on each value at once (reopening the
  stream when it breaks), and polls IsActive every `pollingInterval` too;
- active with 0 replicas: scale to 1;
- inactive for `cooldownPeriod` without a break: scale to 0;
- between 1 and N, as the HPA: GetMetricSpec once, GetMetrics every
  `pollingInterval`, and size to ceil(value / target) within [1, max].

The Deployment's pods are fake replicas (router/tools/fake/) on free loopback
ports, a new name for each pod as Kubernetes gives; every change is pushed
to every router (PUT /api/v1/endpoints: the set the routers have, with this
model's replicas replaced), which is how replicas reach routers that run
without Kubernetes discovery. Each event is one JSON line on standard output:
`{"t": unix_s, "event": ..., ...}`; tests/scaler/test_loop.py runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import grpc
import orjson
from grpc import aio

from router.scaler.externalscaler_pb2 import GetMetricsRequest, ScaledObjectRef
from router.scaler.externalscaler_pb2_grpc import ExternalScalerStub
from router.tools.fake import Behaviour, FakeReplica

if TYPE_CHECKING:
    from router.scaler.externalscaler_pb2_grpc import ExternalScalerAsyncStub


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(orjson.dumps({"t": time.time(), "event": event, **fields}).decode() + "\n")
    sys.stdout.flush()


class Deployment:
    """Pods of one model: fake replicas, pushed to every router on each change."""

    def __init__(
        self,
        model: str,
        admins: Sequence[str],
        *,
        token: str,
        behaviour: Behaviour,
        pod_host: str = "127.0.0.1",
        pod_address: str = "",
    ) -> None:
        self.model = model
        self.admins = [a if "://" in a else "http://" + a for a in admins]
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.behaviour = behaviour
        # Where the pods listen, and the name the routers reach them by (in
        # containers: all addresses, and this container's name on the network).
        self.pod_host = pod_host
        self.pod_address = pod_address or pod_host
        self.pods: list[tuple[str, FakeReplica]] = []
        self._names = 0

    @property
    def replicas(self) -> int:
        return len(self.pods)

    async def scale(self, to: int, why: str) -> None:
        before = len(self.pods)
        while len(self.pods) < to:
            fake = FakeReplica(models=(self.model,), name=f"{self.model}-{self._names}", record=False)
            fake.behaviour = self.behaviour
            await fake.start(self.pod_host, 0)
            self.pods.append((f"{self.model}-{self._names}", fake))
            self._names += 1
        gone = self.pods[to:]
        del self.pods[to:]
        emit("scaled", replicas_from=before, replicas_to=to, why=why)
        await self.push()
        # A pod is stopped after the routers stopped sending to it (they drain what is in flight).
        for _, fake in gone:
            await fake.stop()

    async def push(self) -> None:
        ours = [{"id": pod, "model": self.model, "url": self.url(fake)} for pod, fake in self.pods]
        async with aiohttp.ClientSession(headers=self.headers) as session:
            for admin in self.admins:
                async with session.get(admin + "/api/v1/endpoints") as resp:
                    current = (await resp.json())["replicas"]
                others = [r for r in current if r["model"] != self.model]
                async with session.put(admin + "/api/v1/endpoints", json={"replicas": others + ours}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{admin}: push answered {resp.status}: {await resp.text()}")
        emit("pushed", routers=len(self.admins), replicas=[r["id"] for r in ours])

    def url(self, fake: FakeReplica) -> str:
        return f"http://{self.pod_address}:{urlsplit(fake.url).port}"

    async def stop(self) -> None:
        for _, fake in self.pods:
            await fake.stop()


class KedaStandIn:
    """KEDA's part for one ScaledObject: IsActive and its stream, the cooldown, and the HPA on the metric."""

    def __init__(self, args: argparse.Namespace, deployment: Deployment) -> None:
        self.args = args
        self.deployment = deployment
        self.ref = ScaledObjectRef(
            name=f"{args.model}-scaler",
            namespace="default",
            scalerMetadata={
                "scalerAddress": args.scaler,
                "model": args.model,
                "idleAfter": str(args.idle_after),
                "targetInFlight": str(args.target_in_flight),
            },
        )
        self.active: bool | None = None
        self.inactive_since: float | None = None
        # One scaling decision at a time, as KEDA's controller makes them.
        self.lock = asyncio.Lock()

    async def run(self, channel: aio.Channel) -> None:
        stub = ExternalScalerStub(channel)
        spec = await stub.GetMetricSpec(self.ref, timeout=10)
        (metric,) = spec.metricSpecs
        emit("metric_spec", name=metric.metricName, target=metric.targetSizeFloat)
        await asyncio.gather(
            self._stream(stub),
            self._poll(stub),
            self._cooldown(),
            self._hpa(stub, metric.metricName, metric.targetSizeFloat),
        )

    async def _seen(self, active: bool, via: str) -> None:
        if active != self.active:
            emit("active" if active else "inactive", via=via)
        self.active = active
        if not active:
            self.inactive_since = self.inactive_since or time.time()
            return
        self.inactive_since = None
        async with self.lock:
            if self.deployment.replicas == 0:
                await self.deployment.scale(1, f"active ({via})")

    async def _stream(self, stub: ExternalScalerAsyncStub) -> None:
        while True:
            try:
                async for answer in stub.StreamIsActive(self.ref):
                    await self._seen(answer.result, "StreamIsActive")
            except grpc.aio.AioRpcError as exc:
                emit("stream_broken", code=exc.code().name)
            # Real time: KEDA's pollingInterval, which this process of its own keeps as KEDA does.
            await asyncio.sleep(self.args.polling_interval)

    async def _poll(self, stub: ExternalScalerAsyncStub) -> None:
        while True:
            # Real time: KEDA's pollingInterval, which this process of its own keeps as KEDA does.
            await asyncio.sleep(self.args.polling_interval)
            try:
                answer = await stub.IsActive(self.ref, timeout=10)
            except grpc.aio.AioRpcError as exc:
                emit("poll_failed", code=exc.code().name)
                continue
            await self._seen(answer.result, "IsActive")

    async def _cooldown(self) -> None:
        while True:
            # Real time: KEDA's cooldownPeriod is counted on the wall clock.
            await asyncio.sleep(0.05)
            since = self.inactive_since
            if since is not None and time.time() - since >= self.args.cooldown:
                async with self.lock:
                    if self.deployment.replicas > 0 and self.inactive_since is not None:
                        await self.deployment.scale(0, f"inactive for cooldownPeriod {self.args.cooldown:g} s")

    async def _hpa(self, stub: ExternalScalerAsyncStub, name: str, target: float) -> None:
        while True:
            # Real time: KEDA's pollingInterval, which this process of its own keeps as KEDA does.
            await asyncio.sleep(self.args.polling_interval)
            if self.deployment.replicas == 0 or not self.active:
                continue
            try:
                answer = await stub.GetMetrics(GetMetricsRequest(scaledObjectRef=self.ref, metricName=name), timeout=10)
            except grpc.aio.AioRpcError as exc:
                emit("metrics_failed", code=exc.code().name)
                continue
            value = sum(v.metricValueFloat for v in answer.metricValues)
            desired = min(self.args.max_replicas, max(1, math.ceil(value / target)))
            async with self.lock:
                if self.deployment.replicas not in (0, desired):
                    await self.deployment.scale(desired, f"HPA: metric {value:g} / target {target:g}")


async def main_async(args: argparse.Namespace) -> None:
    behaviour = Behaviour(tokens=args.tokens, token_delay=args.token_delay)
    deployment = Deployment(
        args.model,
        args.router_admin,
        token=args.token,
        behaviour=behaviour,
        pod_host=args.pod_host,
        pod_address=args.pod_address,
    )
    stand_in = KedaStandIn(args, deployment)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    emit("started", model=args.model, scaler=args.scaler)
    await deployment.scale(args.replicas, "initial")
    async with aio.insecure_channel(args.scaler) as channel:
        task = asyncio.create_task(stand_in.run(channel))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        stopping.cancel()
        await asyncio.gather(task, stopping, return_exceptions=True)
    await deployment.stop()
    emit("stopped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keda_standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scaler", required=True, help="router scaler's gRPC host:port (scalerAddress)")
    parser.add_argument("--router-admin", action="append", required=True, help="every router's admin address")
    parser.add_argument("--token", default="", help="the routers' admin token")
    parser.add_argument("--model", required=True)
    parser.add_argument("--idle-after", type=float, default=300.0, help="trigger metadata idleAfter")
    parser.add_argument("--target-in-flight", type=float, default=8.0, help="trigger metadata targetInFlight")
    parser.add_argument("--polling-interval", type=float, default=30.0, help="ScaledObject pollingInterval")
    parser.add_argument("--cooldown", type=float, default=300.0, help="ScaledObject cooldownPeriod")
    parser.add_argument("--max-replicas", type=int, default=3, help="ScaledObject maxReplicaCount")
    parser.add_argument("--replicas", type=int, default=1, help="the Deployment's replicas at start")
    parser.add_argument("--tokens", type=int, default=16, help="the fake replicas' tokens per answer at most")
    parser.add_argument("--token-delay", type=float, default=0.05, help="the fake replicas' seconds per token")
    parser.add_argument("--pod-host", default="127.0.0.1", help="the address the fake replicas listen on")
    parser.add_argument("--pod-address", default="", help="the host the routers reach them at (default: --pod-host)")
    return parser


if __name__ == "__main__":
    asyncio.run(main_async(build_parser().parse_args()))
