"""deploy/kubernetes/keda: the routers, the scaler, a ScaledObject per model, the vLLM Deployment it scales.

Rendered by kustomize and checked offline like the rest of deploy/: the
Kubernetes kinds with kubernetes-validate, the ScaledObject against a
schema of KEDA's fields (scaledobject.schema.json beside this file;
kubernetes-validate knows no CRD), and the pieces against each other and
against the scaler's own command line and metadata rules.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.core.config.settings import load_config, parse_config
from router.scaler.main import build_parser, settings_from
from router.scaler.view import parse_metadata
from tests.support.kube_api import matches
from tests.support.manifests import named, of_kind, render, router_toml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((Path(__file__).resolve().parent / "scaledobject.schema.json").read_text())


def documents() -> list[dict[str, Any]]:
    return render("keda")


def kind(name: str) -> list[dict[str, Any]]:
    return of_kind(documents(), name)


def by_name(name: str, kind_: str) -> dict[str, Any]:
    return named(documents(), kind_, name)


def test_the_kubernetes_kinds_validate_strictly() -> None:
    checked = 0
    for doc in documents():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
        checked += 1
    # Three Deployments, four Services, the ConfigMap, the ServiceAccount, Role and RoleBinding, the
    # routers' PodDisruptionBudget and NetworkPolicy, and the model cache's PersistentVolumeClaim.
    assert checked == 14


def test_every_scaled_object_matches_keda_s_fields() -> None:
    objects = kind("ScaledObject")
    assert objects
    for doc in objects:
        jsonschema.validate(doc, SCHEMA)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d["spec"]["triggers"][0].update(type="external-pull"), "external-pull"),
        (lambda d: d["spec"].update(minReplicaCount=-1), "-1"),
        (lambda d: d["spec"].update(cooldown=300), "cooldown"),
        (lambda d: d["spec"]["triggers"][0]["metadata"].pop("scalerAddress"), "scalerAddress"),
        (lambda d: d["spec"]["triggers"][0]["metadata"].update(idleAfter=600), "600"),
    ],
)
def test_the_schema_refuses_what_keda_would(change: Any, problem: str) -> None:
    (doc,) = kind("ScaledObject")
    doc = json.loads(json.dumps(doc))
    change(doc)
    with pytest.raises(jsonschema.ValidationError, match=problem):
        jsonschema.validate(doc, SCHEMA)


def test_the_scaled_object_scales_the_vllm_deployment_from_zero_with_the_push_trigger() -> None:
    (scaled,) = kind("ScaledObject")
    spec = scaled["spec"]
    target = by_name(spec["scaleTargetRef"]["name"], "Deployment")
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1 and spec["cooldownPeriod"] > 0
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "external-push"
    query = parse_metadata(trigger["metadata"])
    # The model KEDA asks about is the one the pods serve, under the name the routers know.
    args = target["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-name") + 1] == query.model
    assert target["spec"]["template"]["metadata"]["labels"]["router.llm/model"] == query.model
    assert target["spec"]["replicas"] == 0
    # scalerAddress is the scaler's Service, gRPC port.
    host, port = trigger["metadata"]["scalerAddress"].rsplit(":", 1)
    service = by_name("router-scaler", "Service")
    assert host.split(".")[0] == service["metadata"]["name"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"] == int(port)


def test_the_scaler_deployment_runs_router_scaler_with_ports_and_probes_that_match() -> None:
    deployment = by_name("router-scaler", "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "scaler"
    settings = settings_from(build_parser().parse_args(args[1:]), {"ROUTER_ADMIN_TOKEN": "t"})
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": settings.listen.port, "http": settings.http_listen.port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert {e["name"] for e in container["env"]} == {"ROUTER_ADMIN_TOKEN"}
    # Every router pod through the headless admin Service, the one Prometheus scrapes too.
    assert settings.servers_from_dns is not None
    (headless,) = [s for s in kind("Service") if s["spec"].get("clusterIP") == "None"]
    assert settings.servers_from_dns.host.split(".")[0] == headless["metadata"]["name"]
    assert settings.servers_from_dns.port == headless["spec"]["ports"][0]["port"]
    service = by_name("router-scaler", "Service")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "http"}


def test_the_documented_router_settings_for_the_loop_are_valid_and_point_at_the_scaler() -> None:
    readme = (ROOT / "docs" / "kubernetes.md").read_text()
    section = readme.split("## Scale to zero on Kubernetes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, re.S)
    router_block = next(b for b in blocks if b.startswith("wake_url"))
    config = parse_config(tomllib.loads(router_block), "docs/kubernetes.md", environ={})
    service = by_name("router-scaler", "Service")
    http_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"]
    # The Service's short name: it resolves in whatever namespace the overlay is applied to.
    assert config.wake_url == f"http://{service['metadata']['name']}:{http_port}/wake"
    (scaled,) = kind("ScaledObject")
    model = scaled["spec"]["triggers"][0]["metadata"]["model"]
    assert config.models[model].cold_start_seconds > 0


def test_the_routers_hold_requests_for_the_scaled_model_and_wake_the_scaler(tmp_path: Path) -> None:
    """The overlay's router.toml: requests held (cold_start_seconds, max_held) and wake_url at the scaler's /wake."""
    path = tmp_path / "router.toml"
    path.write_text(router_toml(documents()))
    config = load_config(path, environ={})
    service = by_name("router-scaler", "Service")
    http_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"]
    # The Service's short name: it resolves in whatever namespace the overlay is applied to.
    assert config.wake_url == f"http://{service['metadata']['name']}:{http_port}/wake"
    (scaled,) = kind("ScaledObject")
    model = config.models[scaled["spec"]["triggers"][0]["metadata"]["model"]]
    (vllm,) = by_name(scaled["spec"]["scaleTargetRef"]["name"], "Deployment")["spec"]["template"]["spec"]["containers"]
    # Held at least as long as the engine may take to start answering.
    startup = vllm["startupProbe"]
    assert model.cold_start_seconds >= startup["periodSeconds"] * startup["failureThreshold"]
    assert model.max_held > 0


def test_routers_with_discovery_find_the_scaled_pods_through_their_service(tmp_path: Path) -> None:
    """The pods KEDA starts reach the routers with no push: the routers' selector finds their Service."""
    path = tmp_path / "router.toml"
    path.write_text(router_toml(documents()))
    discovery = load_config(path, environ={}).discovery
    assert discovery is not None
    pod = by_name("router", "Deployment")["spec"]["template"]["spec"]
    (account,) = kind("ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (scaled,) = kind("ScaledObject")
    model = scaled["spec"]["triggers"][0]["metadata"]["model"]
    target = by_name(scaled["spec"]["scaleTargetRef"]["name"], "Deployment")["spec"]["template"]
    (service,) = [s for s in kind("Service") if not s["metadata"]["name"].startswith("router")]
    # Kubernetes copies a Service's labels onto its EndpointSlices: these are what the routers select.
    labels = service["metadata"]["labels"]
    assert matches(discovery.selector, labels)
    assert labels[discovery.model_label] == model
    assert [p["name"] for p in service["spec"]["ports"]] == [discovery.port]
    assert service["spec"]["selector"].items() <= target["metadata"]["labels"].items()
    (container,) = target["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == [service["spec"]["ports"][0]["targetPort"]]
    assert "readinessProbe" in container


def test_prometheus_scrapes_the_scaler_s_http_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "router-scaler"]
    (target,) = [t for group in job["static_configs"] for t in group["targets"]]
    host, port = target.rsplit(":", 1)
    service = by_name("router-scaler", "Service")
    assert host.split(".")[0] == service["metadata"]["name"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"] == int(port)
    # /metrics is the default path: the scaler serves it there.
    assert job.get("metrics_path", "/metrics") == "/metrics"
