"""deploy/kubernetes as a cluster admin applies it: what each engine serves, and what runs in a shared namespace."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from router.core.config.settings import load_config
from tests.support.manifests import KUBERNETES, OVERLAYS, of_kind, render, router_toml

Doc = dict[str, Any]


def engines(docs: list[Doc]) -> list[Doc]:
    """The vLLM pod templates of an overlay (Deployments and StatefulSets): those with a container named vllm."""
    return [
        doc["spec"]["template"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
        and any(c["name"] == "vllm" for c in doc["spec"]["template"]["spec"]["containers"])
    ]


def served_name(container: Doc) -> str:
    args = [str(a) for a in container.get("args", [])] + [str(a) for a in container.get("command", [])]
    assert "--served-model-name" in args, f"{container['name']} starts vLLM without --served-model-name"
    return args[args.index("--served-model-name") + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_serves_the_name_the_router_sends_it(overlay: str, tmp_path: Path) -> None:
    """Without --served-model-name vLLM serves the weights' path and answers every routed request 404."""
    docs = render(overlay)
    path = tmp_path / "router.toml"
    path.write_text(router_toml(docs))
    config = load_config(path, environ={})
    sent = {r.model for r in config.replicas} | set(config.models)
    templates = engines(docs)
    assert templates
    for template in templates:
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "vllm"]
        name = served_name(container)
        assert name in sent, f"{overlay}: vLLM serves {name}, the router sends {sorted(sent)}"
        if config.discovery is not None:
            # Discovery names a replica's model by its label: the name vLLM must serve.
            assert template["metadata"]["labels"][config.discovery.model_label] == name


def strings(value: object) -> list[str]:
    """Every string in an object, however deep."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def scaler_addresses(docs: list[Doc]) -> set[str]:
    return {
        trigger["metadata"]["scalerAddress"]
        for doc in docs
        if doc["kind"] == "ScaledObject"
        for trigger in doc["spec"]["triggers"]
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_namespace_is_written_so_apply_n_namespace_works(overlay: str) -> None:
    """`kubectl apply -k OVERLAY -n llm`: no object names a namespace, and no URL or flag does either.

    Short Service names resolve in the namespace the pod runs in. The one
    exception is KEDA's scalerAddress, dialled from KEDA's own namespace.
    """
    docs = render(overlay)
    for doc in docs:
        assert "namespace" not in doc["metadata"], f"{doc['kind']} {doc['metadata']['name']} names a namespace"
        for subject in doc.get("subjects", []):
            assert "namespace" not in subject
    exempt = scaler_addresses(docs)
    written = [s for doc in docs for s in strings(doc) if s not in exempt]
    assert not [s for s in written if ".svc" in s or ".default" in s or "default.svc" in s]
    assert all(".svc.cluster.local" in address for address in exempt)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_routers_survive_a_node_drain_one_at_a_time(overlay: str) -> None:
    docs = render(overlay)
    router = next(d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == "router")
    labels = router["spec"]["template"]["metadata"]["labels"]
    (budget,) = of_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1 and router["spec"]["replicas"] >= 2
    (spread,) = router["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_admin_port_is_open_only_to_pods_and_namespaces_let_through(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    router = next(d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == "router")
    (policy,) = of_kind(docs, "NetworkPolicy")
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    )
    rules = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    # Clients from anywhere; the admin port only from what is labelled for it.
    assert rules["http"] is None
    allowed = rules["admin"]
    assert allowed == [
        {"podSelector": {"matchLabels": {"router.llm/admin-client": "true"}}},
        {"namespaceSelector": {"matchLabels": {"router.llm/admin-client": "true"}}},
    ]
    # router scaler polls every router's admin port: it is let through.
    for scaler in (d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == "router-scaler"):
        assert scaler["spec"]["template"]["metadata"]["labels"]["router.llm/admin-client"] == "true"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_pods_that_read_the_api_server_get_a_token(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    path = tmp_path / "router.toml"
    path.write_text(router_toml(docs))
    discovery = load_config(path, environ={}).discovery is not None
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        reads_api = doc["metadata"]["name"] == "router" and discovery
        assert pod.get("automountServiceAccountToken") is reads_api, doc["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_example_vllm_starts_slowly_is_sized_and_caches_its_weights(overlay: str) -> None:
    docs = render(overlay)
    claims = {c["metadata"]["name"] for c in of_kind(docs, "PersistentVolumeClaim")}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        vllm = [c for c in pod["containers"] if c["name"] == "vllm"]
        if not vllm:
            continue
        (container,) = vllm
        # Minutes to load: the startup probe covers them, the others start after it.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        # One slow answer under load does not take it out of rotation.
        ready = container["readinessProbe"]
        assert ready["failureThreshold"] >= 2 and ready["timeoutSeconds"] >= 2
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "nvidia.com/gpu" in resources["limits"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model-cache"]
        assert mount["mountPath"] == "/root/.cache/huggingface"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        if "model-cache" in templates:
            continue  # the StatefulSet's own claim per pod
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_discovered_vllm_waits_for_the_routers_to_see_it_go(overlay: str, tmp_path: Path) -> None:
    """preStop where it belongs: on the engines the routers discover, which learn of a terminating pod from its
    EndpointSlice a moment later and drain it; vLLM itself exits at SIGTERM. (The plain overlay's routers list
    their replicas and learn nothing from a pod's end.)"""
    docs = render(overlay)
    path = tmp_path / "router.toml"
    path.write_text(router_toml(docs))
    if load_config(path, environ={}).discovery is None:
        pytest.skip("the plain overlay's routers do not watch the pods")
    for template in engines(docs):
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "vllm"]
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5
        assert template["spec"]["terminationGracePeriodSeconds"] > container["lifecycle"]["preStop"]["sleep"]["seconds"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_tolerates_one_slow_probe_and_outwaits_the_delay_and_the_grace(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    router = next(d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == "router")
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ready = container["readinessProbe"]
    path = tmp_path / "router.toml"
    path.write_text(router_toml(docs))
    config = load_config(path, environ={})
    assert ready["failureThreshold"] >= 2 and ready["timeoutSeconds"] >= 2
    # Out of the Service within the delay, while it still serves.
    assert ready["periodSeconds"] * ready["failureThreshold"] < config.shutdown_delay_seconds
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_delay_seconds + config.shutdown_grace_seconds
    # The delay is the router's own: no preStop hook.
    assert "lifecycle" not in container


def test_the_podmonitor_scrapes_every_router_pod_s_admin_port() -> None:
    (monitor,) = render(KUBERNETES / "monitoring")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    router = next(d for d in of_kind(render("plain"), "Deployment") if d["metadata"]["name"] == "router")
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "admin" and endpoint["path"] == "/metrics"
    assert "admin" in {p["name"] for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]}


def test_the_keda_overlay_in_another_namespace_needs_its_one_line_edit_and_only_that(tmp_path: Path) -> None:
    """docs/kubernetes.md's sed, run as written in a copy of the tree: KEDA's address names llm, all else as is."""

    docs_text = (KUBERNETES.parents[1] / "docs" / "kubernetes.md").read_text()
    (edit,) = re.findall(r"^sed -i .*scaledobject\.yaml$", docs_text, re.MULTILINE)
    assert edit in (KUBERNETES / "keda" / "scaledobject.yaml").read_text()  # the overlay says the same line
    shutil.copytree(KUBERNETES, tmp_path / "deploy" / "kubernetes")
    done = subprocess.run(["bash", "-c", edit], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    before, after = render("keda"), render(tmp_path / "deploy" / "kubernetes" / "keda")
    assert scaler_addresses(before) == {"router-scaler.default.svc.cluster.local:9091"}
    assert scaler_addresses(after) == {"router-scaler.llm.svc.cluster.local:9091"}
    for doc in after:
        for trigger in doc["spec"].get("triggers", []) if doc["kind"] == "ScaledObject" else []:
            trigger["metadata"]["scalerAddress"] = "router-scaler.default.svc.cluster.local:9091"
    assert after == before
    # Still no object names a namespace: `-n llm` puts them all there.
    assert not [d for d in after if "namespace" in d["metadata"]]
