"""The dashboard's queries and the alerting rules, evaluated by a real Prometheus over a real fleet.

Prometheus (Debian's package) scrapes, every second, `router serve --workers 2`
(router-a: replicas from its file, one failing, one drained, a model held cold
until its replica is pushed), a second `router serve` whose replicas come from
a Kubernetes API (router-b, discovery) and `router scaler` over both, while a
short mixed load runs. Then every query of deploy/grafana/router.json is asked
of Prometheus' HTTP API as Grafana asks it (a range query, or an instant one
for tables, with $model and $__rate_interval substituted) and must parse and
return a series with a number in it: a renamed metric or label fails here.

The rules are loaded from deploy/prometheus/alerts.yml with their time
constants shrunk to fit a test (every `for:` to 1 s, the 30-minute idle bound
to a few seconds; nothing else is touched, and the shrinking asserts that what
it replaces is there), and every rule must fire in the situation made for it;
the unshrunk expressions must parse. tests/deploy/observability/alerts_test.yml tests
the rules at their real durations with promtool.

With ROUTER_DASHBOARD_CAPTURE=FILE the queries' answers are written to FILE
as JSON, for bench/dashboard_picture.py to draw (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
import yaml
from grpc import aio

from router.core.config.settings import Address
from router.scaler.externalscaler_pb2 import ScaledObjectRef
from router.scaler.externalscaler_pb2_grpc import ExternalScalerStub
from router.scaler.main import Scaler
from router.scaler.settings import ScalerSettings
from router.tools.fake import Behaviour, FakeReplica
from tests.deploy.observability.dashboard import load, queries, substitute
from tests.deploy.observability.prometheus import DEPLOY, Prometheus, scrape_config
from tests.support.kube_api import Endpoint, FakeKubernetesApi, endpoint_slice
from tests.support.processes import Serve, held_socket
from tests.support.raw_server import StartRaw, fixed
from tests.support.waiting import until

if TYPE_CHECKING:
    from router.scaler.externalscaler_pb2_grpc import ExternalScalerAsyncStub

# Grafana's $__rate_interval at a 1 s scrape interval: four scrapes.
RATE_INTERVAL = "4s"
# RouterReplicaIdle's 30 minutes, shrunk: the spare replica (never asked) passes it, the loaded ones never do.
IDLE_SECONDS = 8
# What the shrinking replaces, per alert: (text in the shipped rule, text in the test's copy).
SHRUNK = {"RouterReplicaIdle": (">= 1800", f">= {IDLE_SECONDS}")}
SELECTOR = "app.kubernetes.io/part-of=llm-fleet"


def shrink(rules: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(rules)
    for group in out["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
            if rule["alert"] in SHRUNK:
                old, new = SHRUNK[rule["alert"]]
                assert old in rule["expr"], f"{rule['alert']} no longer says {old!r}: update SHRUNK"
                rule["expr"] = rule["expr"].replace(old, new)
    return out


def refused_port() -> tuple[socket.socket, int]:
    """A port bound but never listening: connections to it are refused while the socket is held."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, int(sock.getsockname()[1])


class Fleet:
    """Everything the dashboard looks at, started and driven by one test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # The admin ports held (support/processes.py's held_socket): the scaler is told them before the routers listen.
        self.held: list[socket.socket] = [held_socket(), held_socket()]
        self.a = Serve(folder / "router-a.toml", 0, self.held[0].getsockname()[1])
        self.b = Serve(folder / "router-b.toml", 0, self.held[1].getsockname()[1])
        self.fakes: dict[str, FakeReplica] = {}
        self.kube = FakeKubernetesApi(bookmark_seconds=0.5)
        self.scaler: Scaler | None = None
        self.channel: aio.Channel | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.stopping = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self.statuses: dict[str, dict[int, int]] = {}

    @property
    def admins(self) -> list[str]:
        return [f"127.0.0.1:{self.a.ports[1]}", f"127.0.0.1:{self.b.ports[1]}"]

    async def fake(self, rid: str, model: str, **behaviour: Any) -> FakeReplica:
        fake = FakeReplica(models=(model,), name=rid, record=False, behaviour=Behaviour(**behaviour))
        await fake.start()
        self.fakes[rid] = fake
        return fake

    def refused(self) -> str:
        sock, port = refused_port()
        self.held.append(sock)
        return f"http://127.0.0.1:{port}"

    async def start(self, junk_url: str) -> None:
        for rid, model in (("c0", "chat"), ("c1", "chat"), ("s0", "sess"), ("s1", "sess"), ("solo0", "solo")):
            await self.fake(rid, model, tokens=8, token_delay=0.03)
        await self.fake("spare0", "spare")
        await self.fake("cold0", "cold", tokens=4)
        await self.fake("kube-0", "kube", tokens=4)
        self.scaler = Scaler(
            ScalerSettings(
                servers=tuple(self.admins),
                listen=Address("127.0.0.1", 0),
                http_listen=Address("127.0.0.1", 0),
                poll_seconds=0.5,
                timeout_seconds=2.0,
            )
        )
        await self.scaler.start()
        self.channel = aio.insecure_channel(self.scaler.grpc_address)
        self.replicas = [
            ("c0", "chat", self.fakes["c0"].url),
            ("c1", "chat", self.fakes["c1"].url),
            ("c2", "chat", self.refused()),  # dead: ejected at its first failure
            ("s0", "sess", self.fakes["s0"].url),
            ("s1", "sess", self.fakes["s1"].url),
            ("fb0", "fb", self.refused()),  # dead and alone: its requests go to the fallback
            ("solo0", "solo", self.fakes["solo0"].url),  # drained
            ("spare0", "spare", self.fakes["spare0"].url),  # never asked: idle
            ("junk0", "junk", junk_url),  # answers bytes that are no HTTP
        ]
        self.a.path.write_text(
            "\n".join(
                [
                    'listen = "127.0.0.1:0"',
                    f'admin_listen = "{self.admins[0]}"',
                    'router_name = "router-a"',
                    "tick_seconds = 0.5",
                    f'usage_push_url = "{self.refused()}/usage"',
                    f'wake_url = "{self.scaler.http_url}/wake"',
                    "wake_cooldown_seconds = 1",
                    # Split over the two workers: one request per replica and worker, then a queue.
                    "max_in_flight_per_replica = 2",
                    "queue_timeout_seconds = 0.4",
                    "ejection_failures = 1",
                    "ejection_base_seconds = 300",
                    "connect_timeout_seconds = 1",
                    '[models.sess]\nrouting = "session"',
                    '[models.fb]\nfallbacks = ["chat"]',
                    "[models.cold]\ncold_start_seconds = 30",
                    *(f'[[replicas]]\nid = "{r}"\nmodel = "{m}"\nurl = "{u}"' for r, m, u in self.replicas),
                ]
            )
            + "\n"
        )
        await self.kube.start()
        kubeconfig = self.folder / "kubeconfig"
        kubeconfig.write_text(self.kube.kubeconfig())
        port = int(self.fakes["kube-0"].url.rsplit(":", 1)[1])
        labels = {"app.kubernetes.io/part-of": "llm-fleet", "router.llm/model": "kube"}
        self.kube.put(endpoint_slice("kube-abc", [Endpoint("kube-0", "127.0.0.1")], labels=labels, port=port))
        self.b.path.write_text(
            'listen = "127.0.0.1:0"\n'
            f'admin_listen = "{self.admins[1]}"\n'
            'router_name = "router-b"\ntick_seconds = 0.5\n'
            f'[discovery.kubernetes]\nselector = "{SELECTOR}"\nport = "http"\nkubeconfig = "{kubeconfig}"\n'
        )
        await asyncio.gather(self.a.start("--workers", "2"), self.b.start())
        self.session = aiohttp.ClientSession()

    def keda(self) -> ExternalScalerAsyncStub:
        assert self.channel is not None
        return ExternalScalerStub(self.channel)

    async def ask(self, base: str, model: str, *, stream: bool = False, headers: dict[str, str] | None = None) -> int:
        assert self.session is not None
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        try:
            async with self.session.post(
                base + "/v1/chat/completions", data=orjson.dumps(body), headers=headers or {}
            ) as resp:
                await resp.read()
                status = resp.status
        except aiohttp.ClientError:
            status = 0
        counts = self.statuses.setdefault(model, {})
        counts[status] = counts.get(status, 0) + 1
        return status

    def loop(self, every: float, *calls: Any) -> None:
        """Runs the calls together every `every` seconds until stop()."""

        async def run() -> None:
            while not self.stopping.is_set():
                await asyncio.gather(*(call() for call in calls))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), every)

        self.tasks.append(asyncio.create_task(run()))

    async def push(self, extra: list[tuple[str, str, str]]) -> None:
        """PUT the whole set: the file's replicas and `extra`."""
        assert self.session is not None
        body = {"replicas": [{"id": r, "model": m, "url": u} for r, m, u in [*self.replicas, *extra]]}
        async with self.session.put(self.a.admin_url + "/api/v1/endpoints", data=orjson.dumps(body)) as resp:
            assert resp.status == 200, await resp.text()

    async def drain(self, rid: str) -> None:
        assert self.session is not None
        async with self.session.post(
            f"{self.a.admin_url}/api/v1/replicas/{rid}/state", data=orjson.dumps({"state": "draining"})
        ) as resp:
            assert resp.status == 200, await resp.text()

    async def garbage(self) -> None:
        """A client that sends bytes that are no HTTP request."""
        host, port = self.a.client_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"HELLO THERE\r\n\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()

    async def stop(self) -> None:
        self.stopping.set()
        for task in self.tasks:
            with contextlib.suppress(Exception):
                await task
        if self.session is not None:
            await self.session.close()
        for router in (self.a, self.b):
            if router.process is not None:
                router.output()
        if self.channel is not None:
            await self.channel.close(None)
        if self.scaler is not None:
            await self.scaler.stop()
        await self.kube.stop()
        for fake in self.fakes.values():
            await fake.stop()
        for sock in self.held:
            sock.close()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    made = Fleet(tmp_path)
    try:
        yield made
    finally:
        await made.stop()


@pytest.fixture
async def prometheus(tmp_path: Path) -> AsyncIterator[Prometheus]:
    server = Prometheus(tmp_path / "prometheus")
    yield server
    await server.stop()


async def run_load(fleet: Fleet, prom: Prometheus) -> None:
    """About 12 s of mixed load with a held request, an ejection and a drain, then a few scrapes more."""
    a, b = fleet.a.client_url, fleet.b.client_url
    keda = fleet.keda()

    async def tell_keda() -> None:
        for model in ("chat", "cold", "spare"):
            request = ScaledObjectRef(name=f"so-{model}", namespace="default", scalerMetadata={"model": model})
            await keda.IsActive(request, timeout=5)

    async def chat() -> None:
        await asyncio.gather(*(fleet.ask(a, "chat", stream=True) for _ in range(3)))

    async def sessions() -> None:
        await asyncio.gather(
            *(fleet.ask(a, "sess", headers={"X-Session-Id": f"conversation-{i % 2}"}) for i in range(3)),
            fleet.ask(a, "sess"),
        )

    fleet.loop(0.3, chat, sessions, tell_keda)
    fleet.loop(1.0, lambda: fleet.ask(a, "fb"), lambda: fleet.ask(a, "ghost"), lambda: fleet.ask(b, "kube"))
    # Real time, here and below: Prometheus scrapes and evaluates on its own clock, and the
    # rates the alerts read are over real seconds of traffic.
    await asyncio.sleep(1)
    await fleet.drain("solo0")
    # Held: no replica of cold yet; the router calls wake_url (the scaler) and waits.
    held = asyncio.create_task(fleet.ask(a, "cold"))
    await fleet.garbage()

    # RouterUnservedDemand's 0.1/s is averaged over 10 minutes: more than 60 requests found nothing.
    # rate() counts what a counter gained between samples, so the burst waits for the series' first one:
    # on a loaded machine the first scrape after the loop's first ghost came once the burst was over.
    async def ghost_scraped() -> bool:
        return bool((await prom.api("query", query='router_unserved_requests_total{model="ghost"}'))["result"])

    await until(ghost_scraped, timeout=15)
    for _ in range(10):
        await asyncio.gather(*(fleet.ask(a, "ghost") for _ in range(8)))
    for _ in range(3):
        await fleet.ask(a, "junk")
    # More at once than the limits let through: some wait, some are refused after the queue timeout.
    await asyncio.gather(*(fleet.ask(a, "chat", stream=True) for _ in range(16)))
    # Held long enough to count as a cold start in the hold histogram's seconds.
    await asyncio.sleep(2)
    cold = ("cold0", "cold", fleet.fakes["cold0"].url)
    await fleet.push([cold])
    assert await held == 200
    # Scaled to zero and back once more: a histogram's first observation makes its series, the second a rate.
    await fleet.push([])
    held = asyncio.create_task(fleet.ask(a, "cold"))
    # Real time again: the second hold's seconds.
    await asyncio.sleep(2)
    await fleet.push([cold])
    assert await held == 200
    # Load goes on while the rules turn firing; the last scrapes see it (Prometheus' clock, real time).
    await asyncio.sleep(IDLE_SECONDS)


async def firing(prom: Prometheus, timeout: float = 20.0) -> dict[str, list[dict[str, str]]]:
    """The alerts firing once every rule has fired (each rule's alerts' labels), or an AssertionError."""
    rules: list[dict[str, Any]] = []

    async def all_fired() -> bool:
        # Polled: Prometheus evaluates its rules on its own clock, with nothing to wait on.
        nonlocal rules
        groups = (await prom.api("rules", type="alert"))["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return all(rule["state"] == "firing" for rule in rules)

    try:
        await until(all_fired, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"not every rule fired: { {rule['name']: rule['state'] for rule in rules} }") from exc
    return {rule["name"]: [alert["labels"] for alert in rule["alerts"] if alert["state"] == "firing"] for rule in rules}


def has_number(result: dict[str, Any]) -> bool:
    """Some series of the answer holds a finite number (a histogram quantile of nothing is NaN)."""
    if result["resultType"] == "matrix":
        values = [v for series in result["result"] for _, v in series["values"]]
    else:
        values = [series["value"][1] for series in result["result"]]
    return any(math.isfinite(float(v)) for v in values)


@pytest.mark.timeout(150)
async def test_every_dashboard_query_and_alert_rule_evaluates_over_a_real_fleet(
    fleet: Fleet, prometheus: Prometheus, raw_server: StartRaw
) -> None:
    junk = await raw_server(fixed(b"THIS IS NO HTTP\r\n\r\n", close=True))
    await fleet.start(f"http://{junk.address}")
    assert fleet.scaler is not None
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    config = scrape_config(
        {"router": fleet.admins, "router-scaler": [fleet.scaler.http_url.removeprefix("http://")]}, "alerts.yml"
    )
    await prometheus.start(config, shrink(rules))

    async def all_up() -> bool:
        return set((await prometheus.targets_up()).values()) == {"up"}

    await until(all_up, timeout=15)
    began = time.time()
    await run_load(fleet, prometheus)

    # Every rule fires in the situation made for it.
    fired = await firing(prometheus)
    idle = {labels["replica"] for labels in fired["RouterReplicaIdle"]}
    assert "spare0" in idle
    # Loaded to the end; c2 is as quiet as spare0 but ejected, which is not idle.
    assert not idle & {"c0", "c1", "s0", "s1", "c2"}, idle
    assert [(x["replica"], x["model"]) for x in fired["RouterReplicaEjected"]] == [("c2", "chat")]
    assert [x["model"] for x in fired["RouterModelWithoutReadyReplica"]] == ["solo"]
    assert [x["model"] for x in fired["RouterUnservedDemand"]] == ["ghost"]
    assert {x["pod"] for x in fired["RouterUsagePushFailing"]} == {fleet.admins[0]}
    # Each shrunk expression returns series; each shipped one parses.
    for group, shipped in zip(shrink(rules)["groups"], rules["groups"], strict=True):
        for rule, original in zip(group["rules"], shipped["rules"], strict=True):
            assert (await prometheus.api("query", query=rule["expr"]))["result"], rule["alert"]
            await prometheus.api("query", query=original["expr"])

    # Every panel's query, as Grafana asks it, with every model the variable offers.
    variable = next(v for v in load()["templating"]["list"] if v["name"] == "model")
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
    assert match is not None
    models = await prometheus.api(f"label/{match.group(2)}/values", **{"match[]": match.group(1)})
    assert {"chat", "sess", "fb", "cold", "solo", "spare", "junk", "kube", "ghost"} <= set(models), models
    end = time.time()
    answers: dict[str, Any] = {}
    empty = []
    for query in queries(load()):
        expr = substitute(query.expr, models=models, rate_interval=RATE_INTERVAL)
        if query.instant:
            result = await prometheus.api("query", query=expr, time=str(end))
        else:
            result = await prometheus.api("query_range", query=expr, start=str(began), end=str(end), step="1")
        answers[f"{query.panel} / {query.ref}"] = {"expr": expr, "legend": query.legend, "result": result}
        if not has_number(result):
            empty.append(f"{query.panel} / {query.ref}: {expr}")
    assert not empty, "queries without a number:\n" + "\n".join(empty)
    capture = os.environ.get("ROUTER_DASHBOARD_CAPTURE")
    if capture:
        Path(capture).write_text(json.dumps({"start": began, "end": end, "panels": answers}))
    # The load was what it says: answers, refusals after the queue, and the held request served.
    assert fleet.statuses["chat"].get(200, 0) > 50 and fleet.statuses["chat"].get(503, 0) >= 1, fleet.statuses
