"""admin_token_reads: the admin token on the admin API's reads too, the probes left open."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router.core.config.settings import parse_config
from router.core.errors import ConfigError
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import run_ctl

TOKEN = "s3cret-admin"
READS = ("/api/v1/usage", "/api/v1/replicas", "/api/v1/endpoints", "/api/v1/status", "/metrics")


async def statuses(admin_url: str, paths: tuple[str, ...], token: str | None = None) -> dict[str, int]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    out = {}
    async with aiohttp.ClientSession(headers=headers) as session:
        for path in paths:
            async with session.get(admin_url + path) as resp:
                await resp.read()
                out[path] = resp.status
    return out


async def test_reads_need_the_token_and_the_probes_do_not(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], admin_token=TOKEN, admin_token_reads=True)
    assert set((await statuses(server.admin_url, READS)).values()) == {401}
    assert set((await statuses(server.admin_url, READS, "wrong")).values()) == {401}
    assert set((await statuses(server.admin_url, READS, TOKEN)).values()) == {200}
    # The kubelet's probes carry no token.
    assert await statuses(server.admin_url, ("/healthz", "/readyz")) == {"/healthz": 200, "/readyz": 200}
    code, out = await asyncio.to_thread(run_ctl, "replicas", "--server", server.admin_url, "--token", TOKEN)
    assert code == 0 and "r0" in out
    code, _ = await asyncio.to_thread(run_ctl, "replicas", "--server", server.admin_url)
    assert code == 1


async def test_without_it_reads_stay_open(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], admin_token=TOKEN)
    assert set((await statuses(server.admin_url, READS)).values()) == {200}


def test_it_needs_a_token_to_require() -> None:
    with pytest.raises(ConfigError, match="admin_token_reads: needs admin_token"):
        parse_config({"admin_token_reads": True}, "<test>", environ={})
    config = parse_config({"admin_token_reads": True}, "<test>", environ={"ROUTER_ADMIN_TOKEN": TOKEN})
    assert config.admin_token_reads and config.admin_token == TOKEN
