"""Every headline feature end to end through `router serve`, as it ships: a process on uvloop, real clients.

Each test starts `router serve` as a subprocess (in `make test`'s second run,
the compiled build: what `pip install` gives wherever a compiler is) in
front of fake replicas, and drives it with the client its users drive it
with: the `openai` SDK, the `anthropic` SDK, aiohttp's WebSocket client,
and a control plane that answers a wake call by pushing the replica that
it started. Nothing here reaches into the router's process: what is judged
is what its clients and its admin API see.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
from aiohttp import web
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import StartFake
from tests.support.clients import get_json
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
HELLO: list[MessageParam] = [{"role": "user", "content": "hi"}]


def openai_sdk(serve: Serve, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key=key, max_retries=0, timeout=30)


async def push(serve: Serve, replicas: list[dict[str, Any]]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.put(serve.admin_url + "/api/v1/endpoints", json={"replicas": replicas}) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_a_chat_stream_with_the_openai_sdk(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=6))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start()
    async with openai_sdk(serve) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "
    (row,) = await get_json(serve.admin_url + "/api/v1/replicas")
    assert row["requests"] == 1 and row["last_used"] is not None


async def test_a_messages_stream_with_the_anthropic_sdk(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=4))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start()
    async with (
        anthropic.AsyncAnthropic(base_url=serve.client_url, api_key="unused", max_retries=0, timeout=30) as client,
        client.messages.stream(model="m", max_tokens=8, messages=HELLO) as stream,
    ):
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "text" and final.content[0].text == "tok0 tok1 tok2 tok3 "


async def test_a_websocket_session_carries_both_ways(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start()
    url = serve.client_url.replace("http://", "ws://") + "/v1/realtime?model=m"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        created = orjson.loads(await ws.receive_bytes(timeout=10))
        assert created["served_by"] == fake.name
        for i in range(5):
            await ws.send_str(f"message {i}")
            assert await ws.receive_str(timeout=10) == f"message {i}"
        (row,) = await get_json(serve.admin_url + "/api/v1/replicas")
        assert row["in_flight"] == 1
    await wait_for(lambda: fake.active == 0)


async def test_a_held_request_is_served_once_the_control_plane_answers_the_wake(serve: Serve) -> None:
    """A model at zero: the request is held, the router calls wake_url, the control plane starts a
    replica and pushes it, and the held request is answered by it."""
    started: list[FakeReplica] = []
    calls: list[dict[str, Any]] = []

    async def wake(request: web.Request) -> web.Response:
        calls.append(await request.json())
        if not started:
            fake = FakeReplica(models=("m",), name="woken")
            await fake.start()
            started.append(fake)
            await push(serve, [{"id": "r0", "model": "m", "url": fake.url}])
        return web.Response(status=202)

    app = web.Application()
    app.router.add_post("/wake", wake)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        serve.write([], f'wake_url = "http://{host}:{port}/wake"\n[models.m]\ncold_start_seconds = 30\nmax_held = 10')
        await serve.start()
        async with openai_sdk(serve) as client:
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        assert raw.parse().choices[0].message.content
        assert float(raw.headers["x-router-held-seconds"]) >= 0
        assert [call["model"] for call in calls] == ["m"]
        assert [seen.path for seen in started[0].seen] == ["/v1/chat/completions"]
    finally:
        for fake in started:
            await fake.stop()
        await runner.cleanup()


async def test_a_full_replica_serves_its_queue_by_class_before_arrival(serve: Serve, start_fake: StartFake) -> None:
    """One slot: a batch request queued first still goes after an interactive one queued behind it."""
    # Each answer takes half a second: long enough to queue the others behind it.
    fake = await start_fake("m", behaviour=Behaviour(tokens=2, first_token_delay=0.5))
    serve.write(
        [{"id": "r0", "model": "m", "url": fake.url}],
        "max_in_flight_per_replica = 1\n"
        '[api_keys.chat]\nkey = "sk-chat"\npriority = "interactive"\n'
        '[api_keys.nightly]\nkey = "sk-nightly"\npriority = "batch"\n',
    )
    await serve.start()

    async def ask(key: str, user: str) -> None:
        async with openai_sdk(serve, key) as client:
            await client.chat.completions.create(model="m", messages=MESSAGES, user=user)

    first = asyncio.create_task(ask("sk-nightly", "first"))
    await wait_for(lambda: fake.active == 1)
    batch = asyncio.create_task(ask("sk-nightly", "batch"))
    await queued(serve, 1)
    interactive = asyncio.create_task(ask("sk-chat", "interactive"))
    await queued(serve, 2)
    await asyncio.wait_for(asyncio.gather(first, batch, interactive), timeout=30)
    order = [orjson.loads(seen.body)["user"] for seen in fake.seen]
    assert order == ["first", "interactive", "batch"]


async def queued(serve: Serve, count: int) -> None:
    """Until the router says `count` requests wait in its queue."""

    async def queued_now() -> bool:
        status = await get_json(serve.admin_url + "/api/v1/status")
        return bool(sum(model["queued"] for model in status["models"]) == count)

    await until(queued_now, timeout=10, what=f"never {count} queued")


async def test_two_workers_serve_as_one_router(serve: Serve, start_fake: StartFake) -> None:
    """Sixteen streams, each on a connection of its own: the kernel spreads them over both workers,
    and the admin API counts them as one router's."""
    fake = await start_fake("m", behaviour=Behaviour(tokens=1000, token_delay=0.05))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start("--workers", "2")
    clients = [openai_sdk(serve) for _ in range(16)]
    streams = []
    try:
        streams += [
            await client.chat.completions.create(model="m", messages=MESSAGES, stream=True) for client in clients
        ]
        for stream in streams:
            await stream.__anext__()
        (row,) = await get_json(serve.admin_url + "/api/v1/replicas")
        assert row["in_flight"] == 16 and row["requests"] == 16
        async with aiohttp.ClientSession() as session, session.get(serve.admin_url + "/metrics") as resp:
            text = await resp.text()
        split = {
            sample.labels["worker"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "router_worker_in_flight_requests"
        }
        assert sorted(split) == ["0", "1"] and all(value > 0 for value in split.values()), split
    finally:
        for stream in streams:
            await stream.close()
        for client in clients:
            await client.close()
    await wait_for(lambda: fake.active == 0, timeout=10)


async def test_sigterm_lets_the_streams_in_flight_finish_and_exits_0(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=15, token_delay=0.05))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "shutdown_delay_seconds = 0")
    await serve.start()

    async def read_stream(client: openai.AsyncOpenAI, began: asyncio.Event) -> str:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        text = ""
        async for chunk in stream:
            began.set()
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        return text

    async with openai_sdk(serve) as client:
        starts = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(read_stream(client, began)) for began in starts]
        await asyncio.wait_for(asyncio.gather(*(began.wait() for began in starts)), timeout=10)
        serve.signal(signal.SIGTERM)
        texts = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
    assert texts == ["".join(f"tok{i} " for i in range(15))] * 3
    assert serve.process is not None
    assert await asyncio.to_thread(serve.process.wait, 15) == 0
