"""sleepAfter: the scaler puts a replica proven quiet at every router to sleep, fenced at both, and KEDA
still sees the model active (quiet, not gone) until idleAfter."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from aiohttp import web

from router.scaler.sleeper import Sleeper, SleepFailed
from router.scaler.view import BadMetadata, parse_metadata
from router.tools.fake import SleepMode
from tests.conftest import StartFake, StartRouter
from tests.support.refusing_router import refusing_router
from tests.support.scaler import Keda, Routers, StartScaler, is_active, ref
from tests.support.waiting import until


async def states(admin_url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/api/v1/replicas") as resp:
        return {r["id"]: r["state"] for r in await resp.json()}


def test_sleep_after_must_come_before_idle_after() -> None:
    assert parse_metadata({"model": "m", "sleepAfter": "60", "idleAfter": "600"}).sleep_after == 60
    assert parse_metadata({"model": "m"}).sleep_after is None
    with pytest.raises(BadMetadata, match="sleepAfter: must be below idleAfter"):
        parse_metadata({"model": "m", "sleepAfter": "600", "idleAfter": "600"})
    with pytest.raises(BadMetadata, match="did you mean sleepAfter"):
        parse_metadata({"model": "m", "sleepafter": "6"})


async def test_a_quiet_replica_sleeps_at_both_routers_and_the_model_stays_active_until_idle_after(
    routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    assert fake.sleep is not None
    routers.write([{"id": "r0", "model": "m", "url": fake.url, "engine": "vllm"}])
    await routers.start()
    scaler = await start_scaler(routers.admins)
    stub = keda(scaler)
    query = ref("m", sleepAfter="1", idleAfter="3600")
    assert await is_active(stub, query)

    async def asleep_everywhere() -> bool:
        return [(await states(r.admin_url))["r0"] for r in routers.all] == ["asleep", "asleep"]

    await until(asleep_everywhere, timeout=20)
    assert fake.sleep.calls == ["sleep 1"]
    assert fake.sleep.busy_at_sleep == [0]
    # Asleep is quiet, not gone: active until idleAfter.
    assert await is_active(stub, query)
    # A request through either router wakes it.
    async with openai.AsyncOpenAI(
        base_url=routers.all[1].client_url + "/v1", api_key="x", max_retries=0, timeout=20
    ) as sdk:
        answer = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    assert fake.sleep.calls[:2] == ["sleep 1", "wake_up"]


async def test_a_router_answering_no_json_is_rolled_back_like_any_failed_sleep() -> None:
    # A router (or something in its place) answering 200 with a body that is no JSON: the two phases
    # stop there and every router is told ready again, or the replica stayed draining everywhere.
    posted: list[dict[str, object]] = []

    async def state(request: web.Request) -> web.Response:
        posted.append(await request.json())
        return web.Response(text="fine, thanks")

    app = web.Application()
    app.router.add_post("/api/v1/replicas/{id}/state", state)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(SleepFailed):
                await Sleeper(session, "").sleep("llm/r0", [f"http://{host}:{port}"])
    finally:
        await runner.cleanup()
    assert [body["state"] for body in posted] == ["draining", "ready"]


async def test_a_router_refusing_to_be_told_it_sleeps_has_the_sleep_undone_at_every_router(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    first = await start_router([{"id": "r0", "model": "m", "url": fake.url, "engine": "vllm"}])
    async with refusing_router("r0") as second, aiohttp.ClientSession() as session:
        with pytest.raises(SleepFailed, match="asleep answered 503"):
            await Sleeper(session, "").sleep("r0", [first.admin_url, second.admin_url])
    assert fake.sleep is not None
    assert fake.sleep.calls == ["sleep 1", "wake_up"]
    assert not fake.sleep.sleeping
    assert (await states(first.admin_url))["r0"] == "ready"
    assert second.states == ["draining", "asleep", "ready"]
