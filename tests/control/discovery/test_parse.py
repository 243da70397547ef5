"""EndpointSlices and Pods to replicas: the pure parse on the recorded documents and on broken ones, no API server."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Any

import orjson
import pytest

from router.control.discovery.parse import (
    MalformedObject,
    Member,
    SliceView,
    desired_set,
    join_pods,
    parse_slice,
    read_event,
    read_list,
    read_pod,
    read_slice,
)
from router.core.config.settings import KubernetesDiscovery, ReplicaConfig
from tests.control.discovery.recorded import (
    ON_PODS,
    SELECTOR,
    SETTINGS,
    recorded_list,
    recorded_pod_watch,
    recorded_pods,
    recorded_watch,
)

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


# Lists, watch events, and objects not shaped as the API serves them ---------------------


def test_a_list_is_read_by_object_name_with_its_resource_version() -> None:
    listed = read_list(recorded_list(), "EndpointSlice")
    assert [name for name, _ in listed.items] == ["llama-8b-x7kq2", "qwen-7b-m2v8d"]
    assert listed.version == "48213"
    pods = read_list(recorded_pods(), "Pod")
    assert [name for name, _ in pods.items] == [p["metadata"]["name"] for p in recorded_pods()["items"]]


@pytest.mark.parametrize("lines", [recorded_watch(), recorded_pod_watch()], ids=["endpointslices", "pods"])
def test_watch_events_carry_their_type_name_and_resource_version(lines: list[bytes]) -> None:
    """The recorded streams as the library yields them (the object's JSON as raw_object); bookmarks name nothing."""
    events = [orjson.loads(line) for line in lines]
    read = [read_event({"type": e["type"], "raw_object": e["object"]}, "x") for e in events if e["type"] != "ERROR"]
    assert [(e.type, e.name is not None, e.version) for e in read] == [
        (e["type"], e["type"] != "BOOKMARK", e["object"]["metadata"]["resourceVersion"])
        for e in events
        if e["type"] != "ERROR"
    ]
    assert read[0].name == events[0]["object"]["metadata"]["name"]


def _llama() -> dict[str, Any]:
    item: dict[str, Any] = copy.deepcopy(recorded_list()["items"][0])
    return item


@pytest.mark.parametrize(
    ("break_it", "field"),
    [
        (lambda s: s["endpoints"][0].update(addresses=["10.244.1.17/admin"]), "endpoints[0].addresses[0]"),
        (lambda s: s["endpoints"][0].update(addresses=["10.244.1.17:9000"]), "endpoints[0].addresses[0]"),
        (lambda s: s["endpoints"][0].update(addresses=[""]), "endpoints[0].addresses[0]"),
        (lambda s: s.update(addressType="IPv6"), "is not an IPv6 address"),
        (lambda s: s["endpoints"][0].update(addresses=[17]), "endpoints[0].addresses[0] is not a string"),
        (lambda s: s["endpoints"][3].update(conditions={"ready": "true"}), "endpoints[3].conditions.ready"),
        (lambda s: s["endpoints"][0].update(targetRef=["Pod"]), "endpoints[0].targetRef is not an object"),
        (lambda s: s["ports"][0].update(port=True), "ports[0].port is not a port number"),
        (lambda s: s["ports"][0].update(port=70000), "ports[0].port is not a port number"),
        (lambda s: s.update(endpoints={"a": 1}), "endpoints is not an array"),
        (lambda s: s["metadata"]["labels"].update({"router.llm/model": 3}), "label router.llm/model"),
        (lambda s: s["metadata"].update(labels="app=x"), "metadata.labels is not an object"),
    ],
)
def test_a_slice_not_shaped_as_the_api_serves_it_is_malformed_and_the_error_names_the_field(
    break_it: Any, field: str
) -> None:
    """Never a replica with a URL that points elsewhere, nor a TypeError from deep in the parse."""
    item = _llama()
    break_it(item)
    with pytest.raises(MalformedObject, match=r"^EndpointSlice llama-8b-x7kq2: ") as caught:
        read_slice(item, SETTINGS, "models")
    assert field in str(caught.value)


def test_an_ipv6_zone_or_an_ipv4_address_in_an_ipv6_slice_is_malformed() -> None:
    qwen = copy.deepcopy(recorded_list()["items"][1])
    for address in ("fe80::1%eth0", "10.0.0.1", "[fd00::1]"):
        qwen["endpoints"][0]["addresses"] = [address]
        with pytest.raises(MalformedObject, match="is not an IPv6 address"):
            parse_slice(qwen, SETTINGS, "models")


def test_a_named_port_without_a_number_is_no_port_and_another_entry_of_the_name_may_have_one() -> None:
    item = _llama()
    item["ports"] = [{"name": "http", "protocol": "TCP"}]
    assert read_slice(item, SETTINGS, "models").problem == "has no port named 'http'"
    item["ports"].append({"name": "http", "port": 8001})
    assert {m.config.url.rsplit(":", 1)[1] for m in read_slice(item, SETTINGS, "models").members} == {"8001"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "the Pod list is not an object"),
        ({"items": {}, "metadata": {"resourceVersion": "7"}}, "the Pod list's items is not an array"),
        ({"items": [{"metadata": {}}]}, "a Pod has no metadata.name"),
        ({"items": [7]}, "a Pod is not an object"),
        # Read as empty, these would take every replica out of the set.
        (None, "the Pod list is not an object"),
        ({"items": []}, "the Pod list carries no resourceVersion"),
        ({"items": [], "metadata": {"resourceVersion": ""}}, "the Pod list carries no resourceVersion"),
    ],
)
def test_a_list_not_shaped_as_the_api_serves_it_is_malformed(doc: object, message: str) -> None:
    with pytest.raises(MalformedObject, match=f"^{re.escape(message)}$"):
        read_list(doc, "Pod")


def test_a_watch_event_without_a_type_or_a_named_object_is_malformed() -> None:
    with pytest.raises(MalformedObject, match="has no type"):
        read_event({"raw_object": {}}, "Pod")
    with pytest.raises(MalformedObject, match=r"has no metadata\.name"):
        read_event({"type": "DELETED", "raw_object": {"metadata": {"resourceVersion": "3"}}}, "Pod")
    unknown = read_event({"type": "SURPRISE", "raw_object": None}, "Pod")
    assert (unknown.type, unknown.name, unknown.version) == ("SURPRISE", None, None)


def test_a_ready_endpoint_that_is_not_serving_is_no_replica() -> None:
    """publishNotReadyAddresses makes every endpoint ready; serving false still says the pod is not."""
    item = _llama()
    for endpoint in item["endpoints"]:
        endpoint["conditions"] = {"ready": True, "serving": False, "terminating": False}
    assert read_slice(item, SETTINGS, "models").members == ()


def test_the_unnamed_port_of_a_service_is_looked_up_by_the_empty_name() -> None:
    """A Service with one unnamed port gives its slices a port named "" (or no name at all)."""
    item = _llama()
    item["ports"] = [{"port": 8000, "protocol": "TCP"}]
    unnamed = KubernetesDiscovery(selector="x", port="")
    assert {m.config.url.rsplit(":", 1)[1] for m in read_slice(item, unnamed, "models").members} == {"8000"}
    item["ports"] = [{"name": "", "port": 8001}]
    assert {m.config.url.rsplit(":", 1)[1] for m in read_slice(item, unnamed, "models").members} == {"8001"}
    assert read_slice(item, SETTINGS, "models").problem == "has no port named 'http'"


def test_the_engine_label_names_each_replicas_engine_the_pods_first_and_an_unknown_one_is_none() -> None:
    """`engine_label` (router.llm/engine): the engine whose load is read; a value the router does not read
    is as no label (the replica's own /v1/models and /metrics say then)."""
    slice_doc = copy.deepcopy(recorded_list()["items"][0])
    slice_doc["metadata"]["labels"]["router.llm/engine"] = "sglang"
    on_slices = read_slice(slice_doc, SETTINGS, "models")
    assert {m.config.engine for m in on_slices.members} == {"sglang"}
    assert {m.config.engine for m in read_slice(recorded_list()["items"][0], SETTINGS, "models").members} == {None}
    slices = {"s": parse_slice(slice_doc, ON_PODS, "models")}
    pods = {item["metadata"]["name"]: copy.deepcopy(item) for item in recorded_pods()["items"]}
    pods["vllm-llama-8b-6d5c9b7f4-abcde"]["metadata"]["labels"]["router.llm/engine"] = "vllm"
    pods["vllm-llama-8b-6d5c9b7f4-fghij"]["metadata"]["labels"]["router.llm/engine"] = "an-engine-of-our-own"
    views, _ = join_pods(slices, {n: read_pod(p, ON_PODS) for n, p in pods.items()}, ON_PODS, "models")
    engines = {m.config.id.rsplit("-", 1)[1]: m.config.engine for view in views.values() for m in view.members}
    # The pod's label first, then the slice's: an unknown value on the pod falls back to the slice's.
    assert engines == {"abcde": "vllm", "fghij": "sglang", "pqrst": "sglang"}
    renamed = replace(SETTINGS, engine_label="example.com/engine")
    assert {m.config.engine for m in read_slice(slice_doc, renamed, "models").members} == {None}
