"""A fleet of fake replicas standing in for pods, and what the tests ask of the router's set after each fault."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from router.control.discovery.source import KubernetesSource
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.control.discovery.recorded import NS, SELECTOR
from tests.support.clients import CHAT, in_flight, post
from tests.support.kube_api import Endpoint, FakeKubernetesApi, endpoint_slice, matches, pod
from tests.support.waiting import wait_for

# A fleet of pods on loopback addresses, one port ------------------------------------------


@dataclass
class Pods:
    """Fake replicas standing in for pods: each on its own 127.0.0.x, all on one port (as a slice has one)."""

    port: int
    fakes: dict[str, FakeReplica] = field(default_factory=dict)
    _next: int = 2

    async def add(self, name: str, behaviour: Behaviour | None = None) -> Endpoint:
        fake = FakeReplica(models=("a", "b", "m"), name=name)
        if behaviour is not None:
            fake.behaviour = behaviour
        address = f"127.0.0.{self._next}" if self._next < 255 else f"127.0.1.{self._next - 253}"
        self._next += 1
        await fake.start(address, self.port)
        self.fakes[name] = fake
        return Endpoint(name, address)

    def seen(self) -> dict[str, int]:
        return {name: len(f.seen) for name, f in self.fakes.items()}

    async def close(self) -> None:
        await asyncio.gather(*(f.stop() for f in self.fakes.values()))


def model_slice(name: str, model: str, endpoints: Iterable[Endpoint], port: int) -> dict[str, Any]:
    labels = {"app.kubernetes.io/part-of": "llm-fleet", "router.llm/model": model, "kubernetes.io/service-name": name}
    return endpoint_slice(name, list(endpoints), labels=labels, port=port)


StartDiscovery = Callable[..., Awaitable[tuple[RouterServer, KubernetesSource]]]


def router_set(server: RouterServer) -> dict[str, tuple[str, str]]:
    return {c.id: (c.model, c.url) for c in server.pool.configs()}


def expect(endpoints: dict[str, tuple[str, Endpoint]], port: int) -> dict[str, tuple[str, str]]:
    return {f"{NS}/{e.pod}": (model, f"http://{e.address}:{port}") for model, e in endpoints.values()}


async def in_sync(server: RouterServer, wanted: dict[str, tuple[str, str]], timeout: float = 15.0) -> None:
    await wait_for(lambda: router_set(server) == wanted, timeout)


async def delivered(kube: FakeKubernetesApi) -> None:
    """Until every open watch has sent the changes put so far: a churn goes at the pace its watches carry it."""
    await wait_for(lambda: all(w.queue.empty() for w in kube.watches))


async def cut(kube: FakeKubernetesApi, kind: str | None = None) -> None:
    """Ends the open watches (of `kind`, or all), as the API server does at its timeout, and waits
    until the source has opened another: each cut is one the source saw end."""
    before = set(kube.watches)
    kube.close_watches(kind)
    await wait_for(lambda: any(w not in before and (kind is None or w.resource.kind == kind) for w in kube.watches))


async def traffic(server: RouterServer, models: Iterable[str], n: int = 6) -> None:
    """Requests for every model; all must succeed."""
    for model in models:
        answers = await asyncio.gather(
            *(
                post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": model}))
                for _ in range(n)
            )
        )
        assert [status for status, _, _ in answers] == [200] * n, answers[0]


async def settled(server: RouterServer, pods: Pods, removed: Iterable[str], models: Iterable[str]) -> None:
    """After a fault: no request reaches a removed replica any more, and nothing stays in flight."""
    before = pods.seen()
    await traffic(server, models)
    after = pods.seen()
    for name in removed:
        assert after[name] == before[name], f"{name} got a request after it was removed"
    await wait_for(lambda: all(v == 0 for v in in_flight(server).values()))


def fleet_pod(e: Endpoint, model: str | None = "m", **labels: str) -> dict[str, Any]:
    """The pod behind a fake replica, labelled for discovery (no model label when `model` is None)."""
    named = {} if model is None else {"router.llm/model": model}
    return pod(e.pod, e.address, labels={"app.kubernetes.io/part-of": "llm-fleet", **named, **labels})


def service_slice(name: str, endpoints: Iterable[Endpoint], port: int, **labels: str) -> dict[str, Any]:
    """A Service's slice that no selector of the router's matches: in pods mode every slice is read."""
    return endpoint_slice(name, list(endpoints), labels={"kubernetes.io/service-name": name, **labels}, port=port)


def api_says(kube: FakeKubernetesApi) -> dict[str, tuple[str, str]]:
    """The set by the API server's own objects: ready endpoints of selected pods, the pod's model or the slice's."""
    out: dict[str, tuple[str, str]] = {}
    for (kind, namespace, _), obj in sorted(kube.objects.items()):
        if kind != "EndpointSlice" or namespace != NS:
            continue
        port = next((p["port"] for p in obj["ports"] if p["name"] == "http"), None)
        if port is None:
            continue
        for endpoint in obj["endpoints"]:
            assert not endpoint["conditions"]["terminating"], "api_says knows no terminating endpoints"
            found = kube.objects.get(("Pod", NS, endpoint["targetRef"]["name"]))
            if not endpoint["conditions"]["ready"] or found is None:
                continue
            labels = found["metadata"]["labels"]
            if not matches(SELECTOR, labels):
                continue
            model = labels.get("router.llm/model") or obj["metadata"]["labels"]["router.llm/model"]
            out[f"{NS}/{endpoint['targetRef']['name']}"] = (model, f"http://{endpoint['addresses'][0]}:{port}")
    return out


async def caught_up(source: KubernetesSource, plural: str, kube: FakeKubernetesApi) -> None:
    """Until the source has applied every change of these objects the API server has made so far."""
    revision = kube.revision
    await wait_for(lambda: int(source.version_of(plural) or 0) >= revision)
