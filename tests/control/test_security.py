"""The admin API's OpenAPI document, and schemathesis against it finding no 500."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import RefusedUrl
from tests.support.clients import get_json
from tests.support.processes import Serve

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


@pytest.fixture
async def serve(tmp_path: Path, refused_url: RefusedUrl) -> AsyncIterator[Serve]:
    process = Serve(tmp_path / "router.toml")
    process.write([{"id": "r0", "model": "m", "url": refused_url()}], 'admin_token = "t0k"')
    await process.start()
    yield process
    process.output()


async def test_the_openapi_document_describes_every_admin_route(serve: Serve) -> None:
    doc = await get_json(serve.admin_url + "/api/v1/openapi.json")
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/healthz",
        "/readyz",
        "/metrics",
        "/api/v1/usage",
        "/api/v1/replicas",
        "/api/v1/status",
        "/api/v1/endpoints",
        "/api/v1/replicas/{id}/state",
    }
    assert doc["paths"]["/api/v1/endpoints"]["put"]["security"] == [{"adminToken": []}]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("token", ["t0k", None], ids=["with-token", "without-token"])
async def test_schemathesis_finds_no_server_error_on_the_admin_api(serve: Serve, token: str | None) -> None:
    argv = [
        str(SCHEMATHESIS),
        "run",
        serve.admin_url + "/api/v1/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        "40",
        "--seed",
        "1",
    ]
    if token:
        argv += ["--header", f"Authorization: Bearer {token}"]
    result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=200, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
