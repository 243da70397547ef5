"""The simulated engine of `router fake --engine`: batching, KV and prefix caches, its load in each engine's names.

The engine is run fast (`time_scale`): what is judged is its order of
events and its bookkeeping, which the routing benchmark stands on, and that
each engine's load comes out under the names and shapes that engine uses.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.tools.fake import Behaviour, FakeReplica
from router.tools.fake.engine import Engine, EngineParams, Sequence
from router.tools.fake.exposition import ENGINES
from tests.support.waiting import wait_for

FAST = 1000.0


async def drain(seq: Sequence) -> int:
    count = 0
    while await seq.tokens.get() is not None:
        count += 1
    return count


async def test_a_full_batch_queues_the_rest_first_come_first_served() -> None:
    engine = Engine(EngineParams(max_running=2, time_scale=FAST))
    try:
        seqs = [engine.submit(f"prompt {i} " * 10, 50) for i in range(4)]
        # Real time: the engine's batch step runs on its clock (scaled), not on an event.
        await asyncio.sleep(0.001)
        finished: list[int] = []

        async def watch(index: int) -> None:
            await drain(seqs[index])
            finished.append(index)

        await asyncio.gather(*(watch(i) for i in range(4)))
        # Two run at once; the two behind them start only as the first two end, in their order.
        assert finished[:2] == [0, 1] or finished[:2] == [1, 0]
        assert sorted(finished[2:]) == [2, 3]
        assert engine.report.finished == 4 and engine.report.generation_tokens == 200
    finally:
        await engine.close()


async def test_the_gauges_show_the_queue_and_the_batch_while_they_last() -> None:
    engine = Engine(EngineParams(max_running=3, time_scale=5.0))
    try:
        seqs = [engine.submit("x" * 400, 100_000) for _ in range(5)]
        await wait_for(lambda: engine.report.running == 3, timeout=1)
        assert engine.report.running == 3 and engine.report.waiting == 2
        assert 0 < engine.report.kv_usage < 1
        for seq in seqs:
            engine.abort(seq)
    finally:
        await engine.close()


async def test_a_request_the_batch_has_room_for_is_never_reported_waiting() -> None:
    # vLLM's scheduler takes what arrived into its next schedule before it reports: a request
    # arriving mid-step is running at the next reading, not queued (router/tools/fake/engine.py).
    engine = Engine(EngineParams(max_running=8, time_scale=2.0))
    seqs: list[Sequence] = []
    try:
        seqs.append(engine.submit("first " * 10, 100_000))
        await wait_for(lambda: engine.report.running == 1, timeout=2)
        seen: set[int] = set()
        for count in range(2, 6):
            seqs.append(engine.submit(f"next {count} " * 10, 100_000))
            # Every report between this arrival and its admission (each step is 5 ms of real time).
            deadline = asyncio.get_running_loop().time() + 2
            while engine.report.running < count and asyncio.get_running_loop().time() < deadline:
                seen.add(engine.report.waiting)
                await asyncio.sleep(0)
            assert engine.report.running == count
        assert seen == {0}
    finally:
        for seq in seqs:
            engine.abort(seq)
        await engine.close()


async def test_a_prompt_finds_the_blocks_of_a_prefix_another_prompt_left_behind() -> None:
    engine = Engine(EngineParams(time_scale=FAST))
    try:
        shared = "You are a careful assistant. " * 40
        first = engine.submit(shared + "first question", 5)
        await drain(first)
        second = engine.submit(shared + "second question", 5)
        await drain(second)
        block_chars = EngineParams().block_tokens * 4
        assert first.cached_tokens == 0
        # Every whole block of the shared part, and nothing of what differs.
        assert second.cached_tokens == (len(shared) // block_chars) * EngineParams().block_tokens
        assert engine.report.prefix_hits == second.cached_tokens
    finally:
        await engine.close()


async def test_running_out_of_kv_blocks_preempts_the_newest_and_everything_still_finishes() -> None:
    # Blocks for about two long sequences at once, four admitted on their prompts alone.
    engine = Engine(EngineParams(kv_blocks=40, block_tokens=16, max_running=8, time_scale=FAST))
    try:
        seqs = [engine.submit(f"{i}" * 160, 200) for i in range(4)]
        counts = await asyncio.gather(*(drain(seq) for seq in seqs))
        assert counts == [200, 200, 200, 200]
        assert engine.report.preemptions > 0
        assert engine.used_blocks == 0
    finally:
        await engine.close()


async def test_a_client_that_leaves_takes_its_sequence_and_blocks_out() -> None:
    engine = Engine(EngineParams(time_scale=10.0))
    try:
        seq = engine.submit("y" * 800, 10_000)
        await seq.tokens.get()
        assert engine.used_blocks > 0
        engine.abort(seq)
        assert engine.used_blocks == 0 and not engine.running
    finally:
        await engine.close()


@pytest.fixture
async def simulated() -> FakeReplica:
    fake = FakeReplica(models=("m",), behaviour=Behaviour(tokens=100_000))
    fake.engine = Engine(EngineParams(time_scale=FAST))
    return fake


@pytest.mark.parametrize(
    ("kind", "waiting", "running", "kv"),
    [
        ("vllm", "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
        ("sglang", "sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"),
        ("llamacpp", "llamacpp:requests_deferred", "llamacpp:requests_processing", None),
        ("tgi", "tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens"),
    ],
)
async def test_each_engine_reports_its_load_under_its_own_names(
    simulated: FakeReplica, kind: str, waiting: str, running: str, kv: str | None
) -> None:
    simulated.engine_kind = kind
    await simulated.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(simulated.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        names = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
        assert {waiting, running} <= names
        assert kv is None or kv in names
        assert kind in ENGINES
    finally:
        await simulated.stop()


async def test_vllm_reports_its_load_in_the_answer_when_asked_and_sglang_in_v1_loads(simulated: FakeReplica) -> None:
    await simulated.start()
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    try:
        async with aiohttp.ClientSession() as session:
            headers = {"endpoint-load-metrics-format": "TEXT"}
            async with session.post(simulated.url + "/v1/chat/completions", data=body, headers=headers) as resp:
                assert resp.status == 200
                orca = resp.headers["endpoint-load-metrics"]
            assert orca.startswith("TEXT named_metrics.kv_cache_usage_perc=")
            assert "named_metrics.num_requests_waiting=" in orca
            async with session.post(simulated.url + "/v1/chat/completions", data=body) as resp:
                assert "endpoint-load-metrics" not in resp.headers
            simulated.engine_kind = "sglang"
            async with session.get(simulated.url + "/v1/loads") as resp:
                loads = await resp.json()
        (load,) = loads["loads"]
        assert {"num_running_reqs", "num_waiting_reqs", "token_usage", "max_total_num_tokens"} <= set(load)
    finally:
        await simulated.stop()


async def test_an_answer_shorter_than_max_tokens_ends_with_stop(simulated: FakeReplica) -> None:
    simulated.behaviour.tokens = 3
    await simulated.start()
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10})
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(simulated.url + "/v1/chat/completions", data=body) as resp,
        ):
            doc = await resp.json()
        assert doc["choices"][0]["finish_reason"] == "stop"
        assert doc["usage"]["completion_tokens"] == 3
    finally:
        await simulated.stop()


async def test_vllm_answers_get_load_as_vllms_router_reads_it_and_other_engines_do_not() -> None:
    # vLLM's router (power_of_two) polls GET /get_load and reads the integer `load` of its JSON.
    fake = FakeReplica(models=("m",), behaviour=Behaviour(tokens=100_000))
    engine = fake.engine = Engine(EngineParams(max_running=2, time_scale=5.0))
    await fake.start()
    try:
        seqs = [engine.submit("z" * 400, 100_000) for _ in range(3)]
        await wait_for(lambda: engine.report.running == 2 and engine.report.waiting == 1, timeout=2)
        async with aiohttp.ClientSession() as session:
            async with session.get(fake.url + "/get_load") as resp:
                assert resp.status == 200
                assert resp.content_type == "application/json"
                assert await resp.json() == {"load": 3}
            for seq in seqs:
                engine.abort(seq)
            # Another engine's replica does not serve vLLM's router's endpoint.
            fake.engine_kind = "sglang"
            async with session.get(fake.url + "/get_load") as resp:
                assert resp.status == 404
    finally:
        await fake.stop()
