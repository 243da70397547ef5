"""A real `router serve` that discovers its replicas, one process or a supervisor and its workers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.control.discovery.harness import Pods, fleet_pod, model_slice, service_slice
from tests.control.discovery.recorded import NS, SELECTOR
from tests.support.clients import CHAT, samples
from tests.support.kube_api import Endpoint, FakeKubernetesApi
from tests.support.processes import Serve, held_socket
from tests.support.waiting import until

# A real `router serve`, one process or a supervisor and its workers --------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "selector_on"), [(1, "endpointslices"), (2, "endpointslices"), (2, "pods")])
async def test_router_serve_discovers_through_a_plain_http_kubeconfig_and_waits_for_the_first_list(
    serve: Serve, pods: Pods, tmp_path: Path, workers: int, selector_on: str
) -> None:
    """Not ready before the API answers; then the set, 409 on pushes, the gauge; with --workers one watch only."""
    kube = FakeKubernetesApi(bookmark_seconds=0.2)
    # Refused until the API listens, on this port: held by the test, never to be taken by another.
    api = held_socket()
    kube.port = api.getsockname()[1]
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
        # Real time: a while of the router asking an API that refuses, which it does on its own clock.
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

            async def only_a() -> bool:
                async with session.get(serve.admin_url + "/api/v1/endpoints") as resp:
                    return [r["id"] for r in (await resp.json())["replicas"]] == [f"{NS}/pod-a"]

            await until(only_a, timeout=15)
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
        api.close()


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
