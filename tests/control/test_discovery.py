"""Kubernetes discovery against a fake API server (tests/control/kube_api.py), through every fault the issue lists.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.control.discovery import (
    ApiAccess,
    KubernetesSource,
    Member,
    SliceView,
    desired_set,
    join_pods,
    parse_slice,
    read_pod,
    read_slice,
    resolve_access,
)
from router.core.config import KubernetesDiscovery, ReplicaConfig, parse_config
from router.core.errors import ConfigError
from router.core.replicas import ReplicaState
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.control.kube_api import Endpoint, FakeKubernetesApi, endpoint_slice, matches, pod
from tests.helpers import (
    CHAT,
    Serve,
    free_port,
    get_json,
    in_flight,
    post,
    post_cut,
    run_ctl,
    samples,
    scrape,
    wait_for,
)

RECORDED = Path(__file__).resolve().parent / "kubernetes"
SELECTOR = "app.kubernetes.io/part-of=llm-fleet"
NS = "default"


def recorded_list() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((RECORDED / "endpointslice-list.json").read_text())
    return doc


def recorded_watch() -> list[bytes]:
    return (RECORDED / "endpointslice-watch.jsonl").read_bytes().splitlines()


def recorded_pods() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((RECORDED / "pod-list.json").read_text())
    return doc


def recorded_pod_watch() -> list[bytes]:
    return (RECORDED / "pod-watch.jsonl").read_bytes().splitlines()


SETTINGS = KubernetesDiscovery(selector=SELECTOR, port="http", labels_from=("gpu_class",))
ON_PODS = KubernetesDiscovery(selector=SELECTOR, port="http", labels_from=("gpu_class", "gpus"), selector_on="pods")


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


def test_pods_join_their_slices_endpoints_with_the_pods_model_and_labels_first() -> None:
    """The recorded pods and slices: readiness from the endpoint, model and labels from the pod, else the slice."""
    slices = {item["metadata"]["name"]: parse_slice(item, ON_PODS, "models") for item in recorded_list()["items"]}
    pods = {item["metadata"]["name"]: read_pod(item, ON_PODS) for item in recorded_pods()["items"]}
    views, problems = join_pods(slices, pods, ON_PODS, "models")
    assert problems == {}
    members = {m.config.id: m for view in views.values() for m in view.members}
    got = {rid: (m.config.model, m.config.url, dict(m.config.labels), m.terminating) for rid, m in members.items()}
    assert got == {
        "models/vllm-llama-8b-6d5c9b7f4-abcde": (
            "llama-3.1-8b",
            "http://10.244.1.17:8000",
            {"gpu_class": "h100", "gpus": "1"},
            False,
        ),
        "models/vllm-llama-8b-6d5c9b7f4-fghij": (
            "llama-3.1-8b",
            "http://10.244.2.31:8000",
            {"gpu_class": "h100", "gpus": "1"},
            True,
        ),
        "models/vllm-llama-8b-6d5c9b7f4-pqrst": (
            "llama-3.1-8b",
            "http://10.244.4.9:8000",
            {"gpu_class": "h100", "gpus": "1"},
            False,
        ),
        # The qwen pods carry no model label (the slice's names it) and their own gpu_class (l40s, not the slice's l4).
        "models/vllm-qwen-7b-7c8d9e0f1-uvwxy": (
            "qwen2.5-7b",
            "http://[fd00:10:244::1a]:8000",
            {"gpu_class": "l40s", "gpus": "2"},
            False,
        ),
    }
    # A pod the selector did not pick is no replica, though its endpoint is ready.
    del pods["vllm-llama-8b-6d5c9b7f4-abcde"]
    views, _ = join_pods(slices, pods, ON_PODS, "models")
    assert "models/vllm-llama-8b-6d5c9b7f4-abcde" not in {m.config.id for v in views.values() for m in v.members}
    # Pods of another namespace than the router's do not join.
    assert join_pods(slices, pods, ON_PODS, "other") == ({}, {})


def test_a_selected_pod_whose_slices_lack_the_port_or_any_model_label_is_no_replica_and_says_why() -> None:
    qwen_slice = recorded_list()["items"][1]
    qwen_pod = recorded_pods()["items"][4]
    pods = {qwen_pod["metadata"]["name"]: read_pod(qwen_pod, ON_PODS)}
    grpc = KubernetesDiscovery(selector=SELECTOR, port="grpc", selector_on="pods")
    views, problems = join_pods({"q": parse_slice(qwen_slice, grpc, "models")}, pods, grpc, "models")
    assert views == {}
    assert problems == {"models/vllm-qwen-7b-7c8d9e0f1-uvwxy": "is in EndpointSlice q, which has no port named 'grpc'"}
    other_label = KubernetesDiscovery(
        selector=SELECTOR, port="http", model_label="example.com/model", selector_on="pods"
    )
    pods = {qwen_pod["metadata"]["name"]: read_pod(qwen_pod, other_label)}
    views, problems = join_pods({"q": parse_slice(qwen_slice, other_label, "models")}, pods, other_label, "models")
    assert views == {}
    assert problems == {
        "models/vllm-qwen-7b-7c8d9e0f1-uvwxy": "has no label example.com/model naming its model, nor has its "
        "EndpointSlice q"
    }
    # Served through another slice (a second Service with the port): no problem to tell.
    http = parse_slice(qwen_slice, ON_PODS, "models")
    views, problems = join_pods(
        {"q": http, "z-metrics": replace(http, port=None)},
        {"vllm-qwen-7b-7c8d9e0f1-uvwxy": read_pod(qwen_pod, ON_PODS)},
        ON_PODS,
        "models",
    )
    assert set(views) == {"q"} and problems == {}


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
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "selector_on": "services"}},
            "discovery.kubernetes.selector_on",
            "must be 'endpointslices' or 'pods', got 'services'",
        ),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "selector_on": ["pods"]}},
            "discovery.kubernetes.selector_on",
            "must be a string",
        ),
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


async def library_configuration(kube: FakeKubernetesApi, tmp_path: Path) -> Any:
    """kubernetes_asyncio's configuration from a kubeconfig naming the fake (plain HTTP)."""
    from kubernetes_asyncio import client, config

    path = tmp_path / "kubeconfig"
    path.write_text(kube.kubeconfig())
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration, persist_config=False)
    return configuration


async def follow_recorded_watch(
    list_function: Callable[..., Any], check: Callable[[dict[str, Any]], None]
) -> tuple[list[tuple[str, str]], Any]:
    """Watch the replayed recording through the library to its 410: (type, resourceVersion) of each
    event, and the ApiException it ends in; `check` sees every event but bookmarks."""
    from kubernetes_asyncio import watch
    from kubernetes_asyncio.client.exceptions import ApiException

    seen = []
    stream = watch.Watch()

    async def follow() -> None:
        async for event in stream.stream(
            list_function,
            "models",
            label_selector=SELECTOR,
            resource_version="48213",
            allow_watch_bookmarks=True,
            timeout_seconds=5,
        ):
            seen.append((event["type"], event["raw_object"]["metadata"]["resourceVersion"]))
            if event["type"] != "BOOKMARK":
                check(event)

    with pytest.raises(ApiException) as gone:
        await follow()
    await stream.close()
    return seen, gone.value


async def test_the_library_reads_the_recorded_responses_as_the_fake_serves_them(
    kube: FakeKubernetesApi, tmp_path: Path
) -> None:
    """kubernetes_asyncio lists and watches the recorded documents; the router reads the same replicas either way."""
    from kubernetes_asyncio import client

    recorded = recorded_list()
    for item in recorded["items"]:
        kube.put({"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", **item})
    async with client.ApiClient(await library_configuration(kube, tmp_path)) as api_client:
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

        def check(event: dict[str, Any]) -> None:
            assert event["object"].metadata.name == "llama-8b-x7kq2"

        seen, gone = await follow_recorded_watch(api.list_namespaced_endpoint_slice, check)
        assert seen == [("ADDED", "48230"), ("MODIFIED", "48244"), ("BOOKMARK", "48251"), ("DELETED", "48259")]
        assert gone.status == 410
        asked = kube.requests[-1]
        assert "allowWatchBookmarks=True" in asked and "resourceVersion=48213" in asked and "watch=True" in asked


async def test_the_library_reads_the_recorded_pod_responses_as_the_fake_serves_them(
    kube: FakeKubernetesApi, tmp_path: Path
) -> None:
    """kubernetes_asyncio lists and watches the recorded Pods; the router reads the same pods from its models."""
    from kubernetes_asyncio import client

    recorded = recorded_pods()
    for item in recorded["items"]:
        kube.put({"kind": "Pod", "apiVersion": "v1", **item})
    async with client.ApiClient(await library_configuration(kube, tmp_path)) as api_client:
        api = client.CoreV1Api(api_client)
        listed = await api.list_namespaced_pod("models", label_selector=SELECTOR)
        assert listed.metadata.resource_version == str(kube.revision)
        assert [p.metadata.name for p in listed.items] == [p["metadata"]["name"] for p in recorded["items"]]
        leaving = listed.items[1]
        assert leaving.metadata.deletion_timestamp is not None and leaving.spec.containers[0].name == "vllm"
        assert listed.items[4].metadata.labels["gpus"] == "2"
        through_library = api_client.sanitize_for_serialization(listed)
        for raw, parsed in zip(recorded["items"], through_library["items"], strict=True):
            assert read_pod(parsed, ON_PODS) == read_pod(raw, ON_PODS)
        # Only the selected pods: the selector is the fake's to apply, as the API server's.
        none = await api.list_namespaced_pod("models", label_selector="app.kubernetes.io/part-of=other")
        assert none.items == []
        # The fake's own pods are pods to the library too (a Pod without containers is not).
        kube.put(pod("made", "127.0.0.2", labels={"router.llm/model": "m"}, namespace="fleet"))
        (made,) = (await api.list_namespaced_pod("fleet")).items
        assert (made.metadata.name, made.status.pod_ip) == ("made", "127.0.0.2")

        kube.replay = recorded_pod_watch()

        def check(event: dict[str, Any]) -> None:
            # The library's model of each event's pod: what a drifted fake would fail to build.
            assert event["object"].spec.containers[0].image.startswith("vllm/vllm-openai")
            assert read_pod(api_client.sanitize_for_serialization(event["object"]), ON_PODS) == read_pod(
                event["raw_object"], ON_PODS
            )

        seen, gone = await follow_recorded_watch(api.list_namespaced_pod, check)
        assert seen == [("ADDED", "48231"), ("MODIFIED", "48247"), ("BOOKMARK", "48255"), ("DELETED", "48262")]
        assert gone.status == 410
        asked = kube.requests[-1]
        assert asked.startswith("/api/v1/namespaces/models/pods?")
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
    from tests.control.kube_api import _status

    assert _paths({"type": "ERROR", "object": _status(410, "Expired", "m")}) == _paths(error)
    # And its pods, their bookmarks and errors.
    recorded_pod = {"kind": "Pod", "apiVersion": "v1", **recorded_pods()["items"][0]}
    made = pod("p", "127.0.0.2", labels={"a": "b"})
    made["metadata"]["resourceVersion"] = "1"
    made["metadata"]["uid"] = "u"
    labels = {p for p in _paths(made) if p.startswith(".metadata.labels.")}
    assert _paths(made) - labels <= _paths(recorded_pod)
    pod_events = [orjson.loads(line) for line in recorded_pod_watch()]
    bookmark = next(e for e in pod_events if e["type"] == "BOOKMARK")
    assert _paths(
        {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}}}
    ) <= _paths(bookmark)
    error = next(e for e in pod_events if e["type"] == "ERROR")
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


StartDiscovery = Callable[..., Awaitable[tuple[RouterServer, KubernetesSource]]]


@pytest.fixture
async def start_discovery(kube: FakeKubernetesApi, tmp_path: Path) -> AsyncIterator[StartDiscovery]:
    """A router whose set comes from the fake API server; `keys` go into [discovery.kubernetes]."""
    path = tmp_path / "kubeconfig"
    path.write_text(kube.kubeconfig())
    servers: list[RouterServer] = []

    async def start(watch_seconds: float = 30.0, **keys: Any) -> tuple[RouterServer, KubernetesSource]:
        raw = {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "router_name": "test",
            "tick_seconds": 0.1,
            "connect_timeout_seconds": 2.0,
            "discovery": {"kubernetes": {"selector": SELECTOR, "port": "http", "kubeconfig": str(path), **keys}},
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
            watch_seconds=watch_seconds,
            min_watch_seconds=0.2,
        )
        server = RouterServer(config, registry=CollectorRegistry(), sources=[source])
        await server.start()
        servers.append(server)
        return server, source

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def discovery(start_discovery: StartDiscovery) -> tuple[RouterServer, KubernetesSource]:
    return await start_discovery()


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
    caplog.set_level(logging.WARNING, "router.control.discovery")
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
    kube: FakeKubernetesApi, pods: Pods, start_discovery: StartDiscovery, caplog: pytest.LogCaptureFixture
) -> None:
    """RBAC missing: not ready, the API server's own message in the log; once allowed, the set arrives."""
    caplog.set_level(logging.WARNING, "router.control.discovery")
    a = await pods.add("pod-a")
    kube.put(model_slice("llama", "m", [a], pods.port))
    # Refused from the router's first request on (a server stopped under a request in flight
    # can hold its connect for seconds).
    kube.forbidden = {"endpointslices"}
    server, source = await start_discovery()
    await wait_for(lambda: "forbidden" in caplog.text)
    assert "HTTP 403: endpointslices.discovery.k8s.io is forbidden" in caplog.text
    assert not source.ready() and router_set(server) == {}
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as resp:
        assert resp.status == 503
    kube.forbidden = set()
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


# selector_on = "pods": the selector picks pods; the namespace's slices say which serve -------------


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


@pytest.fixture
async def pod_discovery(start_discovery: StartDiscovery) -> tuple[RouterServer, KubernetesSource]:
    return await start_discovery(selector_on="pods", labels_from=["gpu_class", "gpus"])


async def test_pods_mode_follows_pods_added_made_unready_and_deleted(
    kube: FakeKubernetesApi, pods: Pods, pod_discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, source = pod_discovery
    a, b, c, other = [await pods.add(n) for n in ("pod-a", "pod-b", "pod-c", "pod-other")]
    await wait_for(source.ready)
    for e in (a, b):
        kube.put(fleet_pod(e))
    # A pod the selector does not pick, in the same Service: never a replica.
    kube.put(pod(other.pod, other.address, labels={"app.kubernetes.io/part-of": "something-else"}))
    kube.put(service_slice("engines", [a, b, other], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    assert router_set(server) == api_says(kube)
    await settled(server, pods, ["pod-other"], ["m"])
    # Added.
    kube.put(fleet_pod(c))
    kube.put(service_slice("engines", [a, b, c, other], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b), "c": ("m", c)}, pods.port))
    # Made unready: its endpoint's conditions decide, as in the default mode.
    unready = Endpoint(b.pod, b.address, ready=False, serving=False)
    kube.put(service_slice("engines", [a, unready, c, other], pods.port))
    await in_sync(server, expect({"a": ("m", a), "c": ("m", c)}, pods.port))
    await settled(server, pods, ["pod-b", "pod-other"], ["m"])
    # Deleted: the pod goes before its slice says so, and leaves the set with it.
    kube.delete(NS, "pod-a", kind="Pod")
    await in_sync(server, expect({"c": ("m", c)}, pods.port))
    assert router_set(server) == api_says(kube)
    await settled(server, pods, ["pod-a", "pod-b", "pod-other"], ["m"])
    kube.put(service_slice("engines", [unready, c, other], pods.port))
    await caught_up(source, "endpointslices", kube)
    assert router_set(server) == api_says(kube) == expect({"c": ("m", c)}, pods.port)
    assert source.relists["error"] == 0


async def test_a_pods_model_label_change_moves_it_keeping_its_id(
    kube: FakeKubernetesApi, pods: Pods, pod_discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, _ = pod_discovery
    a, p, b = await pods.add("pod-a"), await pods.add("pod-p"), await pods.add("pod-b")
    kube.put(fleet_pod(a, "a"))
    kube.put(fleet_pod(p, "a"))
    kube.put(fleet_pod(b, "b"))
    # One Service for every model, labelled for one of them: in pods mode the pod's label wins.
    kube.put(service_slice("engines", [a, p, b], pods.port, **{"router.llm/model": "a"}))
    await in_sync(server, expect({"a": ("a", a), "p": ("a", p), "b": ("b", b)}, pods.port))
    await traffic(server, ["a", "b"])
    kube.put(fleet_pod(p, "b"))
    await in_sync(server, expect({"a": ("a", a), "p": ("b", p), "b": ("b", b)}, pods.port))
    assert router_set(server) == api_says(kube)
    pods.fakes["pod-p"].seen.clear()
    await traffic(server, ["a"], n=8)
    assert pods.fakes["pod-p"].seen == [], "model a's requests still reach the pod that moved to b"
    await traffic(server, ["b"], n=8)
    assert pods.fakes["pod-p"].seen, "the moved pod got none of model b's requests"
    assert all(orjson.loads(s.body)["model"] == "b" for s in pods.fakes["pod-p"].seen)
    await settled(server, pods, [], ["a", "b"])


async def test_a_pod_that_stops_matching_the_selector_leaves_at_once(
    kube: FakeKubernetesApi, pods: Pods, pod_discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    """Its endpoint is still ready in the slice; the pod watch's DELETED alone takes it out."""
    server, _ = pod_discovery
    a, p = await pods.add("pod-a"), await pods.add("pod-p")
    kube.put(fleet_pod(a))
    kube.put(fleet_pod(p))
    kube.put(service_slice("engines", [a, p], pods.port))
    await in_sync(server, expect({"a": ("m", a), "p": ("m", p)}, pods.port))
    kube.put(pod(p.pod, p.address, labels={"app.kubernetes.io/part-of": "retired", "router.llm/model": "m"}))
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert ("EndpointSlice", NS, "engines") in kube.objects and kube.objects["EndpointSlice", NS, "engines"][
        "endpoints"
    ][1]["conditions"]["ready"]
    assert router_set(server) == api_says(kube)
    await settled(server, pods, ["pod-p"], ["m"])
    # Matching again: back, under the same id.
    kube.put(fleet_pod(p))
    await in_sync(server, expect({"a": ("m", a), "p": ("m", p)}, pods.port))


@pytest.mark.parametrize("order", ["pod-first", "slice-first"])
async def test_a_pod_event_before_or_after_its_slice_event_ends_in_the_same_set(
    kube: FakeKubernetesApi, pods: Pods, pod_discovery: tuple[RouterServer, KubernetesSource], order: str
) -> None:
    server, source = pod_discovery
    a, n = await pods.add("pod-a"), await pods.add("pod-n")
    kube.put(fleet_pod(a))
    kube.put(service_slice("engines", [a], pods.port))
    before = expect({"a": ("m", a)}, pods.port)
    await in_sync(server, before)
    # Arriving: the first event alone makes no replica (a pod in no slice, an endpoint of no selected pod).
    if order == "pod-first":
        kube.put(fleet_pod(n))
        await caught_up(source, "pods", kube)
    else:
        kube.put(service_slice("engines", [a, n], pods.port))
        await caught_up(source, "endpointslices", kube)
    assert router_set(server) == before
    if order == "pod-first":
        kube.put(service_slice("engines", [a, n], pods.port))
    else:
        kube.put(fleet_pod(n))
    both = expect({"a": ("m", a), "n": ("m", n)}, pods.port)
    await in_sync(server, both)
    assert router_set(server) == api_says(kube)
    await traffic(server, ["m"], n=8)
    assert pods.seen()["pod-n"] > 0
    # Leaving: either event alone takes it out.
    if order == "pod-first":
        kube.delete(NS, "pod-n", kind="Pod")
        await caught_up(source, "pods", kube)
    else:
        kube.put(service_slice("engines", [a], pods.port))
        await caught_up(source, "endpointslices", kube)
    assert router_set(server) == before
    await settled(server, pods, ["pod-n"], ["m"])
    if order == "pod-first":
        kube.put(service_slice("engines", [a], pods.port))
    else:
        kube.delete(NS, "pod-n", kind="Pod")
    await caught_up(source, "pods", kube)
    await caught_up(source, "endpointslices", kube)
    assert router_set(server) == api_says(kube) == before


async def test_labels_from_read_the_pods_labels_then_the_slices_into_replicas_and_ctl_status(
    kube: FakeKubernetesApi, pods: Pods, pod_discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, _ = pod_discovery
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    kube.put(fleet_pod(a, gpu_class="h100", gpus="2"))
    # No model and no gpu_class on this pod: both come from its Service's slice.
    kube.put(fleet_pod(b, None, gpus="1"))
    kube.put(service_slice("engines", [a, b], pods.port, **{"router.llm/model": "m", "gpu_class": "l4"}))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    assert router_set(server) == api_says(kube)
    replicas = {r["id"]: r["labels"] for r in await get_json(server.admin_url + "/api/v1/replicas")}
    assert replicas == {
        f"{NS}/pod-a": {"gpu_class": "h100", "gpus": "2"},
        f"{NS}/pod-b": {"gpu_class": "l4", "gpus": "1"},
    }
    code, out = await asyncio.to_thread(run_ctl, "status", "--server", server.admin_url, "--json")
    assert code == 0
    assert {g["gpu_class"]: g["total"] for g in json.loads(out)["gpus"]} == {"h100": 2, "l4": 1}
    code, out = await asyncio.to_thread(run_ctl, "status", "--server", server.admin_url)
    assert code == 0
    assert any(line.split()[:2] == ["h100", "2"] for line in out.splitlines()), out
    # A label changed on the pod changes the replica's labels in place.
    kube.put(fleet_pod(a, gpu_class="h200", gpus="2"))

    def gpu_class_of_a() -> object:
        replica = server.pool.get(f"{NS}/pod-a")
        return None if replica is None else replica.config.labels.get("gpu_class")

    await wait_for(lambda: gpu_class_of_a() == "h200")
    await settled(server, pods, [], ["m"])


async def test_a_selected_pod_no_slice_serves_is_warned_of_once_and_joins_when_one_does(
    kube: FakeKubernetesApi,
    pods: Pods,
    pod_discovery: tuple[RouterServer, KubernetesSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, source = pod_discovery
    caplog.set_level(logging.WARNING, "router.control.discovery")
    a = await pods.add("pod-a")
    kube.put(fleet_pod(a))
    # Only a metrics Service holds it so far: no port named "http".
    kube.put(endpoint_slice("metrics", [a], labels={}, port=9100, port_name="metrics"))
    await caught_up(source, "endpointslices", kube)
    await caught_up(source, "pods", kube)
    warning = "Pod default/pod-a is in EndpointSlice metrics, which has no port named 'http'; it is not a replica"
    await wait_for(lambda: warning in caplog.text)
    assert router_set(server) == {}
    kube.put(fleet_pod(a, gpu_class="h100"))
    await caught_up(source, "pods", kube)
    assert caplog.text.count(warning) == 1
    kube.put(service_slice("engines", [a], pods.port))
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert router_set(server) == api_says(kube)
    await settled(server, pods, [], ["m"])


async def test_the_pod_watch_closed_again_and_again_during_a_churn(
    kube: FakeKubernetesApi, pods: Pods, start_discovery: StartDiscovery
) -> None:
    """Pods join, leave, change model and stop matching while every pod watch is closed twice a second."""
    # Slice watches that outlast the test: only the pod watch is cut, and only it relists.
    server, source = await start_discovery(selector_on="pods", watch_seconds=300.0)
    endpoints = [await pods.add(f"pod-{i:02d}") for i in range(60)]
    await wait_for(source.ready)

    async def close_pod_watches() -> None:
        while True:
            await asyncio.sleep(0.5)
            kube.close_watches("Pod")

    closer = asyncio.ensure_future(close_pod_watches())
    rng = random.Random(1717)
    in_slice: dict[str, Endpoint] = {}
    try:
        for step in range(30):
            for e in endpoints[step * 2 : step * 2 + 2]:
                kube.put(fleet_pod(e, rng.choice(["a", "b"])))
                in_slice[e.pod] = e
            for name in rng.sample(sorted(in_slice), k=min(3, len(in_slice))):
                e = in_slice[name]
                change = rng.randrange(5)
                if change == 0:
                    kube.put(fleet_pod(e, rng.choice(["a", "b"])))
                elif change == 1:
                    kube.put(pod(e.pod, e.address, labels={"app.kubernetes.io/part-of": "elsewhere"}))
                elif change == 2 and ("Pod", NS, name) in kube.objects:
                    kube.delete(NS, name, kind="Pod")
                elif change == 3:
                    in_slice[name] = Endpoint(name, e.address, ready=not e.ready, serving=not e.ready)
                else:
                    kube.put(fleet_pod(e, rng.choice(["a", "b"])))
            for shard in range(2):
                members = [e for e in in_slice.values() if int(e.pod[-2:]) % 2 == shard]
                kube.put(service_slice(f"engines-{shard}", members, pods.port))
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.2)  # more closes with the churn over
    finally:
        closer.cancel()
    wanted = api_says(kube)
    assert wanted, "the churn left no replica to check"
    await in_sync(server, wanted)
    by_kind = source.relists_of()
    assert by_kind["pods"]["watch_ended"] >= 2
    assert by_kind["endpointslices"]["watch_ended"] == 0
    removed = [e.pod for e in endpoints if f"{NS}/{e.pod}" not in wanted]
    await settled(server, pods, removed, sorted({model for model, _ in wanted.values()}))


async def test_api_server_down_in_pods_mode_keeps_the_set_and_the_gauge_grows(
    kube: FakeKubernetesApi,
    pods: Pods,
    pod_discovery: tuple[RouterServer, KubernetesSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, source = pod_discovery
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    for e in (a, b):
        kube.put(fleet_pod(e))
    kube.put(service_slice("engines", [a, b], pods.port))
    wanted = expect({"a": ("m", a), "b": ("m", b)}, pods.port)
    await in_sync(server, wanted)
    caplog.set_level(logging.WARNING, "router.control.discovery")
    await kube.stop()
    down_since = time.monotonic()
    stale: list[float] = []
    while time.monotonic() - down_since < 3:
        await traffic(server, ["m"], n=2)
        assert router_set(server) == wanted
        async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as r:
            assert r.status == 200
        stale.append(samples(await scrape(server), "router_discovery_stale_seconds")[()])
        await asyncio.sleep(0.3)
    assert stale[-1] >= 2.0 and stale == sorted(stale)
    assert "cannot read Pods from the Kubernetes API" in caplog.text
    assert "cannot read EndpointSlices from the Kubernetes API" in caplog.text
    relists = samples(await scrape(server), "router_discovery_relists_total")
    assert relists[("reason", "error"), ("resource", "pods")] >= 1
    assert relists[("reason", "error"), ("resource", "endpointslices")] >= 1
    # Back, with a pod deleted meanwhile that no watch will tell of.
    kube.delete(NS, "pod-b", kind="Pod", tell=False)
    await kube.start()
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert router_set(server) == api_says(kube)
    await wait_for(lambda: source.stale_seconds() == 0.0)
    await settled(server, pods, ["pod-b"], ["m"])


async def test_pods_unreadable_alone_hold_readiness_then_make_the_set_stale(
    kube: FakeKubernetesApi, pods: Pods, start_discovery: StartDiscovery, caplog: pytest.LogCaptureFixture
) -> None:
    """RBAC without pods: not ready, the API server's reason logged; revoked later: one gauge, the set kept."""
    caplog.set_level(logging.WARNING, "router.control.discovery")
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    for e in (a, b):
        kube.put(fleet_pod(e))
    kube.put(service_slice("engines", [a, b], pods.port))
    # The Role of the default mode only: the slices are readable, the pods not.
    kube.forbidden = {"pods"}
    server, source = await start_discovery(selector_on="pods")
    await wait_for(lambda: "pods is forbidden" in caplog.text, timeout=10)
    await caught_up(source, "endpointslices", kube)
    assert 'HTTP 403: pods is forbidden: User "system:serviceaccount:default:router" cannot list' in caplog.text
    assert not source.ready() and router_set(server) == {}
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as resp:
        assert resp.status == 503
    kube.forbidden = set()
    wanted = expect({"a": ("m", a), "b": ("m", b)}, pods.port)
    await in_sync(server, wanted)
    await wait_for(source.ready)
    assert samples(await scrape(server), "router_discovery_stale_seconds") == {(): 0.0}
    # Pods revoked while the slices stay readable: stale, and the last known pods kept.
    kube.forbidden = {"pods"}
    kube.close_watches("Pod")
    await wait_for(lambda: source.stale_seconds() > 1.0)
    assert router_set(server) == wanted
    await traffic(server, ["m"])
    # The slices are still read: a pod made unready leaves.
    kube.put(service_slice("engines", [a, Endpoint(b.pod, b.address, ready=False, serving=False)], pods.port))
    await in_sync(server, expect({"a": ("m", a)}, pods.port))
    assert source.stale_seconds() > 1.0
    await settled(server, pods, ["pod-b"], ["m"])
    kube.forbidden = set()
    await wait_for(lambda: source.stale_seconds() == 0.0, timeout=10)
    assert router_set(server) == api_says(kube)


# A real `router serve`, one process or a supervisor and its workers --------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "selector_on"), [(1, "endpointslices"), (2, "endpointslices"), (2, "pods")])
async def test_router_serve_discovers_through_a_plain_http_kubeconfig_and_waits_for_the_first_list(
    serve: Serve, pods: Pods, tmp_path: Path, workers: int, selector_on: str
) -> None:
    """Not ready before the API answers; then the set, 409 on pushes, the gauge; with --workers one watch only."""
    kube = FakeKubernetesApi(bookmark_seconds=0.2)
    kube.port = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube.kubeconfig())
    a, b = await pods.add("pod-a"), await pods.add("pod-b")

    def engines(*endpoints: Endpoint) -> dict[str, Any]:
        if selector_on == "pods":
            return service_slice("llama", endpoints, pods.port, **{"router.llm/model": "m"})
        return model_slice("llama", "m", endpoints, pods.port)

    if selector_on == "pods":
        kube.put(fleet_pod(a))
        kube.put(fleet_pod(b))
    kube.put(engines(a, b))
    serve.write(
        [],
        f'[discovery.kubernetes]\nselector = "{SELECTOR}"\nselector_on = "{selector_on}"\nport = "http"\n'
        f'kubeconfig = "{kubeconfig}"\n',
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
            kube.put(engines(a))
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
        # Discovery runs once: in the supervisor, never in a worker. In pods mode: one watch of each.
        kinds = ["EndpointSlice", "Pod"] if selector_on == "pods" else ["EndpointSlice"]
        assert {kind: kube.watching(kind) for kind in kinds} == dict.fromkeys(kinds, 1)
        assert len(kube.watches) == len(kinds)
        lists = [r for r in kube.requests if "watch=" not in r]
        assert len(lists) == len(kinds), lists
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
