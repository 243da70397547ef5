"""selector_on = "pods": the selector picks pods; the namespace's slices say which serve.

The same checks after each fault, and the router's set is compared with one
computed from the fake's own objects (`harness.api_says`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import aiohttp
import orjson
import pytest

from router.control.discovery.source import KubernetesSource
from router.run.app import RouterServer
from tests.control.discovery.conftest import SourceClock
from tests.control.discovery.harness import (
    Pods,
    StartDiscovery,
    api_says,
    caught_up,
    cut,
    delivered,
    expect,
    fleet_pod,
    in_sync,
    router_set,
    service_slice,
    settled,
    traffic,
)
from tests.control.discovery.recorded import NS
from tests.support.clients import get_json, run_ctl, samples, scrape
from tests.support.kube_api import Endpoint, FakeKubernetesApi, endpoint_slice, pod
from tests.support.waiting import until, wait_for


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
    """Pods join, leave, change model and stop matching while the pod watch is closed every fifth step."""
    # Slice watches that outlast the test: only the pod watch is cut, and only it relists.
    server, source = await start_discovery(selector_on="pods", watch_seconds=300.0)
    endpoints = [await pods.add(f"pod-{i:02d}") for i in range(60)]
    await wait_for(source.ready)

    rng = random.Random(1717)
    in_slice: dict[str, Endpoint] = {}
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
        # The pod watch ends every fifth step (as the API server ends one at its timeout), mid-churn.
        await (cut(kube, "Pod") if step % 5 == 4 else delivered(kube))
    await cut(kube, "Pod")  # one more with the churn over
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
    source_clock: SourceClock,
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
    # The source has found the API gone (its view is stale from then on).
    await wait_for(lambda: source.stale_seconds() > 0)
    stale: list[float] = []
    # Down for 3 s of the source's clock, 0.3 s at a time; traffic goes on at each step.
    for _ in range(10):
        await traffic(server, ["m"], n=2)
        assert router_set(server) == wanted
        async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as r:
            assert r.status == 200
        stale.append(samples(await scrape(server), "router_discovery_stale_seconds")[()])
        source_clock.advance(0.3)

    async def both_retried() -> bool:
        relists = samples(await scrape(server), "router_discovery_relists_total")
        return all(
            relists.get((("reason", "error"), ("resource", kind)), 0) >= 1 for kind in ("pods", "endpointslices")
        )

    # Each watch has failed, said so, and begun its next attempt.
    await until(both_retried)
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
