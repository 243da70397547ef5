"""A sleep across two `router serve` processes: the fence spans both before the one engine call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from router.tools.fake import Behaviour, FakeReplica, SleepMode
from tests.conftest import StartFake
from tests.run.test_workers import children
from tests.support.clients import get_json, run_ctl
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for


@pytest.fixture
async def routers(tmp_path: Path) -> AsyncIterator[list[Serve]]:
    started = [Serve(tmp_path / "router-a.toml"), Serve(tmp_path / "router-b.toml")]
    yield started
    for serve in started:
        if serve.process is not None:
            serve.output()


async def state_of(serve: Serve, replica_id: str) -> str:
    rows = await get_json(serve.admin_url + "/api/v1/replicas")
    return next(str(r["state"]) for r in rows if r["id"] == replica_id)


def client(serve: Serve) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key="x", max_retries=0, timeout=10)


@contextlib.asynccontextmanager
async def workers_before(tmp_path: Path, fake: FakeReplica) -> AsyncIterator[Serve]:
    """`router serve --workers 2` in front of `fake` (replica r0 of model m, a vLLM engine), stopped
    and its output read at the end."""
    serve = Serve(tmp_path / "router.toml")
    serve.write([{"id": "r0", "model": "m", "url": fake.url, "engine": "vllm"}])
    await serve.start("--workers", "2")
    try:
        yield serve
    finally:
        serve.output()


async def start_both(routers: list[Serve], fake: FakeReplica) -> None:
    for serve in routers:
        serve.write([{"id": "r0", "model": "m", "url": fake.url, "engine": "vllm"}])
        await serve.start()


async def test_a_sleep_waits_for_the_other_routers_request_and_calls_the_engine_once(
    start_fake: StartFake, routers: list[Serve]
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=12, token_delay=0.05), sleep=SleepMode())
    assert fake.sleep is not None
    await start_both(routers, fake)
    a, b = routers
    # A request in flight through router b only: router a alone could not see it.
    async with client(b) as sdk:
        stream = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        first = await stream.__anext__()
        assert first.choices
        slept = asyncio.ensure_future(
            asyncio.to_thread(run_ctl, "sleep", "r0", "--server", a.admin_url, "--server", b.admin_url)
        )
        await wait_for(lambda: fake.active == 1 and not slept.done())
        # Both routers fence it while b's request runs; the engine is not called yet.
        for serve in routers:
            await wait_for_state(serve, "r0", ("draining", "drained"))
        assert fake.sleep.calls == []
        chunks = [chunk async for chunk in stream]
        assert chunks
    code, out = await asyncio.wait_for(slept, 20)
    assert (code, out.strip()) == (0, "r0: asleep (level 1)")
    assert fake.sleep.calls == ["sleep 1"]
    assert fake.sleep.busy_at_sleep == [0]
    assert [await state_of(serve, "r0") for serve in routers] == ["asleep", "asleep"]
    # Woken through both: one wake call, both ready, both serve.
    code, _ = await asyncio.to_thread(run_ctl, "wake", "r0", "--server", a.admin_url, "--server", b.admin_url)
    assert code == 0
    assert fake.sleep.calls == ["sleep 1", "wake_up"]
    for serve in routers:
        async with client(serve) as sdk:
            answer = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert answer.choices[0].message.content


async def wait_for_state(serve: Serve, replica_id: str, wanted: tuple[str, ...]) -> None:
    async def reached() -> bool:
        return await state_of(serve, replica_id) in wanted

    await until(reached, timeout=10, what=f"{replica_id} never {' or '.join(wanted)}")


async def test_with_workers_the_supervisor_fences_every_worker_and_calls_the_engine_once(
    start_fake: StartFake, tmp_path: Path
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=12, token_delay=0.03), sleep=SleepMode())
    assert fake.sleep is not None
    async with workers_before(tmp_path, fake) as serve, client(serve) as sdk:
        # Streams on their own connections: the kernel spreads them over both workers.
        streams = [
            await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": str(i)}], stream=True)
            for i in range(4)
        ]
        slept = asyncio.ensure_future(asyncio.to_thread(run_ctl, "sleep", "r0", "--server", serve.admin_url))
        await wait_for_state(serve, "r0", ("draining",))
        assert fake.sleep.calls == []
        for stream in streams:
            assert [chunk async for chunk in stream]
        code, out = await asyncio.wait_for(slept, 20)
        assert (code, out.strip()) == (0, "r0: asleep (level 1)")
        assert fake.sleep.calls == ["sleep 1"]
        assert fake.sleep.busy_at_sleep == [0]
        assert await state_of(serve, "r0") == "asleep"
        code, _ = await asyncio.to_thread(run_ctl, "wake", "r0", "--server", serve.admin_url)
        assert code == 0
        assert fake.sleep.calls == ["sleep 1", "wake_up"]
        assert await state_of(serve, "r0") == "ready"
        answer = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert answer.choices[0].message.content


async def test_with_workers_requests_on_both_wake_the_replica_with_one_call(
    start_fake: StartFake, tmp_path: Path
) -> None:
    gate = asyncio.Event()
    fake = await start_fake("m", sleep=SleepMode(wake_gate=gate))
    assert fake.sleep is not None
    async with workers_before(tmp_path, fake) as serve:
        code, _ = await asyncio.to_thread(run_ctl, "sleep", "r0", "--server", serve.admin_url)
        assert code == 0
        async with client(serve) as sdk:
            # Sixteen at once, each on a connection of its own: the kernel spreads them over both workers.
            asks = [
                asyncio.ensure_future(
                    sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": str(i)}])
                )
                for i in range(16)
            ]
            await wait_for(lambda: fake.sleep is not None and fake.sleep.calls == ["sleep 1", "wake_up"])
            gate.set()
            answers = await asyncio.gather(*asks)
        assert all(a.choices[0].message.content for a in answers)
        assert fake.sleep.calls == ["sleep 1", "wake_up"]
        # Both workers asked whether it was awake (each from its own connection); one alone called.
        assert len(set(fake.sleep.checks)) >= 2


async def test_a_worker_that_restarts_loads_the_replica_asleep(start_fake: StartFake, tmp_path: Path) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    async with workers_before(tmp_path, fake) as serve:
        assert serve.process is not None
        code, _ = await asyncio.to_thread(run_ctl, "sleep", "r0", "--server", serve.admin_url)
        assert code == 0
        os.kill(children(serve.process.pid)[0], signal.SIGKILL)
        await serve.says("restarting it")
        await wait_for(lambda: serve.process is not None and len(children(serve.process.pid)) == 2)

        async def merged_asleep() -> bool:
            # Both workers answer again, and both hold it asleep (the merge says asleep only then).
            try:
                return await state_of(serve, "r0") == "asleep"
            except aiohttp.ClientError:
                return False

        await until(merged_asleep, timeout=15, what="the restarted worker did not load r0 asleep")
        serve.signal(signal.SIGTERM)
        assert serve.process.wait(timeout=30) == 0


async def post_state(serve: Serve, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(serve.admin_url + "/api/v1/replicas/r0/state", json=body) as resp,
    ):
        return resp.status, await resp.json()


async def test_with_workers_a_second_sleep_or_a_ready_while_one_is_under_way_is_refused(
    start_fake: StartFake, tmp_path: Path
) -> None:
    fake = await start_fake("m", sleep=SleepMode(sleep_seconds=1.0))
    assert fake.sleep is not None
    async with workers_before(tmp_path, fake) as serve:
        slept = asyncio.ensure_future(post_state(serve, {"state": "asleep"}))
        await wait_for(lambda: fake.sleep is not None and fake.sleep.calls == ["sleep 1"])
        # As the single-process router answers: no second engine call, no ready racing the sleep.
        status, again = await post_state(serve, {"state": "asleep"})
        assert (status, again["error"]["code"]) == (409, "cannot_sleep")
        status, ready = await post_state(serve, {"state": "ready"})
        assert (status, ready["error"]["code"]) == (409, "sleep_under_way")
        status, answer = await asyncio.wait_for(slept, 20)
        assert (status, answer["state"]) == (200, "asleep")
        assert fake.sleep.calls == ["sleep 1"]
        assert await state_of(serve, "r0") == "asleep"


async def test_with_workers_a_sleep_the_workers_refuse_is_undone_and_refused(
    start_fake: StartFake, tmp_path: Path
) -> None:
    # The replica removed by a push while the engine's sleep call runs: every worker answers 404 to
    # "asleep". Not asleep anywhere, so the engine is woken again and the sleep refused, not reported done.
    fake = await start_fake("m", sleep=SleepMode(sleep_seconds=1.0))
    other = await start_fake("m")
    assert fake.sleep is not None
    async with workers_before(tmp_path, fake) as serve, aiohttp.ClientSession() as session:
        slept = asyncio.ensure_future(post_state(serve, {"state": "asleep"}))
        await wait_for(lambda: fake.sleep is not None and fake.sleep.calls == ["sleep 1"])
        replicas = {"replicas": [{"id": "r1", "model": "m", "url": other.url}]}
        async with session.put(serve.admin_url + "/api/v1/endpoints", json=replicas) as pushed:
            assert pushed.status == 200, await pushed.text()
        status, answer = await asyncio.wait_for(slept, 20)
        assert (status, answer["error"]["code"]) == (409, "cannot_sleep"), answer
        assert "a worker refused it (HTTP 404" in answer["error"]["message"]
        assert fake.sleep.calls == ["sleep 1", "wake_up"]
        assert not fake.sleep.sleeping


async def test_with_workers_a_worker_that_is_not_told_it_sleeps_has_the_sleep_undone(
    start_fake: StartFake, tmp_path: Path
) -> None:
    # A worker stopped while the engine's sleep call runs does not take the news (the supervisor's
    # call to it times out): the engine is woken again and every worker has the replica ready.
    fake = await start_fake("m", sleep=SleepMode(sleep_seconds=1.0))
    assert fake.sleep is not None
    async with workers_before(tmp_path, fake) as serve:
        assert serve.process is not None
        stopped = children(serve.process.pid)[0]
        slept = asyncio.ensure_future(post_state(serve, {"state": "asleep"}))
        await wait_for(lambda: fake.sleep is not None and fake.sleep.calls == ["sleep 1"])
        os.kill(stopped, signal.SIGSTOP)
        try:
            await wait_for(lambda: fake.sleep is not None and len(fake.sleep.calls) == 2, timeout=20)
        finally:
            os.kill(stopped, signal.SIGCONT)
        status, answer = await asyncio.wait_for(slept, 20)
        assert (status, answer["error"]["code"]) == (503, "workers_unavailable")
        assert "not put to sleep" in answer["error"]["message"]
        assert fake.sleep.calls == ["sleep 1", "wake_up"]
        assert not fake.sleep.sleeping
        await wait_for_state(serve, "r0", ("ready",))
        async with client(serve) as sdk:
            served = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert served.choices[0].message.content
