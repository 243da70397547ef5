"""EndpointSlices and Pods to replicas: the pure parse, on the recorded documents, without an API server."""

from __future__ import annotations

from dataclasses import replace

from router.control.discovery.parse import Member, SliceView, desired_set, join_pods, parse_slice, read_pod, read_slice
from router.core.config import KubernetesDiscovery, ReplicaConfig
from tests.control.discovery.recorded import ON_PODS, SELECTOR, SETTINGS, recorded_list, recorded_pods

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
