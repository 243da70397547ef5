"""Routing that sees the engines: readings of simulated engines under each engine's names, picks, and holds.

The replicas are `router fake` engines (router/tools/fake/engine.py) that
report their load as vLLM, SGLang, llama.cpp or TGI do; the router reads it
(router/control/engines.py, or vLLM's ORCA header) every 50 ms here. What is
judged is what the engines and the router's admin API show: a replica busy
with someone else's requests is passed over, a saturated model's requests
wait in the router and go as the engines free, and a reading no one renews
never holds a request.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from router.tools.fake.engine import Engine, EngineParams
from tests.conftest import StartRouter
from tests.support.clients import get_json
from tests.support.waiting import until, wait_for

FAST = 20.0
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def engines() -> Any:
    started: list[FakeReplica] = []

    async def start(kind: str = "vllm", **params: Any) -> FakeReplica:
        fake = FakeReplica(models=("m",), name=f"{kind}-{len(started)}", behaviour=Behaviour(tokens=100_000))
        fake.engine_kind = kind
        fake.engine = Engine(EngineParams(time_scale=params.pop("time_scale", FAST), **params))
        await fake.start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        await fake.stop()


def entry(rid: str, fake: FakeReplica) -> dict[str, Any]:
    return {"id": rid, "model": "m", "url": fake.url, "engine": fake.engine_kind}


async def rows(server: RouterServer) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in await get_json(server.admin_url + "/api/v1/replicas")}


def sdk(server: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp", "tgi"])
async def test_each_engines_load_is_read_under_its_own_names_while_its_model_is_busy(
    engines: Any, start_router: StartRouter, kind: str
) -> None:
    fake = await engines(kind, max_running=2)
    server = await start_router([entry("r0", fake)], engine_metrics_seconds=0.05, tick_seconds=0.05)
    async with sdk(server) as client:
        # Four long answers on an engine that runs two at a time: two wait in its queue.
        streams = [
            await client.chat.completions.create(model="m", messages=HI, max_tokens=2000, stream=True) for _ in range(4)
        ]
        try:
            await wait_for(lambda: fake.metrics_reads > 0, timeout=10)
            row: dict[str, Any] = {}

            async def busy() -> bool:
                nonlocal row
                row = (await rows(server))["r0"]
                load = row["engine_load"]
                return load is not None and load["running"] == 2 and load["waiting"] >= 1

            with contextlib.suppress(AssertionError):  # the assertions below say what was seen
                await until(busy, timeout=10)
            load = row["engine_load"]
            assert row["engine"] == kind
            assert load is not None and load["running"] == 2 and load["waiting"] >= 1, row
            assert load["source"] == ("loads" if kind == "sglang" else "metrics")
            assert load["age_seconds"] < 5
            assert (load["kv_cache_usage"] is None) == (kind == "llamacpp")
        finally:
            for stream in streams:
                await stream.close()
    # Reading is never a use: the stamps are the requests'.
    assert fake.seen and all(seen.path.startswith("/v1/chat/completions") for seen in fake.seen)


async def test_a_quiet_model_is_never_read(engines: Any, start_router: StartRouter) -> None:
    fake = await engines("vllm")
    server = await start_router([entry("r0", fake)], engine_metrics_seconds=0.05)
    await asyncio.sleep(0.5)  # ten rounds of the reader, with no traffic: real time is the point
    assert fake.metrics_reads == 0
    assert (await rows(server))["r0"]["engine_load"] is None


async def test_a_replica_busy_with_someone_elses_requests_is_passed_over(
    engines: Any, start_router: StartRouter
) -> None:
    """Another router (here: clients straight at the engine) fills one engine; this router's own counts are level."""
    busy, free = await engines("vllm", max_running=4), await engines("vllm", max_running=4)
    server = await start_router([entry("busy", busy), entry("free", free)], engine_metrics_seconds=0.05)
    async with aiohttp.ClientSession() as session:
        body = orjson.dumps({"model": "m", "messages": HI, "max_tokens": 5000, "stream": True})
        elsewhere = [await session.post(busy.url + "/v1/chat/completions", data=body) for _ in range(6)]
        try:
            async with sdk(server) as client:
                # A first request makes the model busy, so that its engines are read.
                await client.chat.completions.create(model="m", messages=HI, max_tokens=1)
                await wait_for(lambda: busy.metrics_reads > 0 and free.metrics_reads > 0, timeout=10)
                # Two rounds of readings after the first: the one read next is the one applied.
                read = (busy.metrics_reads, free.metrics_reads)
                await wait_for(lambda: busy.metrics_reads > read[0] + 1 and free.metrics_reads > read[1] + 1)
                before = {r.id: r.requests for r in server.pool}
                for _ in range(10):
                    await client.chat.completions.create(model="m", messages=HI, max_tokens=1)
            sent = {r.id: r.requests - before[r.id] for r in server.pool}
            assert sent == {"busy": 0, "free": 10}
        finally:
            for resp in elsewhere:
                resp.close()


async def test_a_saturated_model_waits_in_the_router_and_goes_as_the_engine_frees(
    engines: Any, start_router: StartRouter
) -> None:
    fake = await engines("vllm", max_running=1, time_scale=5.0)
    server = await start_router(
        [entry("r0", fake)],
        engine_metrics_seconds=0.05,
        tick_seconds=0.05,
        saturated_waiting=1,
        queue_timeout_seconds=60,
    )
    async with sdk(server) as client:
        first = await client.chat.completions.create(model="m", messages=HI, max_tokens=400, stream=True)
        await first.__anext__()
        second = asyncio.create_task(client.chat.completions.create(model="m", messages=HI, max_tokens=5))
        # The engine's queue reaches its bound: what comes next waits in the router.
        await wait_for(lambda: fake.engine is not None and fake.engine.report.waiting == 1, timeout=10)
        await wait_for(lambda: server.pool.saturated("m"), timeout=10)
        third = asyncio.create_task(client.chat.completions.create(model="m", messages=HI, max_tokens=5))
        await wait_for(lambda: server.pool.queued().get("m") == 1, timeout=10)
        status = await get_json(server.admin_url + "/api/v1/status")
        assert fake.engine is not None and fake.engine.report.waiting <= 1
        async for _ in first:
            pass
        done = await asyncio.wait_for(asyncio.gather(second, third), timeout=60)
        assert all(answer.choices[0].message.content for answer in done)
    assert any(m["model"] == "m" for m in status["models"])


async def test_a_reading_no_one_renews_never_holds_a_request(engines: Any, start_router: StartRouter) -> None:
    """The engine's page breaks while its model is saturated: the reading goes stale, and the request goes."""
    fake = await engines("vllm", max_running=1, time_scale=2.0)
    server = await start_router(
        [entry("r0", fake)], engine_metrics_seconds=0.05, saturated_waiting=1, queue_timeout_seconds=60
    )
    async with sdk(server) as client:
        # A long answer runs, a second waits in the engine's queue: the model is saturated.
        first = await client.chat.completions.create(model="m", messages=HI, max_tokens=5000, stream=True)
        await first.__anext__()
        second = asyncio.create_task(client.chat.completions.create(model="m", messages=HI, max_tokens=5))
        await wait_for(lambda: server.pool.saturated("m"), timeout=10)
        third = asyncio.create_task(client.chat.completions.create(model="m", messages=HI, max_tokens=5))
        await wait_for(lambda: server.pool.queued().get("m") == 1, timeout=10)
        # From now on its /metrics answers 500: no reading comes again, and the last goes stale.
        fake.engine_kind = "broken"
        await wait_for(lambda: len(fake.seen) == 3, timeout=10)
        assert not server.pool.queued().get("m")
        await first.close()
        for task in (second, third):
            task.cancel()
        await asyncio.gather(second, third, return_exceptions=True)


async def test_vllm_answers_carry_its_load_and_the_client_sees_no_header_it_did_not_ask_for(
    engines: Any, start_router: StartRouter
) -> None:
    fake = await engines("vllm")
    # Readings of the page every 10 s at most: what comes sooner came with an answer.
    server = await start_router([entry("r0", fake)], engine_metrics_seconds=10)
    async with aiohttp.ClientSession() as session:
        body = orjson.dumps({"model": "m", "messages": HI, "max_tokens": 2})
        async with session.post(server.client_url + "/v1/chat/completions", data=body) as resp:
            assert resp.status == 200
            assert "endpoint-load-metrics" not in resp.headers
        headers = {"endpoint-load-metrics-format": "json"}
        async with session.post(server.client_url + "/v1/chat/completions", data=body, headers=headers) as resp:
            # A client that asks gets the engine's own answer.
            assert resp.headers["endpoint-load-metrics"].startswith("JSON ")
    load = server.pool.get("r0")
    assert load is not None and load.load is not None and load.load.source == "orca"
    assert fake.metrics_reads == 0


async def test_an_answers_load_is_asked_for_once_the_reading_is_an_interval_old(
    engines: Any, start_router: StartRouter
) -> None:
    """A busy replica's answers come many a second: one reading an interval is enough, and reading
    each would cost every request the header's parse."""
    fake = await engines("vllm")
    server = await start_router([entry("r0", fake)], engine_metrics_seconds=10)

    def asked() -> int:
        return sum(1 for seen in fake.seen if "endpoint-load-metrics-format" in {k.lower() for k in seen.headers})

    async with aiohttp.ClientSession() as session:
        body = orjson.dumps({"model": "m", "messages": HI, "max_tokens": 2})
        for _ in range(5):
            async with session.post(server.client_url + "/v1/chat/completions", data=body) as resp:
                assert resp.status == 200
    replica = server.pool.get("r0")
    assert replica is not None and replica.load is not None and replica.load.source == "orca"
    assert asked() == 1
