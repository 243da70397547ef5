"""deploy/kubernetes/discovery: RBAC, the router using it, a model labelled for discovery; checked offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from router.core.config import load_config
from router.run.cli import build_parser
from tests.control.discovery.kube_api import matches
from tests.test_deploy import documents

DISCOVERY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "discovery"
MANIFESTS = sorted(DISCOVERY.glob("*.yaml"))
# Applied only with selector_on = "pods": the RBAC to read Pods.
POD_MANIFESTS = sorted((DISCOVERY / "pods").glob("*.yaml"))


@pytest.mark.parametrize(
    "path", MANIFESTS + POD_MANIFESTS, ids=[str(p.relative_to(DISCOVERY)) for p in MANIFESTS + POD_MANIFESTS]
)
def test_discovery_manifests_validate_strictly(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)


def by_kind() -> dict[str, dict[str, dict[str, Any]]]:
    kinds: dict[str, dict[str, dict[str, Any]]] = {}
    for path in MANIFESTS:
        for doc in documents(path):
            kinds.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    return kinds


def test_the_router_reads_endpointslices_with_list_and_watch_only(tmp_path: Path) -> None:
    kinds = by_kind()
    (role,) = kinds["Role"].values()
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    ]
    (binding,) = kinds["RoleBinding"].values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (account,) = kinds["ServiceAccount"].values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    pod = kinds["Deployment"]["router"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (container,) = pod["containers"]
    assert build_parser().parse_args(container["args"]).command == "serve"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    (configmap,) = kinds["ConfigMap"].values()
    assert pod["volumes"][0]["configMap"]["name"] == configmap["metadata"]["name"]
    path = tmp_path / "router.toml"
    path.write_text(configmap["data"]["router.toml"])
    config = load_config(path, environ={})
    assert config.discovery is not None and config.replicas == ()


def test_the_model_service_is_selected_and_selects_the_vllm_pods(tmp_path: Path) -> None:
    kinds = by_kind()
    (configmap,) = kinds["ConfigMap"].values()
    path = tmp_path / "router.toml"
    path.write_text(configmap["data"]["router.toml"])
    discovery = load_config(path, environ={}).discovery
    assert discovery is not None
    (service,) = kinds["Service"].values()
    # Kubernetes copies the Service's labels onto its EndpointSlices: these are what the router matches.
    labels = service["metadata"]["labels"]
    assert matches(discovery.selector, labels)
    assert labels[discovery.model_label] == "llama-3.1-8b"
    assert set(discovery.labels_from) <= set(labels)
    assert [p["name"] for p in service["spec"]["ports"]] == [discovery.port]
    engine = kinds["Deployment"]["vllm-llama-3-1-8b"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= engine["metadata"]["labels"].items()
    (container,) = engine["spec"]["containers"]
    assert "readinessProbe" in container
    assert [p["name"] for p in container["ports"]] == [service["spec"]["ports"][0]["targetPort"]]


def test_the_pods_mode_rbac_adds_list_and_watch_on_pods_for_the_same_account() -> None:
    (account,) = by_kind()["ServiceAccount"].values()
    (path,) = POD_MANIFESTS
    kinds: dict[str, list[dict[str, Any]]] = {}
    for doc in documents(path):
        kinds.setdefault(doc["kind"], []).append(doc)
    assert set(kinds) == {"Role", "RoleBinding"}
    (role,) = kinds["Role"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    (binding,) = kinds["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    # Not granted by the default mode's RBAC: a router of that mode reads no pod.
    (default_role,) = by_kind()["Role"].values()
    assert all("pods" not in rule["resources"] for rule in default_role["rules"])


def test_the_model_pods_are_labelled_for_pods_mode_too(tmp_path: Path) -> None:
    """With selector_on = "pods" the same selector picks the vLLM pods, which name their model and GPUs."""
    (configmap,) = by_kind()["ConfigMap"].values()
    path = tmp_path / "router.toml"
    path.write_text(configmap["data"]["router.toml"].replace('selector_on = "endpointslices"', 'selector_on = "pods"'))
    discovery = load_config(path, environ={}).discovery
    assert discovery is not None and discovery.selector_on == "pods"
    labels = by_kind()["Deployment"]["vllm-llama-3-1-8b"]["spec"]["template"]["metadata"]["labels"]
    assert matches(discovery.selector, labels)
    assert labels[discovery.model_label] == "llama-3.1-8b"
    assert set(discovery.labels_from) | {"gpus"} <= set(labels)
    assert labels["gpus"].isdigit()
