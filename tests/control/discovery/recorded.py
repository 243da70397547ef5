"""The recorded API documents (kubernetes/) and the settings the tests read them with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from router.core.config.settings import KubernetesDiscovery

RECORDED = Path(__file__).resolve().parent / "kubernetes"
SELECTOR = "app.kubernetes.io/part-of=llm-fleet"
NS = "default"


def recorded_list() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((RECORDED / "endpointslice-list.json").read_text())
    return doc


def recorded_watch() -> list[bytes]:
    return (RECORDED / "endpointslice-watch.jsonl").read_bytes().splitlines()


def recorded_pods() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((RECORDED / "pod-list.json").read_text())
    return doc


def recorded_pod_watch() -> list[bytes]:
    return (RECORDED / "pod-watch.jsonl").read_bytes().splitlines()


SETTINGS = KubernetesDiscovery(selector=SELECTOR, port="http", labels_from=("gpu_class",))
ON_PODS = KubernetesDiscovery(selector=SELECTOR, port="http", labels_from=("gpu_class", "gpus"), selector_on="pods")
