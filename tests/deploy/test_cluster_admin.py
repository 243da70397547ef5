"""deploy/kubernetes as a cluster admin applies it: what each engine serves, and what runs in a shared namespace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.core.config.settings import load_config
from tests.deploy.manifests import OVERLAYS, render, router_toml

Doc = dict[str, Any]


def engines(docs: list[Doc]) -> list[Doc]:
    """The vLLM pod templates of an overlay (Deployments and StatefulSets): those with a container named vllm."""
    return [
        doc["spec"]["template"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
        and any(c["name"] == "vllm" for c in doc["spec"]["template"]["spec"]["containers"])
    ]


def served_name(container: Doc) -> str:
    args = [str(a) for a in container.get("args", [])] + [str(a) for a in container.get("command", [])]
    assert "--served-model-name" in args, f"{container['name']} starts vLLM without --served-model-name"
    return args[args.index("--served-model-name") + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_serves_the_name_the_router_sends_it(overlay: str, tmp_path: Path) -> None:
    """Without --served-model-name vLLM serves the weights' path and answers every routed request 404."""
    docs = render(overlay)
    path = tmp_path / "router.toml"
    path.write_text(router_toml(docs))
    config = load_config(path, environ={})
    sent = {r.model for r in config.replicas} | set(config.models)
    templates = engines(docs)
    assert templates
    for template in templates:
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "vllm"]
        name = served_name(container)
        assert name in sent, f"{overlay}: vLLM serves {name}, the router sends {sorted(sent)}"
        if config.discovery is not None:
            # Discovery names a replica's model by its label: the name vLLM must serve.
            assert template["metadata"]["labels"][config.discovery.model_label] == name
