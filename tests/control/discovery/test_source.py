"""Kubernetes discovery against a fake API server (kube_api.py), through every fault of the watch.

After each fault: the router's set equals the API server's, no request
reaches a replica after the router removed it, and nothing stays in flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import aiohttp
import orjson
import pytest

from router.control.discovery.source import KubernetesSource
from router.core.pool.replicas import ReplicaState
from router.run.app import RouterServer
from router.tools.fake import Behaviour
from tests.control.discovery.conftest import SourceClock
from tests.control.discovery.harness import (
    Pods,
    StartDiscovery,
    cut,
    delivered,
    expect,
    in_sync,
    model_slice,
    router_set,
    settled,
    traffic,
)
from tests.control.discovery.recorded import NS
from tests.support.clients import CHAT, post_cut, samples, scrape
from tests.support.kube_api import Endpoint, FakeKubernetesApi
from tests.support.waiting import wait_for


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


async def test_the_watch_closed_every_eighth_step_during_a_churn_of_200_pods(
    kube: FakeKubernetesApi, pods: Pods, discovery: tuple[RouterServer, KubernetesSource]
) -> None:
    server, source = discovery
    endpoints = [await pods.add(f"pod-{i:03d}") for i in range(200)]

    rng = random.Random(17)
    live: dict[str, Endpoint] = {}
    deadline = time.monotonic() + 20
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
        # The watch ends every eighth step (as the API server ends one at its timeout), mid-churn.
        await (cut(kube) if step % 8 == 7 else delivered(kube))
        assert time.monotonic() < deadline
    await cut(kube)  # one more with the churn over
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
    source_clock: SourceClock,
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
    # The source has found the API gone (its view is stale from then on).
    await wait_for(lambda: source.stale_seconds() > 0)
    stale: list[float] = []
    # Down for 6 s of the source's clock, half a second at a time; traffic goes on at each step.
    for _ in range(12):
        await traffic(server, ["m"], n=2)
        assert router_set(server) == wanted
        async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/readyz") as r:
            assert r.status == 200
        stale.append(samples(await scrape(server), "router_discovery_stale_seconds")[()])
        source_clock.advance(0.5)
    # Its next attempt, past report_every on its clock, says so again.
    await wait_for(lambda: any("still cannot read" in r.getMessage() for r in caplog.records))
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


async def test_a_slice_whose_address_is_no_address_keeps_the_set_and_names_the_field(
    kube: FakeKubernetesApi,
    pods: Pods,
    discovery: tuple[RouterServer, KubernetesSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An endpoint address with a path in it would route to another port and path: the slice is read as the API
    unreadable (set kept and served, an error counted, the field named in the log) until it is fixed."""
    server, source = discovery
    a, b = await pods.add("pod-a"), await pods.add("pod-b")
    kube.put(model_slice("llama", "m", [a], pods.port))
    wanted = expect({"a": ("m", a)}, pods.port)
    await in_sync(server, wanted)
    caplog.set_level(logging.WARNING, "router.control.discovery")
    bad = model_slice("llama", "m", [a, b], pods.port)
    bad["endpoints"][1]["addresses"] = [f"{b.address}/admin"]
    kube.put(bad)
    await wait_for(lambda: "endpoints[1].addresses[0]" in caplog.text)
    assert f"'{b.address}/admin' is not an IPv4 address or a host name" in caplog.text
    assert router_set(server) == wanted
    # Counted as the next cycle begins, after the backoff.
    await wait_for(lambda: source.relists["error"] >= 1 and source.stale_seconds() > 0)
    assert router_set(server) == wanted
    await traffic(server, ["m"])
    # Fixed: the set follows and is current again.
    kube.put(model_slice("llama", "m", [a, b], pods.port))
    await in_sync(server, expect({"a": ("m", a), "b": ("m", b)}, pods.port))
    await wait_for(lambda: source.stale_seconds() == 0.0)
    await settled(server, pods, [], ["m"])
