"""The image running `router serve` as deploy/kubernetes/plain runs it, on a podman network with its replicas.

The router's container is the plain overlay's Deployment as rendered: image,
args (`--workers auto`), env (ROUTER_ADMIN_TOKEN from the Secret), ports,
probes, securityContext (a read-only root, user 65532, no capabilities),
the ConfigMap and the /tmp emptyDir, the 2-CPU and 1 GiB limits. Its
replicas are fake replicas in containers of their own, named as the
overlay's StatefulSet pods are (llama-0.vllm, short names), so
that its router.toml is used as shipped.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.deploy.balancer import Backend, Balancer
from tests.deploy.container.conftest import new_network
from tests.deploy.container.podman import Podman, Running, fake_replica, run_spec, wait_ready
from tests.support.manifests import container_of, named, render

# The fake replicas' answers: 40 tokens, 50 ms apart (2 s streams, long enough
# to be in flight when the router is told to stop).
TOKENS, TOKEN_DELAY = 40, 0.05


@dataclass
class Fleet:
    podman: Podman
    image: str
    network: str
    router: Running
    replicas: list[str]
    model: str
    docs: list[dict[str, Any]]


def start_replicas(podman: Podman, image: str, network: str, docs: list[dict[str, Any]]) -> tuple[list[str], str]:
    """One fake replica per pod of the StatefulSet, under the pod's DNS name, serving its model on its port."""
    statefulset = named(docs, "StatefulSet", "llama")
    container = container_of(docs, "llama", "StatefulSet")
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    model = container["args"][container["args"].index("--served-model-name") + 1]
    service = statefulset["spec"]["serviceName"]
    names = []
    for i in range(statefulset["spec"]["replicas"]):
        name = f"{network}-llama-{i}"
        # The short name router.toml writes, as the pod's DNS search domains resolve it in any namespace.
        alias = f"llama-{i}.{service}"
        podman(
            *("run", "--detach", "--pull", "never", "--name", name, "--network", network, "--network-alias", alias),
            *fake_replica(image, "--port", str(port), "--model", model),
            *("--tokens", str(TOKENS), "--token-delay", str(TOKEN_DELAY)),
        )
        names.append(name)
    return names, model


@pytest.fixture(scope="module")
def fleet(
    podman: Podman, image: str, secret_values: dict[tuple[str, str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    docs = render("plain")
    network = new_network(podman)
    try:
        replicas, model = start_replicas(podman, image, network, docs)
        router = run_spec(
            podman,
            docs,
            "router",
            name=f"{network}-router",
            network=network,
            secrets=secret_values,
            workdir=tmp_path_factory.mktemp("plain"),
        )
        wait_ready(podman, router)
        yield Fleet(podman, image, network, router, replicas, model, docs)
    finally:
        podman("network", "rm", "--force", network, check=False)


def get(url: str, token: str = "") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return int(resp.status), resp.read()


def chat(model: str, *, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}


def test_the_image_runs_the_compiled_build(fleet: Fleet) -> None:
    """Built on a base with a compiler, run on one without: the hot modules are the C extensions, and load."""
    said = fleet.podman("run", "--rm", "--pull", "never", fleet.image, "--version")
    assert said.stdout.strip().endswith("(compiled)"), said.stdout
    loaded = fleet.podman(
        *("run", "--rm", "--pull", "never", "--entrypoint", "/opt/router/bin/python", fleet.image),
        *("-c", "import router.http.server.reader as m, router.core.pool.pool as p; print(m.__file__, p.__file__)"),
    )
    assert all(path.endswith(".so") for path in loaded.stdout.split()), loaded.stdout


def test_the_probes_answer_as_the_kubelet_calls_them(fleet: Fleet) -> None:
    assert fleet.router.probe("readinessProbe") == 200
    assert fleet.router.probe("livenessProbe") == 200
    spec = fleet.router.container
    assert spec["readinessProbe"]["httpGet"]["port"] == spec["livenessProbe"]["httpGet"]["port"] == "admin"


def test_the_container_runs_as_the_manifest_says(fleet: Fleet) -> None:
    """A read-only root, user 65532, no capabilities, 2 CPUs and 1 GiB, as the podman arguments were derived."""
    info = fleet.podman.inspect(fleet.router.name)
    host = info["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert info["Config"]["User"] == "65532:65532"
    assert host["NanoCpus"] == 2_000_000_000
    assert host["Memory"] == 2**30
    assert set(host["CapDrop"]) >= {"CAP_NET_RAW", "CAP_CHOWN", "CAP_SETUID"} and not host["CapAdd"]


def test_a_request_goes_through_the_router_to_a_fake_replica_in_another_container(fleet: Fleet) -> None:
    """The alias of the overlay's model (llama) reaches a replica named as its StatefulSet pod, by DNS."""
    request = urllib.request.Request(
        fleet.router.url("http") + "/v1/chat/completions",
        data=json.dumps(chat("llama")).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["model"] == fleet.model
    assert answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "
    _, body = get(fleet.router.url("admin") + "/api/v1/replicas")
    served = {r["id"]: r["requests"] for r in json.loads(body)}
    assert set(served) == {"llama-0", "llama-1"} and sum(served.values()) >= 1


def test_metrics_are_served_on_the_admin_port_with_one_worker_per_cpu_of_the_limit(fleet: Fleet) -> None:
    """--workers auto under limits.cpu "2": two workers, one admin view, from a read-only root with /tmp an emptyDir."""
    status, body = get(fleet.router.url("admin") + "/metrics")
    text = body.decode()
    assert status == 200
    assert re.search(r"^router_workers 2\.0$", text, re.M), text[:2000]
    assert re.search(r'^router_replica_state\{model="llama-3.1-8b",replica="llama-0",state="ready"\} 1\.0$', text, re.M)
    assert fleet.router.container["resources"]["limits"]["cpu"] == "2"


def test_router_ctl_status_answers_from_a_third_container(fleet: Fleet) -> None:
    done = fleet.podman(
        *("run", "--rm", "--pull", "never", "--network", fleet.network, fleet.image),
        *("ctl", "status", "--server", f"{fleet.router.name}:9090"),
    )
    lines = done.stdout.splitlines()
    # The router names itself by its hostname, the container's (a pod's) name.
    assert lines[0].startswith(f"router {fleet.router.name}, watching since")
    header = next(i for i, line in enumerate(lines) if line.startswith("MODEL"))
    assert lines[header + 1].split()[:2] == [fleet.model, "2/2"]


def test_mutating_admin_calls_need_the_secret_s_token(fleet: Fleet) -> None:
    """ROUTER_ADMIN_TOKEN comes from the Secret router-admin: a drain without it is 401, with it 200."""
    url = fleet.router.url("admin") + "/api/v1/replicas/llama-1/state"
    body = json.dumps({"state": "ready"}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    refused.value.close()
    token = fleet.router.env["ROUTER_ADMIN_TOKEN"]
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


async def test_sigterm_lets_streams_in_flight_finish_and_exits_0_within_the_grace(
    fleet: Fleet, secret_values: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    """`podman stop` with terminationGracePeriodSeconds: SIGTERM, then SIGKILL (exit 137) only if the grace ran out."""
    router = run_spec(
        fleet.podman,
        fleet.docs,
        "router",
        name=f"{fleet.network}-stopped",
        network=fleet.network,
        secrets=secret_values,
        workdir=tmp_path,
    )
    wait_ready(fleet.podman, router)
    async with aiohttp.ClientSession() as session:
        responses = []
        for _ in range(6):
            resp = await session.post(
                router.url("http") + "/v1/chat/completions", json=chat("llama", stream=True, max_tokens=TOKENS)
            )
            assert resp.status == 200
            # The first event is through: the stream is in flight.
            assert (await resp.content.readline()).startswith(b"data: ")
            responses.append(resp)
        stopping = asyncio.create_task(
            asyncio.to_thread(fleet.podman, "stop", "--time", str(int(router.grace)), router.name, timeout=120)
        )
        bodies = [await resp.read() for resp in responses]
        await stopping
    assert all(body.rstrip().endswith(b"data: [DONE]") for body in bodies)
    state = fleet.podman.inspect(router.name)["State"]
    assert state["ExitCode"] == 0, fleet.podman.logs(router.name)


def test_without_its_tmp_volume_workers_say_what_they_need_and_exit_2(
    fleet: Fleet, secret_values: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    """The same spec less the /tmp emptyDir: one line naming TMPDIR, exit 2, not a traceback about listening."""
    (tmp,) = [m["name"] for m in fleet.router.container["volumeMounts"] if m["mountPath"] == "/tmp"]
    router = run_spec(
        fleet.podman,
        fleet.docs,
        "router",
        name=f"{fleet.network}-no-tmp",
        network=fleet.network,
        secrets=secret_values,
        workdir=tmp_path,
        drop_volumes=(tmp,),
    )
    assert fleet.podman.wait(router.name, timeout=60) == 2
    (line,) = fleet.podman.logs(router.name).strip().splitlines()
    assert line.startswith("router: --workers needs a writable directory for its workers' sockets and state")
    assert "set TMPDIR" in line


async def test_a_rolling_update_drops_nothing_for_a_client_pool(
    fleet: Fleet, secret_values: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    """Two router pods of the spec behind a Service-like balancer (probes /readyz, takes a failing pod out a
    second late); `podman stop` one, as the kubelet stops a pod in a rollout: a pool of streaming clients
    sees no error, and the stopped router exits 0 after its shutdown_delay_seconds."""
    routers = [
        run_spec(
            fleet.podman,
            fleet.docs,
            "router",
            name=f"{fleet.network}-rolling-{which}",
            network=fleet.network,
            secrets=secret_values,
            workdir=tmp_path,
        )
        for which in ("a", "b")
    ]
    for router in routers:
        wait_ready(fleet.podman, router)
    a, b = routers
    balancer = Balancer([Backend(r.url("http"), r.url("admin") + "/readyz") for r in routers])
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        probing = asyncio.create_task(balancer.probe(stop))
        pool = [asyncio.create_task(balancer.client(session, chat("llama", max_tokens=8), stop)) for _ in range(6)]
        # Real time: traffic through both routers before one is replaced, and after.
        await asyncio.sleep(2.0)
        before = balancer.sent_to[a.url("http")]
        await asyncio.to_thread(fleet.podman, "stop", "--time", str(int(a.grace)), a.name, timeout=120)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(probing, *pool)
    assert fleet.podman.inspect(a.name)["State"]["ExitCode"] == 0, fleet.podman.logs(a.name)
    assert "serving on for 5s" in fleet.podman.logs(a.name)
    assert before > 0 and balancer.sent_to[b.url("http")] > 0
    assert set(balancer.outcomes) == {"ok"}, balancer.outcomes
    fleet.podman("rm", "--force", b.name, check=False)
