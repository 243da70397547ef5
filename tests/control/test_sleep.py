"""Putting a replica to sleep through the admin API and `router ctl`: the fence first, then the engine's call."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from router.tools.fake import Behaviour, SleepMode
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.control.test_operations import admin, states
from tests.support.clients import CHAT, get_json, post, run_ctl, samples, scrape
from tests.support.refusing_router import refusing_router
from tests.support.waiting import wait_for

STATE = "/api/v1/replicas/r0/state"


async def test_sleep_drains_first_then_calls_the_engine_then_shows_asleep(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=10, token_delay=0.03), sleep=SleepMode())
    server = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}])
    assert fake.sleep is not None
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            server.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        await resp.content.readany()
        sleeping = asyncio.ensure_future(admin(server, "POST", STATE, {"state": "asleep", "level": 1}))
        replica = server.pool.get("r0")
        assert replica is not None
        await wait_for(lambda: replica.state.value == "draining")
        # The fence holds: no new request reaches it, and the engine is not called while one is in flight.
        code, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert code == 503
        assert fake.sleep.calls == []
        await resp.read()
        status, answer = await sleeping
    assert (status, answer["state"], answer["level"], answer["in_flight"]) == (200, "asleep", 1, 0)
    assert fake.sleep.calls == ["sleep 1"]
    assert fake.sleep.busy_at_sleep == [0]
    assert (await states(server))["r0"] == "asleep"
    # Woken by hand: ready again, and it serves.
    code, out = await asyncio.to_thread(run_ctl, "wake", "r0", "--server", server.admin_url)
    assert (code, out.strip()) == (0, "r0: ready")
    assert fake.sleep.calls == ["sleep 1", "wake_up"]
    assert (await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT)))[0] == 200


async def test_ctl_sleep_and_an_asleep_replica_is_never_sent_a_request(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    other = await start_fake("m")
    server = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}, replica_entry("r1", other)])
    code, out = await asyncio.to_thread(run_ctl, "sleep", "r0", "--level", "2", "--server", server.admin_url)
    assert (code, out.strip()) == (0, "r0: asleep (level 2)")
    for _ in range(4):
        assert (await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT)))[0] == 200
    assert len(fake.seen) == 0
    assert len(other.seen) == 4
    # Asked again at the same level: already so, nothing called.
    status, answer = await admin(server, "POST", STATE, {"state": "asleep", "level": 2})
    assert (status, answer["state"]) == (200, "asleep")
    assert fake.sleep is not None
    assert fake.sleep.calls == ["sleep 2"]


async def test_refusals_name_the_problem(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    plain = await start_fake("m")
    server = await start_router(
        [
            {**replica_entry("r0", fake), "engine": "vllm"},
            replica_entry("r1", plain),
            {**replica_entry("r2", plain), "engine": "llamacpp"},
        ]
    )
    for body, fragment in (
        ({"state": "asleep", "level": 3}, "level must be 1 or 2"),
        ({"state": "asleep", "level": True}, "level must be 1 or 2"),
        ({"state": "asleep", "call_engine": "no"}, "call_engine must be true or false"),
        ({"state": "asleep", "wait_seconds": -1}, "wait_seconds must be a number"),
        ({"state": "asleep", "colour": 1}, "Unknown field(s) ['colour']"),
        ({"state": "nap"}, '{"state": "asleep", "level": 1}'),
    ):
        status, answer = await admin(server, "POST", STATE, body)
        assert status == 400, body
        assert fragment in answer["error"]["message"]
    status, answer = await admin(server, "POST", "/api/v1/replicas/r1/state", {"state": "asleep"})
    assert (status, answer["error"]["code"]) == (409, "cannot_sleep")
    assert "an engine not known" in answer["error"]["message"]
    status, answer = await admin(server, "POST", "/api/v1/replicas/r2/state", {"state": "asleep"})
    assert status == 409
    assert "'llamacpp', which has no sleep API" in answer["error"]["message"]
    assert (await admin(server, "POST", "/api/v1/replicas/nope/state", {"state": "asleep"}))[0] == 404
    # Refused: nothing changed.
    assert await states(server) == {"r0": "ready", "r1": "ready", "r2": "ready"}


async def test_an_engine_that_fails_its_sleep_call_is_a_502_and_the_replica_stays_ready(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")  # no sleep API: /sleep is a 404 (vLLM without VLLM_SERVER_DEV_MODE)
    server = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}])
    status, answer = await admin(server, "POST", STATE, {"state": "asleep"})
    assert (status, answer["error"]["code"]) == (502, "engine_call_failed")
    assert "POST /sleep?level=1: HTTP 40" in answer["error"]["message"]
    assert (await states(server))["r0"] == "ready"
    code, _ = await asyncio.to_thread(run_ctl, "sleep", "r0", "--server", server.admin_url)
    assert code == 1


async def test_a_replica_still_busy_at_the_end_of_the_wait_is_not_put_to_sleep(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(stall=True), sleep=SleepMode())
    server = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}])
    stalled = asyncio.ensure_future(post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT)))
    await wait_for(lambda: len(fake.seen) == 1)
    status, answer = await admin(server, "POST", STATE, {"state": "asleep", "wait_seconds": 0.1})
    assert (status, answer["error"]["code"]) == (409, "still_busy")
    assert "1 request(s) in flight" in answer["error"]["message"]
    assert fake.sleep is not None
    assert fake.sleep.calls == []
    assert (await states(server))["r0"] == "ready"
    stalled.cancel()


async def test_sglang_replicas_sleep_by_releasing_memory(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    server = await start_router([{**replica_entry("r0", fake), "engine": "sglang"}])
    assert (await admin(server, "POST", STATE, {"state": "asleep"}))[0] == 200
    assert (await admin(server, "POST", STATE, {"state": "ready"}))[1]["state"] == "ready"
    assert fake.sleep is not None
    assert fake.sleep.calls == ["release_memory_occupation", "resume_memory_occupation"]


async def test_status_shows_asleep_replicas_in_their_own_column_and_metrics_count_the_calls(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    other = await start_fake("m")
    server = await start_router(
        [{**replica_entry("r0", fake, gpus=2, gpu_class="a100"), "engine": "vllm"}, replica_entry("r1", other)]
    )
    assert (await admin(server, "POST", STATE, {"state": "asleep"}))[0] == 200
    assert server.ticker is not None
    server.ticker.tick()
    status = await get_json(server.admin_url + "/api/v1/status?idle_for=0")
    model = status["models"][0]
    assert (model["ready"], model["asleep"], model["total"]) == (1, 1, 2)
    a100 = next(g for g in status["gpus"] if g["gpu_class"] == "a100")
    # Never in use, never unknown: asleep.
    assert (a100["asleep"], a100["busy"], a100["unknown"], a100["idle"]) == (2, 0, 0, 0)
    assert a100["bar"] == "[" + "z" * 20 + "]"
    code, out = await asyncio.to_thread(run_ctl, "status", "--server", server.admin_url)
    assert code == 0
    assert "ASLEEP" in out and "zasleep" in out
    assert (await admin(server, "POST", STATE, {"state": "ready"}))[0] == 200
    found = samples(await scrape(server), "router_sleep_calls_total")
    assert found == {(("kind", "sleep"), ("result", "ok")): 1.0, (("kind", "wake"), ("result", "ok")): 1.0}


async def test_a_replica_recorded_asleep_without_a_sleep_api_is_woken_only_by_word(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    plain = await start_fake("m")
    server = await start_router([replica_entry("r0", plain)])
    status, answer = await admin(server, "POST", STATE, {"state": "asleep", "call_engine": False})
    assert (status, answer["state"]) == (200, "asleep")
    status, answer = await admin(server, "POST", STATE, {"state": "ready"})
    assert (status, answer["error"]["code"]) == (409, "cannot_wake")
    assert '"call_engine": false' in answer["error"]["message"]
    status, answer = await admin(server, "POST", STATE, {"state": "ready", "call_engine": False})
    assert (status, answer["state"]) == (200, "ready")


async def test_ctl_sleep_across_routers_undoes_its_fence_when_one_router_refuses(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    knows = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}])
    other = await start_fake("m")
    stranger = await start_router([replica_entry("r9", other)])
    code, _ = await asyncio.to_thread(
        run_ctl, "sleep", "r0", "--server", knows.admin_url, "--server", stranger.admin_url
    )
    assert code == 1
    assert (await states(knows))["r0"] == "ready"
    assert fake.sleep is not None
    assert fake.sleep.calls == []


async def test_the_usage_map_has_asleep_replicas_in_a_map_of_their_own(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    server = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}, replica_entry("r1", fake)])
    assert server.ticker is not None and server.fleet is not None
    assert (await admin(server, "POST", STATE, {"state": "asleep"}))[0] == 200
    for expected in ({"r0": "asleep"}, {}):
        server.ticker.tick()
        usage = await get_json(server.admin_url + "/api/v1/usage")
        snapshot = await server.fleet.snapshot()
        # The incremental document says what the whole snapshot's does, key for key (a later snapshot's time).
        whole = orjson.loads(orjson.dumps(snapshot.usage_document()))
        assert {**usage, "generated_at": 0} == {**whole, "generated_at": 0}
        assert usage["asleep"] == expected
        # Watched as any replica: never unknown for being asleep.
        assert set(usage["watching_since"]) == {"r0", "r1"}
        await admin(server, "POST", STATE, {"state": "ready"})


async def test_ctl_sleep_across_routers_wakes_it_again_when_a_router_refuses_to_be_told_it_sleeps(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # The first router slept the engine; the second refused the news. Neither may be left fencing
    # (or believing asleep) a replica the other still thinks ready: it is woken and ready at both.
    fake = await start_fake("m", sleep=SleepMode())
    first = await start_router([{**replica_entry("r0", fake), "engine": "vllm"}])
    async with refusing_router("r0") as second:
        code, _ = await asyncio.to_thread(
            run_ctl, "sleep", "r0", "--server", first.admin_url, "--server", second.admin_url
        )
    assert code == 1
    assert fake.sleep is not None
    assert fake.sleep.calls == ["sleep 1", "wake_up"]
    assert not fake.sleep.sleeping
    assert (await states(first))["r0"] == "ready"
    assert second.states == ["draining", "asleep", "ready"]


async def test_ready_while_a_sleep_is_under_way_is_refused(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", sleep=SleepMode(sleep_seconds=0.5))
    stalled = await start_fake("m", behaviour=Behaviour(stall=True), sleep=SleepMode())
    server = await start_router(
        [{**replica_entry("r0", fake), "engine": "vllm"}, {**replica_entry("r1", stalled), "engine": "vllm"}]
    )
    # Calling the engine: made ready now, it would take requests while its engine goes to sleep.
    slept = asyncio.ensure_future(admin(server, "POST", STATE, {"state": "asleep"}))
    assert fake.sleep is not None
    await wait_for(lambda: fake.sleep is not None and fake.sleep.calls == ["sleep 1"])
    status, answer = await admin(server, "POST", STATE, {"state": "ready"})
    assert (status, answer["error"]["code"]) == (409, "sleep_under_way")
    assert "r0" in answer["error"]["message"]
    assert (await slept)[1]["state"] == "asleep"
    # Draining: a request still in flight, the sleep waiting for it.
    asked = asyncio.ensure_future(post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT)))
    await wait_for(lambda: len(stalled.seen) == 1)
    r1 = "/api/v1/replicas/r1/state"
    slept = asyncio.ensure_future(admin(server, "POST", r1, {"state": "asleep", "wait_seconds": 0.5}))
    await wait_for(lambda: server.pool.get("r1") is not None and server.pool.get("r1").draining)  # type: ignore[union-attr]
    status, answer = await admin(server, "POST", r1, {"state": "ready"})
    assert (status, answer["error"]["code"]) == (409, "sleep_under_way")
    assert (await slept)[1]["error"]["code"] == "still_busy"
    assert (await states(server))["r1"] == "ready"
    asked.cancel()
