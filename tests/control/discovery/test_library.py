"""kubernetes_asyncio against the fake API server (kube_api.py), on the recorded responses:
so that the fake cannot drift from what the library expects.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.control.discovery.parse import read_pod, read_slice
from tests.control.discovery.recorded import (
    ON_PODS,
    SELECTOR,
    SETTINGS,
    recorded_list,
    recorded_pod_watch,
    recorded_pods,
    recorded_watch,
)
from tests.support.kube_api import Endpoint, FakeKubernetesApi, endpoint_slice, pod


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
    from tests.support.kube_api import _status

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
