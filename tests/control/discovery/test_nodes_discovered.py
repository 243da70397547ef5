"""Discovery gives replicas their node and fabric: the pod's spec.nodeName and `fabric_label`, or nodeName.

Against the fake Kubernetes API server, then read back as an operator
does: `/api/v1/replicas`, and `/api/v1/status`'s whole nodes per fabric.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.control.discovery.parse import MalformedObject, read_pod
from router.core.config.settings import KubernetesDiscovery
from tests.control.discovery.harness import Pods, StartDiscovery, expect, in_sync, model_slice, service_slice
from tests.control.discovery.recorded import NS
from tests.support.clients import get_json
from tests.support.kube_api import Endpoint, FakeKubernetesApi, pod
from tests.support.waiting import until

FABRIC = "router.llm/fabric"


def fleet_pod_on(e: Endpoint, node: str | None, fabric: str | None, gpus: str = "4") -> dict[str, Any]:
    labels = {"app.kubernetes.io/part-of": "llm-fleet", "router.llm/model": "m", "gpus": gpus}
    if fabric is not None:
        labels[FABRIC] = fabric
    return pod(e.pod, e.address, labels=labels, node=node)


async def placed(admin_url: str) -> dict[str, tuple[str | None, str | None]]:
    return {r["id"]: (r["node"], r["fabric"]) for r in await get_json(admin_url + "/api/v1/replicas")}


async def test_pods_mode_reads_each_pods_node_and_fabric_label_into_the_whole_nodes_per_fabric(
    kube: FakeKubernetesApi, pods: Pods, start_discovery: StartDiscovery
) -> None:
    server, _ = await start_discovery(selector_on="pods", labels_from=["gpus"], fabric_label=FABRIC)
    a, b, c = await pods.add("pod-a"), await pods.add("pod-b"), await pods.add("pod-c")
    kube.put(fleet_pod_on(a, "gpu-1", "ib-a"))
    kube.put(fleet_pod_on(b, "gpu-1", "ib-a"))
    # Not scheduled anywhere the API says, and no fabric label: unknown, counted apart.
    kube.put(fleet_pod_on(c, None, None, gpus="2"))
    kube.put(service_slice("engines", [a, b, c], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b), "c": ("m", c)}, pods.port))
    assert await placed(server.admin_url) == {
        f"{NS}/pod-a": ("gpu-1", "ib-a"),
        f"{NS}/pod-b": ("gpu-1", "ib-a"),
        f"{NS}/pod-c": (None, None),
    }
    doc = await get_json(server.admin_url + "/api/v1/status?idle_for=0")
    (fabric,) = doc["fabrics"]
    assert (fabric["fabric"], fabric["nodes"], fabric["gpus"]) == ("ib-a", 1, 8)
    # Never asked for: unknown, and unknown is never idle, so no whole node is free.
    assert fabric["free_nodes"] == [] and fabric["free_gpus"] == 0
    assert doc["no_node"] == {"replicas": 1, "gpus": 2}
    # A pod relabelled onto another fabric: its node is on two, said, and on neither.
    kube.put(fleet_pod_on(b, "gpu-1", "ib-b"))

    async def conflict() -> bool:
        status = await get_json(server.admin_url + "/api/v1/status?idle_for=0")
        return bool(status["node_conflicts"]) and status["fabrics"] == []

    await until(conflict, timeout=15, what="the node on two fabrics was never reported")
    doc = await get_json(server.admin_url + "/api/v1/status?idle_for=0")
    assert doc["node_conflicts"] == [
        {"node": "gpu-1", "fabrics": ["ib-a", "ib-b"], "replicas": [f"{NS}/pod-a", f"{NS}/pod-b"]}
    ]


async def test_the_default_mode_takes_each_endpoints_node_name_and_no_fabric(
    kube: FakeKubernetesApi, pods: Pods, start_discovery: StartDiscovery
) -> None:
    server, _ = await start_discovery(labels_from=["gpus"])
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    on_node = Endpoint(a.pod, a.address, node="gpu-7")
    kube.put(model_slice("llama", "m", [on_node, b], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    assert await placed(server.admin_url) == {f"{NS}/pod-a": ("gpu-7", None), f"{NS}/pod-b": (None, None)}
    doc = await get_json(server.admin_url + "/api/v1/status?idle_for=0")
    assert [(f["fabric"], f["nodes"]) for f in doc["fabrics"]] == [(None, 1)]
    assert doc["no_node"]["replicas"] == 1


def settings(**keys: Any) -> KubernetesDiscovery:
    return KubernetesDiscovery(selector="x", port="http", selector_on="pods", fabric_label=FABRIC, **keys)


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"metadata": {"name": "p"}, "spec": {"nodeName": 7}}, "Pod p: spec.nodeName is not a string"),
        ({"metadata": {"name": "p"}, "spec": []}, "Pod p: spec is not an object"),
        ({"metadata": {"name": "p", "labels": {FABRIC: ["a"]}}}, f"Pod p: label {FABRIC} is not a string"),
    ],
)
def test_a_pod_with_a_malformed_node_or_fabric_is_refused_naming_the_field(obj: Any, says: str) -> None:
    with pytest.raises(MalformedObject, match=says):
        read_pod(obj, settings())


def test_an_empty_node_name_or_fabric_label_is_unknown_not_a_name() -> None:
    read = read_pod({"metadata": {"name": "p", "labels": {FABRIC: ""}}, "spec": {"nodeName": ""}}, settings())
    assert (read.node, read.fabric) == (None, None)
