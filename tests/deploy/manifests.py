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
    """kubectl with a kustomize that knows components and directory resources (v4 and later)."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: the Kubernetes examples are rendered with `kubectl kustomize`")
    version = _kustomize_version(found)
    if version is None or version < 4:
        pytest.skip(
            f"{found} embeds kustomize {version or 'older than v4'} (Debian's kubernetes-client 1.20 has v2.0.3), "
            "which cannot render components or a base directory: kubectl 1.24 or later is needed"
        )
    return found


@functools.cache
def _kustomize_version(tool: str) -> int | None:
    done = subprocess.run(
        [tool, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60, check=False
    )
    try:
        text = json.loads(done.stdout).get("kustomizeVersion", "")
        return int(text.removeprefix("v").split(".")[0])
    except (ValueError, AttributeError):
        return None


@functools.cache
def _render(path: str, tool: str) -> tuple[Doc, ...]:
    done = subprocess.run([tool, "kustomize", path], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"kubectl kustomize {path}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(overlay: str | Path) -> list[Doc]:
    """Every object of an overlay (a name under deploy/kubernetes, or a directory), as kubectl would apply it."""
    path = overlay if isinstance(overlay, Path) else KUBERNETES / overlay
    # A copy, so that a test changing one changes nothing for the next.
    docs: list[Doc] = json.loads(json.dumps(_render(str(path), kubectl())))
    return docs


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
