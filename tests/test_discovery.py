"""Kubernetes discovery against a fake API server (tests/kube_api.py), through every fault the issue lists.

After each fault: the router's set equals the API server's, no request
reaches a replica after the router removed it, and nothing stays in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.app import RouterServer
from router.config import KubernetesDiscovery, ReplicaConfig, parse_config
from router.discovery import ApiAccess, KubernetesSource, Member, SliceView, desired_set, read_slice, resolve_access
from router.errors import ConfigError
from router.fake import Behaviour, FakeReplica
from router.pool import ReplicaState
from tests.helpers import CHAT, Serve, free_port, in_flight, post, post_cut, samples, scrape, wait_for
from tests.kube_api import Endpoint, FakeKubernetesApi, endpoint_slice

RECORDED = Path(__file__).resolve().parent / "kubernetes"
SELECTOR = "app.kubernetes.io/part-of=llm-fleet"
NS = "default"


def recorded_list() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((RECORDED / "endpointslice-list.json").read_text())
    return doc


def recorded_watch() -> list[bytes]:
    return (RECORDED / "endpointslice-watch.jsonl").read_bytes().splitlines()


SETTINGS = KubernetesDiscovery(selector=SELECTOR, port="http", labels_from=("gpu_class",))


# EndpointSlices to replicas -------------------------------------------------------


def test_endpoint_conditions_map_to_ready_draining_and_absent() -> None:
    """ready (or nil) -> ready; serving and terminating -> draining; neither -> not a replica."""
    llama = read_slice(recorded_list()["items"][0], SETTINGS, "models")
    assert llama.problem is None
    by_id = {m.config.id: m for m in llama.members}
    assert set(by_id) == {
        "models/vllm-llama-8b-6d5c9b7f4-abcde",
        "models/vllm-llama-8b-6d5c9b7f4-fghij",
        "models/vllm-llama-8b-6d5c9b7f4-pqrst",  # no conditions at all: nil ready is true
    }
    assert not by_id["models/vllm-llama-8b-6d5c9b7f4-abcde"].terminating
    assert by_id["models/vllm-llama-8b-6d5c9b7f4-fghij"].terminating
    ready = by_id["models/vllm-llama-8b-6d5c9b7f4-abcde"].config
    assert (ready.model, ready.url, dict(ready.labels)) == (
        "llama-3.1-8b",
        "http://10.244.1.17:8000",
        {"gpu_class": "h100"},
    )


def test_ipv6_addresses_are_bracketed_and_named_ports_looked_up() -> None:
    qwen = read_slice(recorded_list()["items"][1], SETTINGS, "models")
    (member,) = qwen.members
    assert member.config.url == "http://[fd00:10:244::1a]:8000"
    metrics = read_slice(recorded_list()["items"][1], KubernetesDiscovery(selector="x", port="metrics"), "models")
    assert metrics.members[0].config.url == "http://[fd00:10:244::1a]:9100"
    numbered = read_slice(recorded_list()["items"][1], KubernetesDiscovery(selector="x", port=8443), "models")
    assert numbered.members[0].config.url == "http://[fd00:10:244::1a]:8443"


def test_a_slice_without_the_model_label_or_the_port_holds_no_replica_and_says_why() -> None:
    item = recorded_list()["items"][0]
    view = read_slice(item, KubernetesDiscovery(selector="x", port="grpc"), "models")
    assert view.members == () and view.problem == "has no port named 'grpc'"
    view = read_slice(item, KubernetesDiscovery(selector="x", port="http", model_label="example.com/model"), "models")
    assert view.members == () and view.problem == "has no label example.com/model naming its model"


def _member(rid: str, model: str, url: str, terminating: bool = False) -> Member:
    return Member(ReplicaConfig(rid, model, url), terminating)


def test_a_terminating_endpoint_stays_only_as_the_replica_the_router_already_has() -> None:
    slices = {"s": SliceView((_member("ns/a", "m", "http://a:1", terminating=True),))}
    assert desired_set(slices, {}) == {}
    assert set(desired_set(slices, {"ns/a": ReplicaConfig("ns/a", "m", "http://a:1")})) == {"ns/a"}
    # Another model or address is another replica: nothing of ours to finish there.
    assert desired_set(slices, {"ns/a": ReplicaConfig("ns/a", "other", "http://a:1")}) == {}


def test_a_pod_in_two_slices_is_served_from_the_serving_one_then_the_one_the_router_has() -> None:
    old = _member("ns/p", "a", "http://p:1")
    new = _member("ns/p", "b", "http://p:1")
    both = {"slice-a": SliceView((old,)), "slice-b": SliceView((new,))}
    assert desired_set(both, {"ns/p": old.config})["ns/p"] == old
    assert desired_set(both, {"ns/p": new.config})["ns/p"] == new
    leaving = {
        "slice-a": SliceView((_member("ns/p", "a", "http://p:1", terminating=True),)),
        "slice-b": SliceView((new,)),
    }
    assert desired_set(leaving, {"ns/p": old.config})["ns/p"] == new


# Configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "key", "problem"),
    [
        ({"kubernetes": {"port": "http"}}, "discovery.kubernetes.selector", "is required"),
        ({"kubernetes": {"selector": "a=b"}}, "discovery.kubernetes.port", "is required"),
        ({"kubernetes": {"selector": "a=b", "port": 70000}}, "discovery.kubernetes.port", "1-65535"),
        ({"kubernetes": {"selector": "a=b", "port": "Http"}}, "discovery.kubernetes.port", "port name"),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "namespace": "Bad_NS"}},
            "discovery.kubernetes.namespace",
            "namespace",
        ),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "labels_from": "gpu"}},
            "discovery.kubernetes.labels_from",
            "array",
        ),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "model_label": "a/b/c"}},
            "discovery.kubernetes.model_label",
            "label key",
        ),
        ({"kubernetes": {"selector": "a=b", "port": 1, "watch": True}}, "discovery.kubernetes.watch", "unknown key"),
        ({"consul": {}}, "discovery.consul", "unknown key"),
    ],
)
def test_discovery_config_mistakes_name_the_key(table: dict[str, Any], key: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^<test>: {key}: .*{problem}"):
        parse_config({"discovery": table}, "<test>", environ={})


def test_discovery_and_static_replicas_are_refused_together() -> None:
    raw = {
        "discovery": {"kubernetes": {"selector": "a=b", "port": 8000}},
        "replicas": [{"id": "r", "model": "m", "url": "http://127.0.0.1:1"}],
    }
    with pytest.raises(ConfigError, match=r"replicas: cannot be used with \[discovery\.kubernetes\]"):
        parse_config(raw, "<test>", environ={})


def test_the_api_is_found_in_cluster_then_kubeconfig_then_KUBECONFIG(tmp_path: Path) -> None:
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("t")
    (account / "namespace").write_text("models\n")
    in_cluster = resolve_access(SETTINGS, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, account)
    assert in_cluster == ApiAccess(kubeconfig=None, namespace="models")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(FakeKubernetesApi().kubeconfig(namespace="team-a"))
    from_env = resolve_access(SETTINGS, {"KUBECONFIG": f"{tmp_path / 'absent'}:{kubeconfig}"}, account)
    assert from_env == ApiAccess(kubeconfig=str(kubeconfig), namespace="team-a")
    pinned = KubernetesDiscovery(selector="a", port=1, namespace="other", kubeconfig=str(kubeconfig))
    assert resolve_access(pinned, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, account).namespace == "other"
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.kubeconfig: no such file"):
        resolve_access(KubernetesDiscovery(selector="a", port=1, kubeconfig=str(tmp_path / "nope")), {}, account)
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes: no Kubernetes API to ask"):
        resolve_access(SETTINGS, {"HOME": str(tmp_path)}, tmp_path / "no-account")


# The library against the fake, on the recorded responses ---------------------------------


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubernetesApi]:
    api = FakeKubernetesApi(bookmark_seconds=0.2)
    await api.start()
    yield api
    await api.stop()


def _paths(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        out = set()
        for key, item in value.items():
            out |= {f"{prefix}.{key}"} | _paths(item, f"{prefix}.{key}")
        return out
    if isinstance(value, list):
        return set().union(*(_paths(item, prefix + "[]") for item in value)) if value else set()
    return set()


async def test_the_library_reads_the_recorded_responses_as_the_fake_serves_them(
    kube: FakeKubernetesApi, tmp_path: Path
) -> None:
    """kubernetes_asyncio lists and watches the recorded documents; the router reads the same replicas either way."""
    from kubernetes_asyncio import client, config, watch
    from kubernetes_asyncio.client.exceptions import ApiException

    recorded = recorded_list()
    for item in recorded["items"]:
        kube.put({"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", **item})
    path = tmp_path / "kubeconfig"
    path.write_text(kube.kubeconfig())
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration, persist_config=False)
    async with client.ApiClient(configuration) as api_client:
        api = client.DiscoveryV1Api(api_client)
        listed = await api.list_namespaced_endpoint_slice("models", label_selector=SELECTOR)
        assert listed.metadata.resource_version == str(kube.revision)
        assert [s.metadata.name for s in listed.items] == ["llama-8b-x7kq2", "qwen-7b-m2v8d"]
        first = listed.items[0].endpoints[1]
        assert (first.conditions.serving, first.conditions.terminating, first.target_ref.name) == (
            True,
            True,
            "vllm-llama-8b-6d5c9b7f4-fghij",
        )
        # What the router reads through the library's models is what the raw recording says.
        through_library = api_client.sanitize_for_serialization(listed)
        for raw, parsed in zip(recorded["items"], through_library["items"], strict=True):
            assert read_slice(parsed, SETTINGS, "models") == read_slice(raw, SETTINGS, "models")

        kube.replay = recorded_watch()
        seen = []
        stream = watch.Watch()

        async def follow() -> None:
            async for event in stream.stream(
                api.list_namespaced_endpoint_slice,
                "models",
                label_selector=SELECTOR,
                resource_version="48213",
                allow_watch_bookmarks=True,
                timeout_seconds=5,
            ):
                seen.append((event["type"], event["raw_object"]["metadata"]["resourceVersion"]))
                if event["type"] != "BOOKMARK":
                    assert event["object"].metadata.name == "llama-8b-x7kq2"

        with pytest.raises(ApiException) as gone:
            await follow()
        await stream.close()
        assert seen == [("ADDED", "48230"), ("MODIFIED", "48244"), ("BOOKMARK", "48251"), ("DELETED", "48259")]
        assert gone.value.status == 410
        asked = kube.requests[-1]
        assert "allowWatchBookmarks=True" in asked and "resourceVersion=48213" in asked and "watch=True" in asked


def test_the_fake_writes_no_field_the_recording_does_not_have() -> None:
    """The fake's slices and events have the recorded shape (so it cannot drift from what the library reads)."""
    recorded_slice = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", **recorded_list()["items"][0]}
    made = endpoint_slice("s", [Endpoint("p", "127.0.0.2")], labels={"a": "b"})
    made["metadata"]["resourceVersion"] = "1"
    made["metadata"]["uid"] = "u"
    labels = {p for p in _paths(made) if p.startswith(".metadata.labels.")}
    assert _paths(made) - labels <= _paths(recorded_slice)
    events = [orjson.loads(line) for line in recorded_watch()]
    bookmark = next(e for e in events if e["type"] == "BOOKMARK")
    assert _paths(
        {
            "type": "BOOKMARK",
            "object": {"kind": "EndpointSlice", "apiVersion": "x", "metadata": {"resourceVersion": "1"}},
        }
    ) <= _paths(bookmark)
    error = next(e for e in events if e["type"] == "ERROR")
    from tests.kube_api import _status

    assert _paths({"type": "ERROR", "object": _status(410, "Expired", "m")}) == _paths(error)


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


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    fleet = Pods(port)
    yield fleet
    await fleet.close()


def model_slice(name: str, model: str, endpoints: Iterable[Endpoint], port: int) -> dict[str, Any]:
    labels = {"app.kubernetes.io/part-of": "llm-fleet", "router.llm/model": model, "kubernetes.io/service-name": name}
    return endpoint_slice(name, list(endpoints), labels=labels, port=port)


@pytest.fixture
async def discovery(kube: FakeKubernetesApi, tmp_path: Path) -> AsyncIterator[tuple[RouterServer, KubernetesSource]]:
    path = tmp_path / "kubeconfig"
    path.write_text(kube.kubeconfig())
    raw = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "router_name": "test",
        "tick_seconds": 0.1,
        "connect_timeout_seconds": 2.0,
        "discovery": {"kubernetes": {"selector": SELECTOR, "port": "http", "kubeconfig": str(path)}},
    }
    config = parse_config(raw, "<test>", environ={})
    assert config.discovery is not None
    source = KubernetesSource(
        config.discovery,
        resolve_access(config.discovery, {}),
        rng=random.Random(7),
        backoff_first=0.05,
        backoff_cap=0.5,
        report_every=1.0,
        watch_seconds=30.0,
        min_watch_seconds=0.2,
    )
    server = RouterServer(config, registry=CollectorRegistry(), sources=[source])
    await server.start()
    yield server, source
    await server.stop()


def router_set(server: RouterServer) -> dict[str, tuple[str, str]]:
    return {c.id: (c.model, c.url) for c in server.pool.configs()}


def expect(endpoints: dict[str, tuple[str, Endpoint]], port: int) -> dict[str, tuple[str, str]]:
    return {f"{NS}/{e.pod}": (model, f"http://{e.address}:{port}") for model, e in endpoints.values()}


async def in_sync(server: RouterServer, wanted: dict[str, tuple[str, str]], timeout: float = 15.0) -> None:
    await wait_for(lambda: router_set(server) == wanted, timeout)


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


async def test_not_ready_until_the_first_list_then_pods_added_unready_and_deleted_follow(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, source = discovery
    a, b, c = [await pods.add(n) for n in ("pod-a", "pod-b", "pod-c")]
    await wait_for(source.ready)
    assert router_set(server) == {}
    kube.put(model_slice("llama", "m", [a, b], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    await settled(server, pods, [], ["m"])
    assert pods.seen()["pod-a"] and pods.seen()["pod-b"]
    # Added.
    kube.put(model_slice("llama", "m", [a, b, c], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b), "c": ("m", c)}, pods.port))
    # Made unready (Ready=False): out of the set.
    unready = Endpoint(b.pod, b.address, ready=False, serving=False)
    kube.put(model_slice("llama", "m", [a, unready, c], pods.port))
    await in_sync(server, expect({"a": ("m", a), "c": ("m", c)}, pods.port))
    await settled(server, pods, ["pod-b"], ["m"])
    # Deleted.
    kube.put(model_slice("llama", "m", [c], pods.port))
    await in_sync(server, expect({"c": ("m", c)}, pods.port))
    await settled(server, pods, ["pod-a", "pod-b"], ["m"])
    kube.delete(NS, "llama")
    await in_sync(server, {})
    assert source.relists["error"] == 0


async def test_a_terminating_pod_drains_its_streams_finish_and_it_reads_drained(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, _ = discovery
    slow = await pods.add("pod-slow", Behaviour(tokens=30, token_delay=0.05))
    other = await pods.add("pod-other")
    kube.put(model_slice("llama", "m", [slow], pods.port))
    await in_sync(server, expect({"s": ("m", slow)}, pods.port))
    body = orjson.dumps({**CHAT, "model": "m", "stream": True})
    streams = [asyncio.ensure_future(post_cut(server.client_url + "/v1/chat/completions", body)) for _ in range(3)]
    await wait_for(lambda: pods.fakes["pod-slow"].active == 3)
    # The pod is being deleted: still serving, terminating; a new one is ready.
    leaving = Endpoint(slow.pod, slow.address, ready=False, serving=True, terminating=True)
    kube.put(model_slice("llama", "m", [leaving, other], pods.port))
    await in_sync(server, expect({"s": ("m", slow), "o": ("m", other)}, pods.port))
    replica = server.pool.get(f"{NS}/pod-slow")
    assert replica is not None
    assert replica.state.value == "draining"
    before = pods.seen()["pod-slow"]
    await traffic(server, ["m"])
    assert pods.seen()["pod-slow"] == before, "a draining pod got a new request"
    for status, received, complete in await asyncio.gather(*streams):
        assert status == 200 and complete and b"data: [DONE]" in received
    assert replica.state.value == "drained"
    # Then it is gone from the slice: out of the set.
    kube.put(model_slice("llama", "m", [other], pods.port))
    await in_sync(server, expect({"o": ("m", other)}, pods.port))
    await settled(server, pods, ["pod-slow"], ["m"])


async def test_the_watch_closed_every_second_during_a_churn_of_200_pods(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, source = discovery
    endpoints = [await pods.add(f"pod-{i:03d}") for i in range(200)]

    async def close_every_second() -> None:
        while True:
            await asyncio.sleep(1.0)
            kube.close_watches()

    closer = asyncio.ensure_future(close_every_second())
    rng = random.Random(17)
    live: dict[str, Endpoint] = {}
    deadline = time.monotonic() + 20
    try:
        # Pods arrive in batches over four Services, some leave, some turn unready and back.
        for step in range(40):
            for e in endpoints[step * 5 : step * 5 + 5]:
                live[e.pod] = e
            for name in rng.sample(sorted(live), k=min(2, len(live))):
                if rng.random() < 0.5:
                    del live[name]
                else:
                    live[name] = Endpoint(
                        name, live[name].address, ready=not live[name].ready, serving=not live[name].ready
                    )
            for shard in range(4):
                members = [e for e in live.values() if int(e.pod[-3:]) % 4 == shard]
                kube.put(model_slice(f"svc-{shard}", "m", members, pods.port))
            await asyncio.sleep(0.1)
            assert time.monotonic() < deadline
        await asyncio.sleep(1.5)  # at least one more close with the churn over
    finally:
        closer.cancel()
    wanted = {f"{NS}/{e.pod}": ("m", f"http://{e.address}:{pods.port}") for e in live.values() if e.ready}
    await in_sync(server, wanted)
    assert source.relists["watch_ended"] >= 2
    removed = [e.pod for e in endpoints if f"{NS}/{e.pod}" not in wanted]
    await settled(server, pods, removed, ["m"])


async def test_a_deleted_event_lost_while_the_watch_was_down_is_caught_by_the_relist(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, source = discovery
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    kube.put(model_slice("llama", "m", [a], pods.port))
    kube.put(model_slice("qwen", "m", [b], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    lists = source.relists["watch_ended"]
    await wait_for(lambda: kube.watches)
    # The watch goes down and the DELETED is never replayed to the watch that resumes.
    kube.delete(NS, "qwen", tell=False)
    kube.close_watches()
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert source.relists["watch_ended"] > lists
    await settled(server, pods, ["pod-b"], ["m"])


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists_and_goes_on(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource], as_status: bool
) -> None:
    server, source = discovery
    kube.gone_as_status = as_status
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    kube.put(model_slice("llama", "m", [a, b], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    await wait_for(lambda: kube.watches)
    await wait_for(lambda: kube.watches)
    # Compacted history, and a change the watches never hear of: only the relist after 410 shows it.
    kube.put(model_slice("llama", "m", [a], pods.port), tell=False)
    kube.expire()
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert source.relists["expired"] >= 1
    kube.put(model_slice("llama", "m", [a, b], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    await settled(server, pods, [], ["m"])
    assert source.relists["error"] == 0


async def test_api_server_down_keeps_the_set_grows_the_stale_gauge_and_traffic_goes_on(
    kube: FakeKubernetesApi,
    pods: Pods,
    discovery: tuple[RouterServer, KubernetesSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Down for 6 s here (the production backoff cap is 30 s, the report a minute; neither depends on the length)."""
    server, source = discovery
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    kube.put(model_slice("llama", "m", [a, b], pods.port))
    wanted = expect({"a": ("m", a), "b": ("m", b)}, pods.port)
    await in_sync(server, wanted)
    assert samples(await scrape(server), "router_discovery_stale_seconds") == {(): 0.0}
    caplog.set_level(logging.WARNING, "router.discovery")
    await kube.stop()
    down_since = time.monotonic()
    stale: list[float] = []
    while time.monotonic() - down_since < 6:
        await traffic(server, ["m"], n=2)
        assert router_set(server) == wanted
        async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as r:
            assert r.status == 200
        stale.append(samples(await scrape(server), "router_discovery_stale_seconds")[()])
        await asyncio.sleep(0.5)
    assert stale[-1] >= 4.0 and stale == sorted(stale)
    reports = [r.getMessage() for r in caplog.records if "cannot read EndpointSlices" in r.getMessage()]
    assert "keeping the last known set of 2 replicas" in reports[0]
    assert any("still cannot read" in m for m in reports[1:])
    # Back, with a change made meanwhile.
    kube.put(model_slice("llama", "m", [a], pods.port), tell=False)
    await kube.start()
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    await wait_for(lambda: source.stale_seconds() == 0.0)
    await settled(server, pods, ["pod-b"], ["m"])


@pytest.mark.parametrize("order", ["leave-first", "join-first"])
async def test_a_label_change_moves_a_pod_between_models(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource], order: str
) -> None:
    server, _ = discovery
    a, p, b = await pods.add("pod-a"), await pods.add("pod-p"), await pods.add("pod-b")
    kube.put(model_slice("svc-a", "a", [a, p], pods.port))
    kube.put(model_slice("svc-b", "b", [b], pods.port))
    await in_sync(server, expect({"a": ("a", a), "p": ("a", p), "b": ("b", b)}, pods.port))
    # The pod's label changes: model a's Service no longer selects it, model b's does.
    if order == "leave-first":
        kube.put(model_slice("svc-a", "a", [a], pods.port))
        kube.put(model_slice("svc-b", "b", [b, p], pods.port))
    else:
        kube.put(model_slice("svc-b", "b", [b, p], pods.port))
        kube.put(model_slice("svc-a", "a", [a], pods.port))
    await in_sync(server, expect({"a": ("a", a), "p": ("b", p), "b": ("b", b)}, pods.port))
    pods.fakes["pod-p"].seen.clear()
    await traffic(server, ["a"], n=8)
    assert pods.fakes["pod-p"].seen == [], "model a's requests still reach the moved pod"
    await traffic(server, ["b"], n=8)
    assert all(orjson.loads(s.body)["model"] == "b" for s in pods.fakes["pod-p"].seen)
    await settled(server, pods, [], ["a", "b"])


async def test_a_forbidden_list_is_logged_with_the_api_servers_reason_and_the_router_stays_unready(
    kube: FakeKubernetesApi,
    pods: Pods,
    discovery: tuple[RouterServer, KubernetesSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RBAC missing: not ready, the API server's own message in the log; once allowed, the set arrives."""
    server, source = discovery
    caplog.set_level(logging.WARNING, "router.discovery")
    a = await pods.add("pod-a")
    kube.put(model_slice("llama", "m", [a], pods.port))
    await kube.stop()
    kube.forbidden = True
    await kube.start()
    await wait_for(lambda: "forbidden" in caplog.text, timeout=10)
    assert "HTTP 403: endpointslices.discovery.k8s.io is forbidden" in caplog.text
    assert not source.ready() and router_set(server) == {}
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as resp:
        assert resp.status == 503
    kube.forbidden = False
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert source.ready()


async def test_pushes_are_refused_with_409_and_drains_still_work(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, _ = discovery
    a = await pods.add("pod-a")
    kube.put(model_slice("llama", "m", [a], pods.port))
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    async with aiohttp.ClientSession() as session:
        async with session.put(server.admin_url + "/api/v1/endpoints", json={"replicas": []}) as resp:
            assert resp.status == 409
            error = (await resp.json())["error"]
        assert error["code"] == "replica_set_owned"
        assert "Kubernetes discovery" in error["message"] and "Drains" in error["message"]
        url = f"{server.admin_url}/api/v1/replicas/{NS}%2Fpod-a/state"
        async with session.post(url, json={"state": "draining"}) as resp:
            assert resp.status == 200, await resp.text()
    replica = server.pool.get(f"{NS}/pod-a")
    assert replica is not None and replica.state is ReplicaState.DRAINED


# A real `router serve`, one process or a supervisor and its workers --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
async def test_router_serve_discovers_through_a_plain_http_kubeconfig_and_waits_for_the_first_list(
    serve: Serve, pods: Pods, tmp_path: Path, workers: int
) -> None:
    """Not ready before the API answers; then the set, 409 on pushes, the gauge; with --workers one watch only."""
    kube = FakeKubernetesApi(bookmark_seconds=0.2)
    kube.port = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube.kubeconfig())
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    kube.put(model_slice("llama", "m", [a, b], pods.port))
    serve.write(
        [],
        f'[discovery.kubernetes]\nselector = "{SELECTOR}"\nport = "http"\nkubeconfig = "{kubeconfig}"\n',
    )
    api_up_at: list[float] = []

    async def api_later() -> None:
        await asyncio.sleep(1.5)
        api_up_at.append(time.monotonic())
        await kube.start()

    later = asyncio.ensure_future(api_later())
    try:
        await serve.start("--workers", str(workers))
        assert api_up_at and time.monotonic() > api_up_at[0], "ready before the API server answered"
        async with aiohttp.ClientSession() as session:
            async with session.get(serve.admin_url + "/api/v1/replicas") as resp:
                assert sorted(r["id"] for r in await resp.json()) == [f"{NS}/pod-a", f"{NS}/pod-b"]
            body = orjson.dumps({**CHAT, "model": "m"})
            for _ in range(6):
                async with session.post(serve.client_url + "/v1/chat/completions", data=body) as resp:
                    assert resp.status == 200
            async with session.put(serve.admin_url + "/api/v1/endpoints", json={"replicas": []}) as resp:
                assert resp.status == 409
                assert "Kubernetes discovery" in (await resp.json())["error"]["message"]
            # A pod leaves: every worker stops using it.
            kube.put(model_slice("llama", "m", [a], pods.port))
            deadline = time.monotonic() + 15
            while True:
                async with session.get(serve.admin_url + "/api/v1/endpoints") as resp:
                    if [r["id"] for r in (await resp.json())["replicas"]] == [f"{NS}/pod-a"]:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            seen_b = len(pods.fakes["pod-b"].seen)
            for _ in range(8):
                async with session.post(serve.client_url + "/v1/chat/completions", data=body) as resp:
                    assert resp.status == 200
            assert len(pods.fakes["pod-b"].seen) == seen_b
            async with session.get(serve.admin_url + "/metrics") as resp:
                text = await resp.text()
        assert samples(text, "router_discovery_stale_seconds") == {(): 0.0}
        # Discovery runs once: in the supervisor, never in a worker.
        assert len(kube.watches) == 1
        lists = [r for r in kube.requests if "watch=" not in r]
        assert len(lists) == 1, lists
    finally:
        later.cancel()
        await kube.stop()


def test_router_serve_says_when_there_is_no_kubernetes_api_to_ask(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(f'[discovery.kubernetes]\nselector = "a=b"\nport = 8000\nkubeconfig = "{tmp_path / "absent"}"\n')
    result = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"router: discovery.kubernetes.kubeconfig: no such file: {tmp_path / 'absent'}"
