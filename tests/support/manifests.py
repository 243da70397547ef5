"""The Kubernetes examples as a user applies them: deploy/kubernetes/{plain,discovery,keda}, rendered by kustomize.

`kubectl kustomize DIR` is what `kubectl apply -k DIR` applies, so the
tests read that output, offline, and never the files one by one: a patch,
a generated ConfigMap's hashed name or an image name that kustomize sets
is then checked as the cluster would get it. The container tier
(tests/deploy/container/) runs the image from these same rendered specs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("plain", "discovery", "keda")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

Doc = dict[str, Any]


def kubectl() -> str:
    """The kubectl on PATH, else Debian's 1.20 where ROUTER_KUBECTL_OLD names it (.ci/run extracts it)."""
    found = shutil.which("kubectl") or old_kubectl()
    if found is None:
        pytest.skip("kubectl is not installed: the Kubernetes examples are rendered with `kubectl kustomize`")
    version = client_version(found)
    # 1.20 (Debian's kubernetes-client, kustomize 2.0.3) is the oldest the examples are rendered with here.
    if version < (1, 20):
        pytest.skip(
            f"{found} is kubectl {version[0]}.{version[1]}: the examples are checked with 1.20 (kustomize 2.0.3) "
            "and later"
        )
    return found


def old_kubectl() -> str | None:
    """ROUTER_KUBECTL_OLD: Debian's kubernetes-client's kubectl (1.20, kustomize 2.0.3), unpacked, not installed."""
    path = os.environ.get("ROUTER_KUBECTL_OLD")
    if not path:
        return None
    if not os.access(path, os.X_OK):
        pytest.fail(f"ROUTER_KUBECTL_OLD={path} is not an executable kubectl")
    return path


def kubectls() -> list[str]:
    """Every kubectl this machine has (on PATH, and ROUTER_KUBECTL_OLD), one per version."""
    by_version: dict[tuple[int, int], str] = {}
    for tool in (shutil.which("kubectl"), old_kubectl()):
        if tool is not None:
            by_version.setdefault(client_version(tool), tool)
    return [by_version[version] for version in sorted(by_version)]


@functools.cache
def client_version(tool: str) -> tuple[int, int]:
    """(major, minor) of a kubectl; its kustomize follows (1.20: 2.0.3, 1.21: v4.0.5, 1.32: v5.5)."""
    done = subprocess.run(
        [tool, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"{tool} version: {done.stderr}"
    client = json.loads(done.stdout)["clientVersion"]
    # Some builds say "32+" for the minor.
    return int(client["major"]), int(re.sub(r"\D", "", client["minor"]))


@functools.cache
def _render(path: str, tool: str) -> tuple[Doc, ...]:
    # stdout only: kustomize v5 warns on stderr that `bases` and
    # `patchesStrategicMerge` are deprecated, which kustomize 2.0.3 needs.
    done = subprocess.run([tool, "kustomize", path], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{tool} kustomize {path}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(overlay: str | Path, tool: str | None = None) -> list[Doc]:
    """Every object of an overlay (a name under deploy/kubernetes, or a directory), as kubectl would apply it."""
    path = overlay if isinstance(overlay, Path) else KUBERNETES / overlay
    # A copy, so that a test changing one changes nothing for the next.
    docs: list[Doc] = json.loads(json.dumps(_render(str(path), tool or kubectl())))
    return docs


def pods_mode_overlay(directory: Path) -> Path:
    """The discovery overlay with ../rbac/discovery-pods added, as its kustomization.yaml says to."""
    directory.mkdir()
    # kustomize takes no absolute path for a base: the way from here to each.
    discovery = os.path.relpath(KUBERNETES / "discovery", directory)
    pods = os.path.relpath(KUBERNETES / "rbac" / "discovery-pods", directory)
    (directory / "kustomization.yaml").write_text(
        f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nbases:\n  - {discovery}\n  - {pods}\n"
    )
    return directory


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def pod_of(docs: list[Doc], kind: str, name: str) -> Doc:
    """The pod template's spec of a Deployment or StatefulSet."""
    spec: Doc = named(docs, kind, name)["spec"]["template"]["spec"]
    return spec


def container_of(docs: list[Doc], name: str, kind: str = "Deployment") -> Doc:
    container: Doc
    (container,) = pod_of(docs, kind, name)["containers"]
    return container


def router_toml(docs: list[Doc], deployment: str = "router") -> str:
    """The router.toml the Deployment mounts: its ConfigMap volume, by the name kustomize gave it."""
    pod = pod_of(docs, "Deployment", deployment)
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    text: str = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]["router.toml"]
    return text


def secret_refs(docs: list[Doc]) -> set[tuple[str, str]]:
    """(secret, key) of every secretKeyRef of every container."""
    refs = set()
    for doc in docs:
        template = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in template.get("containers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    refs.add((ref["name"], ref["key"]))
    return refs
