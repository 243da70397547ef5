"""Session routing that reads the engines, through `router serve` in front of simulated vLLM engines.

A session stays on the replica whose prefix cache holds its conversation
while that engine takes more, above the ring's bounded load (two replicas:
blind session routing spills a session's third request at once), and goes
elsewhere once the engine says it is saturated (its queue at the model's
bound). The router is a real process; the engines (router/tools/fake/engine.py)
answer its reads of their /metrics every 50 ms.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from router.tools.fake import Behaviour, FakeReplica
from router.tools.fake.engine import Engine, EngineParams
from tests.support.clients import get_json
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello again"}]


@pytest.fixture
async def engines() -> Any:
    started: list[FakeReplica] = []

    async def start(count: int, **params: Any) -> list[FakeReplica]:
        for _ in range(count):
            fake = FakeReplica(models=("m",), name=f"e{len(started)}", behaviour=Behaviour(tokens=100_000))
            fake.engine = Engine(EngineParams(time_scale=20.0, **params))
            await fake.start()
            started.append(fake)
        return started

    yield start
    for fake in started:
        await fake.stop()


async def serving(serve: Serve, fakes: list[FakeReplica], waiting: int = 10) -> openai.AsyncOpenAI:
    replicas = [{"id": fake.name, "model": "m", "url": fake.url, "engine": "vllm"} for fake in fakes]
    serve.write(
        replicas,
        "engine_metrics_seconds = 0.05\nexpose_replica_header = true\nmodel_cards = false\n"
        f'[models."m"]\nrouting = "session"\nsaturated_waiting = {waiting}\n',
    )
    await serve.start()
    client = openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key="x", max_retries=0, timeout=60)
    # A first request makes the model busy, so that its engines are read; then two rounds of reads.
    await client.chat.completions.create(model="m", messages=HI, max_tokens=1, extra_headers={"X-Session-Id": "w"})
    await wait_for(lambda: all(fake.metrics_reads > 2 for fake in fakes), timeout=10)
    return client


async def opened(client: openai.AsyncOpenAI, session: str) -> tuple[str, AsyncStream[ChatCompletionChunk]]:
    """A long stream of `session`, under way: the replica that serves it, and the stream to close."""
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=HI, max_tokens=5000, stream=True, extra_headers={"X-Session-Id": session}
    )
    return raw.headers["x-router-replica"], raw.parse()


async def test_a_session_stays_on_its_replica_past_the_bounded_load_while_its_engine_takes_more(
    serve: Serve, engines: Any
) -> None:
    fakes = await engines(2)
    client = await serving(serve, fakes)
    streams: list[AsyncStream[ChatCompletionChunk]] = []
    try:
        served = []
        for _ in range(6):
            replica, stream = await opened(client, "conversation-1")
            served.append(replica)
            streams.append(stream)
        assert len(set(served)) == 1, served
    finally:
        for stream in streams:
            await stream.close()
        await client.close()


async def test_a_session_leaves_its_replica_once_its_engine_is_saturated(serve: Serve, engines: Any) -> None:
    # One sequence at a time per engine, and a queue of one saturates it.
    fakes = await engines(2, max_running=1)
    client = await serving(serve, fakes, waiting=1)
    streams: list[AsyncStream[ChatCompletionChunk]] = []
    try:
        home, stream = await opened(client, "conversation-2")
        streams.append(stream)
        # The next of the session waits in its engine's queue: the session's replica still.
        again, stream = await opened(client, "conversation-2")
        streams.append(stream)
        assert again == home

        async def saturated() -> bool:
            rows = {row["id"]: row for row in await get_json(serve.admin_url + "/api/v1/replicas")}
            return bool(rows[home]["saturated"])

        await until(saturated, timeout=10, what="no reading said the engine was queueing")
        elsewhere, stream = await opened(client, "conversation-2")
        streams.append(stream)
        assert elsewhere != home
    finally:
        for stream in streams:
            await stream.close()
        await client.close()
