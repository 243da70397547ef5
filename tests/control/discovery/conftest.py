"""Fixtures of the discovery tests: the fake API server, the pods, and routers that discover through it."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router.control.discovery.access import resolve_access
from router.control.discovery.source import KubernetesSource
from router.core.config.settings import parse_config
from router.run.app import RouterServer
from tests.control.discovery.harness import Pods, StartDiscovery
from tests.control.discovery.recorded import SELECTOR
from tests.support.kube_api import FakeKubernetesApi
from tests.support.processes import held_port


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubernetesApi]:
    api = FakeKubernetesApi(bookmark_seconds=0.2)
    await api.start()
    yield api
    await api.stop()


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    # The pods share one port on addresses of their own (127.0.0.2 and on): held on 127.0.0.1
    # for the whole test, so that no other test's listener there takes it meanwhile.
    with held_port() as held:
        fleet = Pods(int(held.getsockname()[1]))
        yield fleet
        await fleet.close()


class SourceClock:
    """The discovery source's monotonic clock: the real one, moved on by a test that would otherwise wait.

    The source reads it for how stale its view is and when to report again;
    its pauses between attempts stay real (they are short here: backoff_cap 0.5 s).
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def source_clock() -> SourceClock:
    return SourceClock()


@pytest.fixture
async def start_discovery(
    kube: FakeKubernetesApi, tmp_path: Path, source_clock: SourceClock
) -> AsyncIterator[StartDiscovery]:
    """A router whose set comes from the fake API server; `keys` go into [discovery.kubernetes]."""
    path = tmp_path / "kubeconfig"
    path.write_text(kube.kubeconfig())
    servers: list[RouterServer] = []

    async def start(watch_seconds: float = 30.0, **keys: Any) -> tuple[RouterServer, KubernetesSource]:
        raw = {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "router_name": "test",
            "tick_seconds": 0.1,
            "connect_timeout_seconds": 2.0,
            "discovery": {"kubernetes": {"selector": SELECTOR, "port": "http", "kubeconfig": str(path), **keys}},
        }
        config = parse_config(raw, "<test>", environ={})
        assert config.discovery is not None
        source = KubernetesSource(
            config.discovery,
            resolve_access(config.discovery, {}),
            mono=source_clock,
            rng=random.Random(7),
            backoff_first=0.05,
            backoff_cap=0.5,
            report_every=1.0,
            watch_seconds=watch_seconds,
            min_watch_seconds=0.2,
        )
        server = RouterServer(config, registry=CollectorRegistry(), sources=[source])
        await server.start()
        servers.append(server)
        return server, source

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def discovery(start_discovery: StartDiscovery) -> tuple[RouterServer, KubernetesSource]:
    return await start_discovery()


@pytest.fixture
async def pod_discovery(start_discovery: StartDiscovery) -> tuple[RouterServer, KubernetesSource]:
    return await start_discovery(selector_on="pods", labels_from=["gpu_class", "gpus"])
