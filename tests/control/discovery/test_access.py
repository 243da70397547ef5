"""[discovery.kubernetes]'s settings, and where the Kubernetes API is found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.control.discovery.access import ApiAccess, resolve_access
from router.core.config.settings import KubernetesDiscovery, parse_config
from router.core.errors import ConfigError
from tests.control.discovery.recorded import SETTINGS
from tests.support.kube_api import FakeKubernetesApi

# Configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "key", "problem"),
    [
        ({"kubernetes": {"port": "http"}}, "discovery.kubernetes.selector", "is required"),
        ({"kubernetes": {"selector": "a=b"}}, "discovery.kubernetes.port", "is required"),
        ({"kubernetes": {"selector": "a=b", "port": 70000}}, "discovery.kubernetes.port", "1-65535"),
        ({"kubernetes": {"selector": "a=b", "port": "Http"}}, "discovery.kubernetes.port", "port name"),
        ({"kubernetes": {"selector": "a=b", "port": "p" * 64}}, "discovery.kubernetes.port", "port name"),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "namespace": "Bad_NS"}},
            "discovery.kubernetes.namespace",
            "namespace",
        ),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "labels_from": "gpu"}},
            "discovery.kubernetes.labels_from",
            "array",
        ),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "model_label": "a/b/c"}},
            "discovery.kubernetes.model_label",
            "label key",
        ),
        ({"kubernetes": {"selector": "a=b", "port": 1, "watch": True}}, "discovery.kubernetes.watch", "unknown key"),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "selector_on": "services"}},
            "discovery.kubernetes.selector_on",
            "must be 'endpointslices' or 'pods', got 'services'",
        ),
        (
            {"kubernetes": {"selector": "a=b", "port": 1, "selector_on": ["pods"]}},
            "discovery.kubernetes.selector_on",
            "must be a string",
        ),
        ({"consul": {}}, "discovery.consul", "unknown key"),
    ],
)
def test_discovery_config_mistakes_name_the_key(table: dict[str, Any], key: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^<test>: {key}: .*{problem}"):
        parse_config({"discovery": table}, "<test>", environ={})


def test_a_port_name_is_a_dns_label_of_up_to_63_characters_or_empty() -> None:
    """discovery/v1's EndpointPort.name: "" for a Service's one unnamed port, else a DNS label."""
    for name in ("", "p" * 63, "http-metrics-of-a-long-service-name"):
        config = parse_config({"discovery": {"kubernetes": {"selector": "a=b", "port": name}}}, "<test>", environ={})
        assert config.discovery is not None and config.discovery.port == name


def test_discovery_and_static_replicas_are_refused_together() -> None:
    raw = {
        "discovery": {"kubernetes": {"selector": "a=b", "port": 8000}},
        "replicas": [{"id": "r", "model": "m", "url": "http://127.0.0.1:1"}],
    }
    with pytest.raises(ConfigError, match=r"replicas: cannot be used with \[discovery\.kubernetes\]"):
        parse_config(raw, "<test>", environ={})


def test_the_api_is_found_in_cluster_then_kubeconfig_then_KUBECONFIG(tmp_path: Path) -> None:
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("t")
    (account / "namespace").write_text("models\n")
    in_cluster = resolve_access(SETTINGS, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, account)
    assert in_cluster == ApiAccess(kubeconfig=None, namespace="models")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(FakeKubernetesApi().kubeconfig(namespace="team-a"))
    from_env = resolve_access(SETTINGS, {"KUBECONFIG": f"{tmp_path / 'absent'}:{kubeconfig}"}, account)
    assert from_env == ApiAccess(kubeconfig=str(kubeconfig), namespace="team-a")
    pinned = KubernetesDiscovery(selector="a", port=1, namespace="other", kubeconfig=str(kubeconfig))
    assert resolve_access(pinned, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, account).namespace == "other"
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.kubeconfig: no such file"):
        resolve_access(KubernetesDiscovery(selector="a", port=1, kubeconfig=str(tmp_path / "nope")), {}, account)
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes: no Kubernetes API to ask"):
        resolve_access(SETTINGS, {"HOME": str(tmp_path)}, tmp_path / "no-account")
