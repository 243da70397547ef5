"""deploy/ holds what it takes to run the router for real; each piece is checked offline.

The container tier (tests/deploy/container/) runs the image from the same rendered manifests."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from router.core.config.settings import Config, load_config
from router.run.cli import build_parser
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import scrape
from tests.support.manifests import (
    OVERLAYS,
    VERSION,
    container_of,
    kubectls,
    named,
    of_kind,
    pod_of,
    pods_mode_overlay,
    render,
    router_toml,
    secret_refs,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The walkthroughs: Kubernetes (the Secrets its commands make) and the image and systemd.
KUBERNETES_DOC = (DEPLOY.parent / "docs" / "kubernetes.md").read_text()
DEPLOY_DOC = (DEPLOY.parent / "docs" / "deploy.md").read_text()


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_toml(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return load_config(path, environ={})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_its_kubernetes_objects_validate_strictly(overlay: str) -> None:
    checked = 0
    for doc in render(overlay):
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: tests/scaler/test_deploy.py checks it against KEDA's fields
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
        checked += 1
    assert checked >= 4


def without_content_hashes(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects in a stable order, each generated ConfigMap's hash suffix written <hash> wherever it is named.

    Each kustomize version hashes a generated ConfigMap's content its own way
    (2.0.3 and v5 give the same content different suffixes): the suffix is
    the one field allowed to differ, and it must be there.
    """
    text = json.dumps(docs)
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            name = doc["metadata"]["name"]
            stem = re.fullmatch(r"(.+)-[a-z0-9]{10}", name)
            assert stem is not None, f"the ConfigMap {name} is not named by a hash of its content"
            text = text.replace(json.dumps(name), json.dumps(f"{stem[1]}-<hash>"))
    by_name: list[dict[str, Any]] = sorted(
        json.loads(text), key=lambda d: (d["apiVersion"], d["kind"], d["metadata"]["name"])
    )
    return by_name


@pytest.mark.parametrize("overlay", [*OVERLAYS, "discovery-pods-mode"])
def test_every_kubectl_here_renders_the_same_objects(overlay: str, tmp_path: Path) -> None:
    """Debian's kubectl 1.20 (kustomize 2.0.3) and a current one (kustomize v5) apply the same objects, field by field.

    The overlays use only what 2.0.3 knows (bases, patchesStrategicMerge,
    generatorOptions); .ci/run unpacks Debian's kubernetes-client and names
    its kubectl in ROUTER_KUBECTL_OLD, beside the kubectl on PATH.
    """
    tools = kubectls()
    if len(tools) < 2:
        pytest.skip(
            f"one kubectl version here ({', '.join(tools) or 'none'}): set ROUTER_KUBECTL_OLD to Debian's "
            "kubernetes-client's kubectl (apt-get download kubernetes-client; dpkg -x) to compare"
        )
    path = pods_mode_overlay(tmp_path / "pods-mode") if overlay == "discovery-pods-mode" else overlay
    first, *others = tools
    expected = without_content_hashes(render(path, first))
    for other in others:
        assert without_content_hashes(render(path, other)) == expected, f"{other} and {first} render {overlay} apart"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_deployment_probes_the_admin_port_and_outwaits_the_grace(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    pod = pod_of(docs, "Deployment", "router")
    container = container_of(docs, "router")
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = load_toml(tmp_path, router_toml(docs))
    assert ports == {"http": config.listen.port, "admin": config.admin_listen.port}
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_grace_seconds
    assert build_parser().parse_args(container["args"]).command == "serve"
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    assert [p["targetPort"] for p in services["router"]["spec"]["ports"]] == ["http"]
    assert services["router-admin"]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_get_a_writable_tmp_under_the_read_only_root(overlay: str) -> None:
    """--workers auto keeps its workers' sockets in the temporary directory: an emptyDir at /tmp."""
    docs = render(overlay)
    pod = pod_of(docs, "Deployment", "router")
    container = container_of(docs, "router")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["args"][container["args"].index("--workers") + 1] == "auto"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert not mount.get("readOnly", False)
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume
    assert "TMPDIR" not in {e["name"] for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_images_are_this_version_s(overlay: str) -> None:
    """The one image of `make image` runs router serve and router scaler, tagged with the project's version."""
    images = [
        c["image"]
        for d in render(overlay)
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    ]
    ours = [image for image in images if image.split(":")[0].rsplit("/", 1)[-1] == "router"]
    assert ours and set(ours) == {f"router:{VERSION}"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_an_overlay_needs_is_made_by_a_command_the_docs_give(overlay: str) -> None:
    commands = re.findall(r"kubectl create secret generic (\S+) --from-literal=(\w+)=", KUBERNETES_DOC)
    created = {(name, key) for name, key in commands}
    assert secret_refs(render(overlay)) <= created


def test_the_plain_overlay_s_replicas_are_the_pods_of_its_statefulset(tmp_path: Path) -> None:
    docs = render("plain")
    config = load_toml(tmp_path, router_toml(docs))
    statefulset = named(docs, "StatefulSet", "llama")
    headless = named(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    container = container_of(docs, "llama", "StatefulSet")
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    served = container["args"][container["args"].index("--served-model-name") + 1]
    # Short names (pod.service): the pods' DNS search domains resolve them in any namespace.
    pods = {f"llama-{i}.{headless['metadata']['name']}" for i in range(statefulset["spec"]["replicas"])}
    assert {(urlsplit(r.url).hostname, urlsplit(r.url).port) for r in config.replicas} == {(pod, port) for pod in pods}
    assert {r.model for r in config.replicas} == {served}


def test_the_configmap_is_named_by_its_content_so_a_change_rolls_the_pods(tmp_path: Path) -> None:
    docs = render("plain")
    (volume,) = [v for v in pod_of(docs, "Deployment", "router")["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"].startswith("router-config-")
    changed = tmp_path / "changed"
    shutil.copytree(DEPLOY / "kubernetes" / "plain", changed)
    (changed / "kustomization.yaml").write_text(
        # kustomize takes no absolute path for a base: the way from the copy to it.
        (changed / "kustomization.yaml")
        .read_text()
        .replace("../base", os.path.relpath(DEPLOY / "kubernetes" / "base", changed))
    )
    (changed / "router.toml").write_text((changed / "router.toml").read_text() + "\n# changed\n")
    (other,) = [v for v in pod_of(render(changed), "Deployment", "router")["volumes"] if "configMap" in v]
    assert other["configMap"]["name"] != volume["configMap"]["name"]


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


UNIT = DEPLOY / "systemd" / "router.service"


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def deploy_doc_section(title: str) -> str:
    return DEPLOY_DOC.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    (exec_start,) = unit_settings()["ExecStart"]
    installed = shlex.split(exec_start)[0]
    # The one change: the router where this checkout installed it, not where the documented steps put it.
    here = str(Path(sys.executable).parent / "router")
    unit = tmp_path / "router.service"
    unit.write_text(UNIT.read_text().replace(installed, here))
    done = subprocess.run(
        [tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # verify exits 0 on an unknown key and only warns: a clean unit prints nothing.
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


def test_the_systemd_unit_runs_the_router_the_documented_steps_install() -> None:
    (exec_start,) = unit_settings()["ExecStart"]
    venv = Path(shlex.split(exec_start)[0]).parent.parent
    steps = deploy_doc_section("Running under systemd")
    assert f"python3 -m venv {venv}" in steps
    assert f"{venv}/bin/pip install dist/router-{VERSION}-*.whl" in steps
    assert f"install -m 0644 deploy/systemd/router.service /etc/systemd/system/{UNIT.name}" in steps


def test_the_systemd_unit_lets_the_access_log_and_the_workers_write_under_protect_system_strict(
    tmp_path: Path,
) -> None:
    settings = unit_settings()
    assert settings["ProtectSystem"] == ["strict"]
    # LogsDirectory=router is /var/log/router; RuntimeDirectory=router is $RUNTIME_DIRECTORY, /run/router.
    (logs,) = settings["LogsDirectory"]
    (runtime,) = settings["RuntimeDirectory"]
    assert runtime and "--workers" in settings["ExecStart"][0]
    (example,) = re.findall(r"```toml\n(.*?)```", deploy_doc_section("Running under systemd"), re.S)
    config = load_toml(tmp_path, example)
    assert Path(config.access_log).parent == Path("/var/log") / logs


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
