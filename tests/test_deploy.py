"""deploy/ holds what it takes to run the router for real; each piece is checked offline."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from router.core.config import load_config
from router.run.cli import build_parser
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.helpers import scrape

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_kubernetes_manifests_validate_strictly(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)


def manifests_by_kind() -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for path in MANIFESTS:
        for doc in documents(path):
            kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def test_the_configmap_holds_a_valid_router_config(tmp_path: Path) -> None:
    (configmap,) = manifests_by_kind()["ConfigMap"]
    path = tmp_path / "router.toml"
    path.write_text(configmap["data"]["router.toml"])
    config = load_config(path, environ={})
    assert config.admin_listen.port == 9090
    assert config.listen.port == 8080


def test_the_deployment_probes_the_admin_port_and_outwaits_the_grace(tmp_path: Path) -> None:
    kinds = manifests_by_kind()
    (deployment,) = kinds["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (configmap,) = kinds["ConfigMap"]
    path = tmp_path / "router.toml"
    path.write_text(configmap["data"]["router.toml"])
    config = load_config(path, environ={})
    assert ports == {"http": config.listen.port, "admin": config.admin_listen.port}
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_grace_seconds
    assert build_parser().parse_args(container["args"]).command == "serve"
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    assert [p["targetPort"] for p in services["router"]["spec"]["ports"]] == ["http"]
    assert services["router-admin"]["spec"]["clusterIP"] == "None"


def test_the_systemd_unit_runs_serve_and_reloads_with_sighup() -> None:
    unit = (DEPLOY / "systemd" / "router.service").read_text()
    exec_start = re.search(r"^ExecStart=(.+)$", unit, re.MULTILINE)
    assert exec_start is not None
    argv = shlex.split(exec_start.group(1))
    assert argv[0].endswith("/router")
    assert build_parser().parse_args(argv[1:]).command == "serve"
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit
    timeout = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)
    assert timeout is not None and int(timeout.group(1)) > 30


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    return found


def test_alerting_rules_and_scrape_config_pass_promtool() -> None:
    tool = promtool()
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        result = subprocess.run(
            [tool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


async def test_the_alerts_use_only_metrics_the_router_exports(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], usage_push_url="http://127.0.0.1:1/usage")
    exported = set(re.findall(r"^# TYPE (\S+) (\S+)", await scrape(server), re.MULTILINE))
    names = {name for name, _ in exported} | {f"{name}_total" for name, kind in exported if kind == "counter"}
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    used = {
        metric
        for group in rules["groups"]
        for rule in group["rules"]
        for metric in re.findall(r"\b(router_[a-z_]+)", rule["expr"])
    }
    assert used
    assert used <= names, used - names
