"""Woken by the request that needs it: a request for a model whose replicas sleep is held, and one is woken.

Through the real server, with the official `openai` SDK as the client, in
front of fakes with vLLM's sleep API (router.tools.fake.sleep) and hostile
ones: a wake that hangs, fails, answers garbage, and a 503 without the
sleeping marker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp import web

from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica, SleepMode
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.control.test_operations import admin, states
from tests.support.waiting import wait_for


@pytest.fixture
async def wake_url() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A control plane's wake endpoint: it records each call's body."""
    calls: list[dict[str, Any]] = []

    async def wake(request: web.Request) -> web.Response:
        calls.append(await request.json())
        return web.Response()

    app = web.Application()
    app.router.add_post("/wake", wake)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}/wake", calls
    await runner.cleanup()


def sdk(server: RouterServer, timeout: float = 30) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


async def ask(server: RouterServer, content: str = "hi") -> Any:
    async with sdk(server) as client:
        return await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=2
        )


def vllm(rid: str, fake: FakeReplica) -> dict[str, Any]:
    return {**replica_entry(rid, fake), "engine": "vllm"}


async def put_to_sleep(server: RouterServer, *ids: str) -> None:
    for rid in ids:
        status, answer = await admin(server, "POST", f"/api/v1/replicas/{rid}/state", {"state": "asleep"})
        assert (status, answer["state"]) == (200, "asleep"), answer


def held(server: RouterServer) -> int:
    return server.pool.cold_start.held("m")


async def test_held_requests_make_one_wake_call_and_go_in_their_order(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    gate = asyncio.Event()
    fake = await start_fake("m", sleep=SleepMode(wake_gate=gate))
    assert fake.sleep is not None
    # One at a time once awake, so that the order they reach it is the order they left the hold.
    server = await start_router([vllm("r0", fake)], max_in_flight_per_replica=1)
    await put_to_sleep(server, "r0")
    asks = []
    for i in range(6):
        asks.append(asyncio.ensure_future(ask(server, f"n{i}")))
        await wait_for(lambda i=i: held(server) == i + 1)
    # Six held, one wake under way.
    assert fake.sleep.calls == ["sleep 1", "wake_up"]
    assert (await states(server))["r0"] == "waking"
    gate.set()
    answers = await asyncio.gather(*asks)
    assert all(a.http_response.status_code == 200 for a in answers)
    assert float(answers[0].headers["x-router-held-seconds"]) > 0
    assert fake.sleep.calls == ["sleep 1", "wake_up"]
    # Served in the order they were held.
    assert [s.body.count(f'"n{i}"'.encode()) for i, s in enumerate(fake.seen)] == [1] * 6
    assert (await states(server))["r0"] == "ready"


async def test_a_saturated_model_wakes_a_sleeping_replica_for_its_queue(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    busy = await start_fake("m", behaviour=Behaviour(stall=True))
    sleeper = await start_fake("m", sleep=SleepMode())
    server = await start_router([replica_entry("r0", busy), vllm("r1", sleeper)], max_in_flight_per_replica=1)
    await put_to_sleep(server, "r1")
    stalled = asyncio.ensure_future(ask(server, "stalled"))
    await wait_for(lambda: len(busy.seen) == 1)
    answer = await ask(server, "queued")
    assert answer.http_response.status_code == 200
    assert len(sleeper.seen) == 1
    assert sleeper.sleep is not None
    assert sleeper.sleep.calls == ["sleep 1", "wake_up"]
    stalled.cancel()


async def test_a_growing_queue_wakes_another(start_fake: StartFake, start_router: StartRouter) -> None:
    fakes = [await start_fake("m", sleep=SleepMode(wake_seconds=0.5)) for _ in range(2)]
    server = await start_router(
        [vllm("r0", fakes[0]), vllm("r1", fakes[1])], max_in_flight_per_replica=1, models={"m": {"max_held": 50}}
    )
    await put_to_sleep(server, "r0", "r1")
    asks = [asyncio.ensure_future(ask(server, str(i))) for i in range(4)]
    answers = await asyncio.gather(*asks)
    assert all(a.http_response.status_code == 200 for a in answers)
    # Four waiting, one each per replica woken: both were.
    assert [f.sleep.calls if f.sleep else None for f in fakes] == [["sleep 1", "wake_up"]] * 2


@pytest.mark.parametrize("hostile", ["fails", "garbage", "hangs"])
async def test_a_wake_that_fails_leaves_the_replica_asleep_and_the_next_is_woken(
    start_fake: StartFake, start_router: StartRouter, hostile: str
) -> None:
    bad = await start_fake(
        "m",
        sleep=SleepMode(
            wake_status=500 if hostile == "fails" else None, garbage=hostile == "garbage", wake_hangs=hostile == "hangs"
        ),
    )
    good = await start_fake("m", sleep=SleepMode())
    server = await start_router([vllm("r0", bad), vllm("r1", good)], wake_timeout_seconds=0.5)
    await put_to_sleep(server, "r0", "r1")
    answer = await ask(server)
    assert answer.http_response.status_code == 200
    assert len(good.seen) == 1
    # Its engine sleeps still: asleep, not ready, the failure counted as an ejection.
    assert (await states(server)) == {"r0": "asleep", "r1": "ready"}
    replica = server.pool.get("r0")
    assert replica is not None
    assert replica.ejections == 1


async def test_with_no_replica_left_to_wake_wake_url_is_told(
    start_fake: StartFake, start_router: StartRouter, wake_url: tuple[str, list[dict[str, Any]]]
) -> None:
    url, calls = wake_url
    bad = await start_fake("m", sleep=SleepMode(wake_status=500))
    server = await start_router(
        [vllm("r0", bad)], wake_timeout_seconds=0.5, wake_url=url, models={"m": {"cold_start_seconds": 1}}
    )
    await put_to_sleep(server, "r0")
    with pytest.raises(openai.APIStatusError) as raised:
        await ask(server)
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"]
    assert [c["model"] for c in calls] == ["m"]


async def test_a_503_saying_sleeping_is_asleep_not_a_failure(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    server = await start_router([vllm("r0", fake)])
    # Put to sleep behind the router's back (another router, an operator): the router finds out from its answer.
    assert fake.sleep is not None
    fake.sleep.level, fake.sleep.asleep = 1, {"weights", "kv_cache"}
    fake.sleep._awake.clear()
    answer = await ask(server)
    assert answer.http_response.status_code == 200
    assert fake.sleep.calls == ["wake_up"]
    replica = server.pool.get("r0")
    assert replica is not None
    assert (replica.errors, replica.failures_in_row, replica.ejections) == ({}, 0, 0)


async def test_a_503_without_the_marker_is_a_failure_as_any(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", behaviour=Behaviour(fail_status=503), sleep=SleepMode())
    server = await start_router([vllm("r0", fake)])
    with pytest.raises(openai.APIStatusError) as raised:
        await ask(server)
    assert raised.value.status_code == 503
    assert fake.sleep is not None
    assert fake.sleep.calls == []
    replica = server.pool.get("r0")
    assert replica is not None
    assert replica.errors == {"status": 1}
    assert replica.asleep is None


async def test_a_replica_whose_wake_failed_stays_asleep_past_its_ejection(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # Its engine still sleeps: the health checks that end its ejection must not make it ready.
    fake = await start_fake("m", sleep=SleepMode(wake_status=500))
    server = await start_router(
        [vllm("r0", fake)],
        wake_timeout_seconds=0.5,
        ejection_base_seconds=0.2,
        health_check_interval_seconds=0.05,
        models={"m": {"cold_start_seconds": 0.5}},
    )
    await put_to_sleep(server, "r0")
    assert server.fleet is not None and server.fleet.sleeper is not None
    results = server.fleet.sleeper.wakes.results
    asked = asyncio.ensure_future(ask(server))
    try:
        await wait_for(lambda: results.get(("wake", "failed")) == 1)
        # What an operator sees: asleep still, the failed wake counted as an ejection of its.
        assert (await states(server))["r0"] == "asleep"
    finally:
        with pytest.raises(openai.APIStatusError) as raised:
            await asked
    replica = server.pool.get("r0")
    assert replica is not None
    assert replica.ejections == 1
    assert raised.value.status_code == 503
    await wait_for(lambda: replica.ejected_until is None or replica.ejected_until < server.pool.clock.now(), timeout=5)
    # Real time: the health checks' next rounds, which must not re-admit it while its engine sleeps.
    await asyncio.sleep(0.2)
    assert (await states(server))["r0"] == "asleep"
    # Once its engine can wake, the next request wakes it, and nothing met its engine asleep.
    assert fake.sleep is not None
    fake.sleep.wake_status = None
    answer = await ask(server)
    assert answer.http_response.status_code == 200
    assert fake.sleep.refused == 0
    assert (await states(server))["r0"] == "ready"


async def test_a_held_requests_probe_that_finds_the_engine_asleep_wakes_it(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # Loading at first (503 without the marker): the request is held, and its probes find it loading.
    fake = await start_fake("m", behaviour=Behaviour(fail_status=503), sleep=SleepMode())
    server = await start_router([vllm("r0", fake)], models={"m": {"cold_start_seconds": 10}})
    asked = asyncio.ensure_future(ask(server))
    await wait_for(lambda: held(server) == 1)
    # Loaded, and put to sleep behind the router's back: the next probe meets a 503 "sleeping".
    assert fake.sleep is not None
    fake.sleep.level, fake.sleep.asleep = 1, {"weights", "kv_cache"}
    fake.sleep._awake.clear()
    fake.behaviour.fail_status = None
    answer = await asyncio.wait_for(asked, 8)
    assert answer.http_response.status_code == 200
    assert fake.sleep.calls == ["wake_up"]
    replica = server.pool.get("r0")
    assert replica is not None
    assert (replica.failures_in_row, replica.ejections) == (0, 0)
    assert "status" not in replica.errors
