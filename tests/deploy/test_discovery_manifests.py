"""deploy/kubernetes/discovery: RBAC, the router using it, a model labelled for discovery; rendered offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.core.config.settings import load_config
from router.run.cli import build_parser
from tests.support.kube_api import matches
from tests.support.manifests import container_of, named, of_kind, pod_of, pods_mode_overlay, render, router_toml


def discovery_settings(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return load_config(path, environ={})


def test_the_router_reads_endpointslices_with_list_and_watch_only(tmp_path: Path) -> None:
    docs = render("discovery")
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    ]
    (binding,) = of_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (account,) = of_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    pod = pod_of(docs, "Deployment", "router")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    container = container_of(docs, "router")
    assert build_parser().parse_args(container["args"]).command == "serve"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    config = discovery_settings(tmp_path, router_toml(docs))
    assert config.discovery is not None and config.replicas == ()


def test_the_model_service_is_selected_and_selects_the_vllm_pods(tmp_path: Path) -> None:
    docs = render("discovery")
    discovery = discovery_settings(tmp_path, router_toml(docs)).discovery
    assert discovery is not None
    (service,) = [s for s in of_kind(docs, "Service") if not s["metadata"]["name"].startswith("router")]
    # Kubernetes copies the Service's labels onto its EndpointSlices: these are what the router matches.
    labels = service["metadata"]["labels"]
    assert matches(discovery.selector, labels)
    assert labels[discovery.model_label] == "llama-3.1-8b"
    assert set(discovery.labels_from) <= set(labels)
    assert [p["name"] for p in service["spec"]["ports"]] == [discovery.port]
    engine = named(docs, "Deployment", "vllm-llama-3-1-8b")["spec"]["template"]
    assert service["spec"]["selector"].items() <= engine["metadata"]["labels"].items()
    (container,) = engine["spec"]["containers"]
    assert "readinessProbe" in container
    assert [p["name"] for p in container["ports"]] == [service["spec"]["ports"][0]["targetPort"]]


def pods_mode(tmp_path: Path) -> list[dict[str, Any]]:
    """The discovery overlay with ../rbac/discovery-pods added, as its kustomization.yaml says to."""
    return render(pods_mode_overlay(tmp_path / "pods-mode"))


def test_the_pods_mode_rbac_adds_list_and_watch_on_pods_for_the_same_account(tmp_path: Path) -> None:
    docs = pods_mode(tmp_path)
    (account,) = of_kind(docs, "ServiceAccount")
    roles = {r["metadata"]["name"]: r for r in of_kind(docs, "Role")}
    role = roles["router-discovery-pods"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = named(docs, "RoleBinding", "router-discovery-pods")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "router-discovery-pods",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    # Not granted by the default mode's RBAC: a router of that mode reads no pod.
    (default_role,) = of_kind(render("discovery"), "Role")
    assert all("pods" not in rule["resources"] for rule in default_role["rules"])


def test_the_model_pods_are_labelled_for_pods_mode_too(tmp_path: Path) -> None:
    """With selector_on = "pods" the same selector picks the vLLM pods, which name their model and GPUs."""
    docs = render("discovery")
    text = router_toml(docs).replace('selector_on = "endpointslices"', 'selector_on = "pods"')
    discovery = discovery_settings(tmp_path, text).discovery
    assert discovery is not None and discovery.selector_on == "pods"
    labels = named(docs, "Deployment", "vllm-llama-3-1-8b")["spec"]["template"]["metadata"]["labels"]
    assert matches(discovery.selector, labels)
    assert labels[discovery.model_label] == "llama-3.1-8b"
    assert set(discovery.labels_from) | {"gpus"} <= set(labels)
    assert labels["gpus"].isdigit()
