"""The scale-to-zero loop of tests/scaler/test_loop.py, every part a container on one podman network.

Two routers and `router scaler` run from deploy/kubernetes/keda as rendered:
the routers' Deployment (with the overlay's router.toml: requests for the
model held, `wake_url` at the scaler) under the headless Service's name
(router-admin, which the scaler resolves to both,
as `--servers-from-dns` in its args says), the scaler's Deployment under its
Service's name. KEDA's stand-in (tests/support/keda_standin.py, from this
checkout, mounted read-only into the image) keeps StreamIsActive open at the
ScaledObject's scalerAddress and scales the model's "Deployment": fake
replicas on its own container, pushed to both routers.

One change to what is shipped: no Kubernetes API server runs here, so the
routers' [discovery.kubernetes] table is left out and the stand-in pushes
its pods (PUT /api/v1/endpoints), as routers without discovery get them;
discovery itself is tested against its API-server fake (tests/control/test_discovery.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.deploy.container.podman import Podman, Running, run_spec, wait_ready
from tests.support.manifests import ROOT, of_kind, render, router_toml
from tests.support.scaler import Events, scaled
from tests.support.waiting import until

# The short names the overlay writes (resolved in the pods' own namespace), and the one with
# a namespace: the ScaledObject's scalerAddress, which KEDA dials from its own.
HEADLESS = "router-admin"
SCALER = "router-scaler"


def without_discovery(toml: str) -> str:
    """router.toml less its [discovery.kubernetes] table (up to the next table), the one change made here."""
    cut = re.sub(r"^\[discovery\.kubernetes\]\n(?:(?!\[).*\n)*", "", toml, flags=re.M)
    assert "[discovery" not in cut and "wake_url" in cut and "cold_start_seconds" in cut
    return cut


async def ask(client_url: str, model: str, *, max_tokens: int, stream: bool = False) -> tuple[int, dict[str, str]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}
    async with (
        aiohttp.ClientSession() as session,
        session.post(client_url + "/v1/chat/completions", json=body) as resp,
    ):
        await resp.read()
        return resp.status, dict(resp.headers)


async def admin_answers(running: Running, token: str) -> str:
    """What a router's admin API says now: its usage map and its replicas, for a failure's message."""
    said = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        for path in ("/api/v1/usage", "/api/v1/replicas"):
            try:
                async with session.get(running.url("admin") + path) as resp:
                    said.append(f"GET {path}: {resp.status} {await resp.text()}")
            except aiohttp.ClientError as exc:
                said.append(f"GET {path}: {exc!r}")
    return "\n".join(said)


async def scaler_health(scaler: Running) -> dict[str, Any]:
    """The scaler's /healthz: each router's last poll error (its log says one a minute), each decision's reason."""
    async with aiohttp.ClientSession() as session, session.get(scaler.url("http") + "/healthz") as resp:
        health: dict[str, Any] = await resp.json()
        return health


async def scaler_sees(scaler: Running, routers: int, timeout: float = 30) -> None:
    """Until a round of the scaler's merged every router its DNS name gives, as an operator checks /healthz."""

    async def merged() -> bool:
        health = await scaler_health(scaler)
        answering = [
            r for r in health["routers"] if r["ok"] and ":9090" in r["server"] and not r["server"].startswith(HEADLESS)
        ]
        return len(answering) == routers and health["last_complete_merge_age_seconds"] is not None

    await until(merged, timeout=timeout, what=f"the scaler never merged {routers} routers")


@contextlib.asynccontextmanager
async def explained(podman: Podman, routers: list[Running], scaler: Running) -> AsyncIterator[None]:
    """A failed wait with what the scaler logged (each decision and its reason) and what every router says."""
    try:
        yield
    except AssertionError as exc:
        token = scaler.env["ROUTER_ADMIN_TOKEN"]
        parts = [
            f"scaler /healthz: {await scaler_health(scaler)}",
            f"scaler logs:\n{podman.logs(scaler.name)[-6000:]}",
        ]
        for running in routers:
            parts.append(f"{running.name}:\n{await admin_answers(running, token)}\n{podman.logs(running.name)[-3000:]}")
        raise AssertionError(f"{exc}\n\n" + "\n\n".join(parts)) from None


@contextlib.asynccontextmanager
async def stand_in(podman: Podman, image: str, network: str, *args: str) -> AsyncIterator[Events]:
    """KEDA's stand-in in a container of the image, its pods listening on the container's name; its events read."""
    name = f"{network}-keda"
    process = await asyncio.create_subprocess_exec(
        *("podman", "run", "--rm", "--pull", "never", "--name", name, "--network", network),
        *("--volume", f"{ROOT / 'tests'}:/src/tests:ro", "--workdir", "/src", "--env", "PYTHONPATH=/src"),
        *("--entrypoint", "python", image, "-m", "tests.support.keda_standin"),
        *(*args, "--pod-host", "0.0.0.0", "--pod-address", name),
        stdout=asyncio.subprocess.PIPE,
        env=podman.env,
    )
    events = Events(process)
    try:
        yield events
    finally:
        podman("kill", "--signal", "TERM", name, check=False)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), 30)
        if process.returncode is None:
            process.kill()
            await process.wait()
        events.task.cancel()


async def test_the_keda_loop_scales_to_zero_and_back_with_every_part_in_a_container(
    podman: Podman, image: str, network: str, secret_values: dict[tuple[str, str], str], workdir: Path
) -> None:
    docs = render("keda")
    toml = without_discovery(router_toml(docs))
    routers: list[Running] = [
        run_spec(
            podman,
            docs,
            "router",
            name=f"{network}-router-{which}",
            network=network,
            aliases=(HEADLESS,),
            secrets=secret_values,
            workdir=workdir,
            files={"config": {"router.toml": toml}},
        )
        for which in ("a", "b")
    ]
    (scaled_object,) = of_kind(docs, "ScaledObject")
    address = scaled_object["spec"]["triggers"][0]["metadata"]["scalerAddress"].rsplit(":", 1)[0]
    scaler = run_spec(
        podman, docs, "router-scaler", name=f"{network}-scaler", network=network, aliases=(SCALER, address),
        secrets=secret_values, workdir=workdir,
    )  # fmt: skip
    for running in (*routers, scaler):
        wait_ready(podman, running)
    metadata: dict[str, Any] = scaled_object["spec"]["triggers"][0]["metadata"]
    model = metadata["model"]
    # The ScaledObject's timings are minutes; the stand-in's are the test loop's (tests/scaler/test_loop.py).
    args = (
        *("--scaler", metadata["scalerAddress"], "--token", scaler.env["ROUTER_ADMIN_TOKEN"]),
        *(arg for r in routers for arg in ("--router-admin", f"{r.name}:9090")),
        *("--model", model, "--idle-after", "2", "--cooldown", "1", "--polling-interval", "0.5"),
        *("--max-replicas", "3", "--target-in-flight", "2", "--replicas", "1", "--tokens", "100"),
        *("--token-delay", "0.05"),
    )
    a, b = (r.url("http") for r in routers)
    async with explained(podman, routers, scaler), stand_in(podman, image, network, *args) as events:
        await events.wait(lambda e: e["event"] == "pushed" and e["replicas"] == [f"{model}-0"], timeout=30)
        await events.wait(lambda e: e["event"] == "active", timeout=30)
        # The scaler polls both routers by its DNS name (a round that misses one keeps every model active).
        await scaler_sees(scaler, len(routers))

        # Used once through router a, then quiet: inactive idleAfter later (the routers' 5 s ticks
        # on top), scaled to 0 a cooldown after that, and the pod pushed out of both routers.
        status, _ = await ask(a, model, max_tokens=2)
        used = time.time()
        assert status == 200
        inactive = await events.wait(lambda e: e["event"] == "inactive", after=used, timeout=60)
        assert inactive["t"] >= used + 2 - 0.3
        to_zero = await events.wait(scaled(0), after=used, timeout=30)
        assert to_zero["t"] >= inactive["t"] + 1
        await events.wait(lambda e: e["event"] == "pushed" and e["replicas"] == [], after=used)

        # Through router b: held, the scaler told by the router's wake call, one pod started and pushed, served.
        asked = time.time()
        status, headers = await ask(b, model, max_tokens=2)
        assert status == 200 and float(headers["X-Router-Held-Seconds"]) > 0
        active = await events.wait(lambda e: e["event"] == "active", after=asked)
        assert active["via"] == "StreamIsActive"
        to_one = await events.wait(scaled(1), after=asked)
        pushed = await events.wait(lambda e: e["event"] == "pushed" and e["replicas"] == [f"{model}-1"], after=asked)
        assert active["t"] <= to_one["t"] <= pushed["t"]

        # The HPA's part: five 5-second streams over both routers, target 2 in flight per replica: three replicas.
        began = time.time()
        streams = [asyncio.create_task(ask(a if i % 2 else b, model, max_tokens=100, stream=True)) for i in range(5)]
        up = await events.wait(scaled(3), after=began)
        metric = re.search(r"metric (\d+) / target 2", up["why"])
        # At least the five streams: held counts come from each router's last usage tick (5 s in the
        # overlay's router.toml), so the request just served from the hold may still count as held.
        assert metric is not None and int(metric.group(1)) >= 5, up
        await events.wait(lambda e: e["event"] == "pushed" and len(e["replicas"]) == 3, after=began)
        assert all(status == 200 for status, _ in await asyncio.gather(*streams))

    # SIGTERM as Kubernetes stops a pod: the scaler and the routers exit 0 within their grace.
    for running in (scaler, *routers):
        podman("stop", "--time", str(int(running.grace)), running.name, timeout=120)
        assert podman.inspect(running.name)["State"]["ExitCode"] == 0, podman.logs(running.name)
