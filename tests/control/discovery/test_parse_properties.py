"""Properties of the pure parse over generated EndpointSlices, Pods, lists and watch events.

The objects are mostly shaped as the API serves them, with any field now
and then replaced by arbitrary JSON: whatever comes, the parse yields
replicas a config file would accept, each pointing at its endpoint's
address and port, or it raises MalformedObject, never anything else.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.control.discovery.parse import (
    MalformedObject,
    SliceRead,
    SliceView,
    desired_set,
    join_pods,
    object_name,
    parse_slice,
    read_event,
    read_list,
    read_pod,
    slice_members,
)
from router.core.config.settings import DEFAULT_MODEL_LABEL, KubernetesDiscovery, ReplicaConfig, parse_config
from router.http.origin import Origin
from tests.control.discovery.recorded import NS, SELECTOR

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def mostly(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The field as the API serves it, or one time in thirty-two any JSON at all in its place."""
    return st.sampled_from(range(32)).flatmap(lambda n: JSON if n == 7 else strategy)


def now_and_then(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The usual value, or one time in eight an odd one of the right type."""
    return st.sampled_from(range(8)).flatmap(lambda n: odd if n == 3 else usual)


pod_names = st.sampled_from(["pod-a", "pod-b", "pod-c", "pod-d"])
odd_addresses = st.sampled_from(
    ["engine.models.svc", "10.0.0.1/admin", "10.0.0.1:80", "fe80::1%eth0", "[::1]", "", "a b", "010.0.0.1"]
) | st.text(max_size=12)
flags = mostly(st.none() | st.booleans())
labels = st.fixed_dictionaries(
    {DEFAULT_MODEL_LABEL: mostly(now_and_then(st.sampled_from(["m", "n"]), st.just("")))},
    optional={"gpu_class": mostly(st.sampled_from(["h100", "l4"])), "gpus": mostly(st.sampled_from(["1", "2", "x"]))},
)
port_entries = st.fixed_dictionaries(
    {
        "name": mostly(now_and_then(st.just("http"), st.just("metrics"))),
        "port": mostly(
            now_and_then(st.integers(1, 65535), st.none() | st.booleans() | st.sampled_from([0, -1, 65536, 70000]))
        ),
    },
    optional={"protocol": st.just("TCP")},
)


def endpoints(ipv6: bool) -> st.SearchStrategy[Any]:
    address = now_and_then(st.ip_addresses(v=6 if ipv6 else 4).map(str), odd_addresses)
    target = st.fixed_dictionaries(
        {"kind": mostly(now_and_then(st.just("Pod"), st.just("Node"))), "name": mostly(pod_names)},
        optional={"namespace": mostly(now_and_then(st.just(NS), st.just("other")))},
    )
    conditions = st.fixed_dictionaries({"ready": flags, "serving": flags, "terminating": flags})
    return st.fixed_dictionaries(
        {
            "addresses": mostly(st.lists(address, min_size=1, max_size=2)),
            # Absent (null) now and then: nil conditions read as ready.
            "conditions": mostly(now_and_then(conditions, st.none())),
            "targetRef": mostly(now_and_then(target, st.none())),
        }
    )


@st.composite
def slices(draw: st.DrawFn) -> Any:
    ipv6 = draw(st.booleans())
    return draw(
        st.fixed_dictionaries(
            {
                "metadata": mostly(st.fixed_dictionaries({"name": mostly(pod_names), "labels": mostly(labels)})),
                "addressType": mostly(now_and_then(st.just("IPv6" if ipv6 else "IPv4"), st.just("FQDN"))),
                "endpoints": mostly(st.lists(mostly(endpoints(ipv6)), min_size=1, max_size=4)),
                "ports": mostly(st.lists(mostly(port_entries), min_size=1, max_size=2)),
            }
        )
    )


pods = st.fixed_dictionaries(
    {"metadata": mostly(st.fixed_dictionaries({"name": mostly(pod_names), "labels": mostly(labels)}))}
)
discovery_settings = st.builds(
    KubernetesDiscovery,
    selector=st.just(SELECTOR),
    port=now_and_then(st.just("http"), st.sampled_from(["metrics", 8443])),
    labels_from=st.sampled_from([(), ("gpu_class",), ("gpu_class", "gpus")]),
    selector_on=st.sampled_from(["endpointslices", "pods"]),
)


def points_at_its_endpoint(config: ReplicaConfig, read: SliceRead) -> bool:
    """The URL reaches one of the slice's endpoint addresses on the slice's port, with no path before the client's."""
    origin = Origin.parse(config.url)
    hosts = {e.host.strip("[]") for e in read.endpoints}
    if ":" in origin.host:
        found = any(":" in h and ipaddress.ip_address(h) == ipaddress.ip_address(origin.host) for h in hosts)
    else:
        found = origin.host in {h.lower() for h in hosts}
    return found and origin.port == read.port and origin.prefix == b"" and not origin.tls


def accepted_by_a_config_file(configs: list[ReplicaConfig]) -> None:
    """ConfigError unless every id is a unique non-empty string and every URL one a config file takes."""
    raw = [{"id": c.id, "model": c.model, "url": c.url} for c in configs]
    assert {c.id for c in parse_config({"replicas": raw}, "<generated>", environ={}).replicas} == {
        c.id for c in configs
    }


@settings(max_examples=200, deadline=None)
@given(st.lists(slices(), max_size=4), st.lists(pods, max_size=4), discovery_settings)
def test_whatever_the_api_serves_the_parse_yields_replicas_at_their_endpoints_or_says_malformed(
    raw_slices: list[Any], raw_pods: list[Any], config: KubernetesDiscovery
) -> None:
    reads: dict[str, SliceRead] = {}
    for index, obj in enumerate(raw_slices):
        try:
            reads[f"slice-{index}"] = parse_slice(obj, config, NS)
        except MalformedObject:
            continue
    pod_reads = {}
    for obj in raw_pods:
        try:
            pod_reads[object_name(obj, "Pod")] = read_pod(obj, config)
        except MalformedObject:
            continue
    views: dict[str, SliceView]
    if config.selector_on == "pods":
        views, _ = join_pods(reads, pod_reads, config, NS)
    else:
        views = {name: slice_members(read, config) for name, read in reads.items()}
    for name, view in views.items():
        for member in view.members:
            assert points_at_its_endpoint(member.config, reads[name]), (member.config.url, reads[name])
            assert member.config.model
    # What the fleet is given, from nothing and then from itself (the terminating ones stay then).
    first = desired_set(views, {})
    accepted_by_a_config_file([m.config for m in first.values()])
    again = desired_set(views, {m.config.id: m.config for view in views.values() for m in view.members})
    accepted_by_a_config_file([m.config for m in again.values()])
    assert all(replica_id == member.config.id for replica_id, member in again.items())
    assert set(first) <= set(again)


@settings(max_examples=150, deadline=None)
@given(
    mostly(
        st.fixed_dictionaries(
            {"items": mostly(st.lists(mostly(slices()), max_size=2))},
            optional={
                "metadata": mostly(
                    st.fixed_dictionaries({}, optional={"resourceVersion": mostly(st.sampled_from(["48213", ""]))})
                )
            },
        )
    )
)
def test_a_list_is_read_or_said_malformed(doc: Any) -> None:
    try:
        listed = read_list(doc, "EndpointSlice")
    except MalformedObject:
        return
    # Read: every item a named object, in order, and the version the list carries.
    assert [name for name, _ in listed.items] == [item["metadata"]["name"] for item in doc.get("items") or []]
    assert listed.version == doc["metadata"]["resourceVersion"]


@settings(max_examples=150, deadline=None)
@given(
    mostly(
        st.fixed_dictionaries(
            {"type": mostly(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]))},
            optional={"raw_object": mostly(slices())},
        )
    )
)
def test_a_watch_event_is_read_or_said_malformed(event: Any) -> None:
    try:
        read = read_event(event, "EndpointSlice")
    except MalformedObject:
        return
    names_one = read.type in ("ADDED", "MODIFIED", "DELETED")
    assert (read.name is not None) == names_one
    assert read.name is None or read.name == event["raw_object"]["metadata"]["name"]
