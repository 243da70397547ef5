"""What `router ctl` says when a call fails for want of something the user can give, and counts said in English.

`router ctl` as a real process, with no ROUTER_ADMIN_TOKEN in its
environment, against a real router: a drain without the admin token, with
a wrong one, and a status asked of the client port instead of the admin API.
"""

from __future__ import annotations

import asyncio
import os
import sys
from types import MappingProxyType

from router.run.app import RouterServer
from router.scaler.view import FleetView, ModelFacts, decide, parse_metadata
from tests.conftest import StartFake, StartRouter, replica_entry


async def ctl(*args: str, token: str | None = None) -> tuple[int, str]:
    """Exit status and standard error of `router ctl ARGS`, the token in the environment if given."""
    env = {k: v for k, v in os.environ.items() if k != "ROUTER_ADMIN_TOKEN"}
    if token is not None:
        env["ROUTER_ADMIN_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "ctl",
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, err.decode()


async def guarded(start_fake: StartFake, start_router: StartRouter) -> RouterServer:
    fake = await start_fake("m")
    return await start_router([replica_entry("r0", fake)], admin_token="admin-secret")


async def test_a_drain_without_the_admin_token_says_how_to_give_it(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server = await guarded(start_fake, start_router)
    status, said = await ctl("drain", "r0", "--server", server.admin_url)
    assert status == 1
    assert "answered 401" in said
    assert "give the router's admin token with --token TOKEN, or in ROUTER_ADMIN_TOKEN" in said
    # The same drain with the token goes through.
    assert (await ctl("drain", "r0", "--server", server.admin_url, token="admin-secret"))[0] == 0


async def test_a_drain_with_a_wrong_token_says_it_is_not_the_routers(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server = await guarded(start_fake, start_router)
    status, said = await ctl("drain", "r0", "--server", server.admin_url, "--token", "guess")
    assert status == 1
    assert "the token given, by --token or ROUTER_ADMIN_TOKEN, is not this router's admin token" in said


async def test_ctl_pointed_at_the_client_port_says_it_is_the_client_port(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server = await guarded(start_fake, start_router)
    client = server.client_url.removeprefix("http://")
    status, said = await ctl("status", "--server", client)
    assert status == 1
    assert "answered 404" in said
    assert "this is a router's client port, not its admin API: give --server the admin address" in said
    assert (await ctl("status", "--server", server.admin_url))[0] == 0


def test_the_scaler_says_one_request_not_1_requests() -> None:
    query = parse_metadata({"model": "m"})
    for facts, reason in [
        (ModelFacts(replicas=1, held=1), "1 request held"),
        (ModelFacts(replicas=1, in_flight=1), "1 request in flight"),
        (ModelFacts(replicas=1, in_flight=2), "2 requests in flight"),
        (ModelFacts(replicas=1, unknown=1), "1 of 1 replica unknown (not watched by every router)"),
    ]:
        view = FleetView(complete=True, as_of=0.0, models=MappingProxyType({"m": facts}))
        assert decide(view, query).reason == reason
