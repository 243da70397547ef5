"""The container tier: the image of the Containerfile, built by scripts/build-image and run by podman.

Every container here runs from a rendered manifest (tests/support/manifests.py) the way
the kubelet would run it (tests/deploy/container/podman.py), on a podman network of
its own, reached from the tests through ports published on 127.0.0.1. The
tier skips, saying why, where containers cannot run: no podman, not root
(it runs rootful podman with storage under .cache/containers), no netavark
for names on a network, or an OCI runtime that cannot start a container.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.container.podman import Podman
from tests.support.manifests import ROOT

KUBERNETES_DOC = (ROOT / "docs" / "kubernetes.md").read_text()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/deploy/container/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.container)
            # The first test builds the image: minutes when nothing is cached yet.
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def podman() -> Podman:
    if shutil.which("podman") is None:
        pytest.skip(
            "podman is not installed: the container tier needs podman, runc, netavark, aardvark-dns, iptables and "
            "debootstrap (Debian's packages; .ci/run installs them)"
        )
    if os.geteuid() != 0:
        pytest.skip("the container tier runs rootful podman with its storage under .cache/containers: run it as root")
    engine = Podman()
    info = engine("info", "--format", "{{.Host.NetworkBackend}}", check=False)
    if info.returncode != 0:
        pytest.skip(f"podman cannot run here: {info.stderr.strip().splitlines()[-1:]}")
    if (
        info.stdout.strip() != "netavark"
        or shutil.which("aardvark-dns", path="/usr/lib/podman:/usr/libexec/podman") is None
    ):
        pytest.skip("the container tier needs netavark and aardvark-dns: containers reach each other by name")
    if shutil.which("iptables") is None:
        pytest.skip("the container tier needs iptables: netavark sets up each network's NAT with it")
    return engine


def cannot_run_containers(output: str) -> bool:
    """An OCI runtime refusing to start a container: a machine that cannot run them, not a broken build."""
    return bool(
        re.search(r"OCI runtime|runc create failed|crun: |cannot set up namespace|error setting rlimit", output)
    )


@pytest.fixture(scope="session")
def image(podman: Podman) -> str:
    """`make image`'s tag, built once and found current after (scripts/build-image's hash of its inputs)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "build-image")],
        env=podman.env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    if done.returncode != 0:
        if cannot_run_containers(done.stderr):
            pytest.skip(f"containers cannot run here: {done.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"scripts/build-image failed:\n{done.stderr[-4000:]}")
    tag = done.stdout.strip().splitlines()[-1]
    probe = podman("run", "--rm", "--pull", "never", tag, "--help", check=False)
    if probe.returncode != 0:
        if cannot_run_containers(probe.stderr):
            pytest.skip(f"containers cannot run here: {probe.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"the image does not run: {probe.stderr}")
    return tag


@pytest.fixture(scope="session")
def secret_values() -> dict[tuple[str, str], str]:
    """The Secrets docs/kubernetes.md's `kubectl create secret generic` commands make, each with a fresh value."""
    made = re.findall(r"kubectl create secret generic (\S+) --from-literal=(\w+)=", KUBERNETES_DOC)
    assert made
    return {(name, key): secrets.token_hex(16) for name, key in made}


def new_network(podman: Podman) -> str:
    # Not --internal: podman publishes no port to 127.0.0.1 on an internal network.
    name = f"router-test-{uuid.uuid4().hex[:8]}"
    podman("network", "create", name)
    return name


@pytest.fixture
def network(podman: Podman) -> Iterator[str]:
    """A podman network of the test's own, with DNS by container name and --network-alias (aardvark-dns)."""
    name = new_network(podman)
    yield name
    # --force removes the containers on it too.
    podman("network", "rm", "--force", name, check=False)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "containers"
    path.mkdir()
    return path
