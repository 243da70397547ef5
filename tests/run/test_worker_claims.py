"""A worker of `router serve --workers N` has its wake claims before its client port opens.

The claims (router.run.workers.claims) are what keeps the workers to one
wake call per replica. A request that reached a worker before they were in
place would make a wake call of its own beside another worker's. The worker
is started in-process as the supervisor starts it (start_worker); the test
watches the moment its client port opens.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import router.run.app
from router.core.config.settings import parse_config
from router.run.workers.claims import WakeClaims
from router.run.workers.worker import for_worker, start_worker


@pytest.fixture
def runtime() -> Iterator[Path]:
    # Short: a Unix socket's path is bounded (about 100 bytes), and pytest's tmp_path may be longer.
    with tempfile.TemporaryDirectory(prefix="rt") as folder:
        yield Path(folder)


async def test_the_wake_claims_are_in_place_before_the_client_port_opens(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "model_cards": False,
        "replicas": [{"id": "r0", "model": "m", "url": "http://127.0.0.1:9", "engine": "vllm"}],
    }
    config = for_worker(parse_config(raw, "<test>", environ={}), 0, 2)
    seen: list[object] = []
    listen = router.run.app.listen

    async def watched(*args: Any, **kwargs: Any) -> Any:
        # Only observed: the real listen opens the port.
        server = started.get("server")
        fleet = server.fleet if server is not None else None
        seen.append(fleet.sleeper.wakes.claims if fleet is not None and fleet.sleeper is not None else None)
        return await listen(*args, **kwargs)

    started: dict[str, router.run.app.RouterServer] = {}
    original_start = router.run.app.RouterServer.start

    async def start(self: router.run.app.RouterServer, *args: Any, **kwargs: Any) -> None:
        started["server"] = self
        await original_start(self, *args, **kwargs)

    monkeypatch.setattr(router.run.app, "listen", watched)
    monkeypatch.setattr(router.run.app.RouterServer, "start", start)
    server = await start_worker(config, runtime, 0, registry=CollectorRegistry())
    try:
        assert len(seen) == 1
        assert isinstance(seen[0], WakeClaims)
    finally:
        await server.stop()
