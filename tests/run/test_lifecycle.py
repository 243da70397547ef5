"""`router serve` as a real process: graceful SIGTERM, SIGHUP reload."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import orjson
import pytest

from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.clients import CHAT
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for


async def endpoints(serve: Serve) -> Any:
    async with aiohttp.ClientSession() as session, session.get(serve.admin_url + "/api/v1/endpoints") as resp:
        return await resp.json()


@pytest.mark.slow
async def test_sigterm_finishes_streams_in_flight_then_exits_0(
    serve: Serve, start_fake: StartFake, receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, received, _ = receiver
    fake = await start_fake("m", behaviour=Behaviour(tokens=25, token_delay=0.04))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], f'usage_push_url = "{url}"\nshutdown_delay_seconds = 0')
    await serve.start()
    async with aiohttp.ClientSession() as session:
        stream = await session.post(
            serve.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        await stream.content.readany()
        signalled = time.time()
        serve.signal(signal.SIGTERM)

        async def unready() -> bool:
            async with session.get(serve.admin_url + "/readyz") as resp:
                return resp.status == 503

        await until(unready)
        async with session.get(serve.admin_url + "/readyz") as resp:
            assert resp.status == 503
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as fresh:
                await fresh.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT))
        body = await stream.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert body.count(b"tok") == 25
    assert serve.process is not None
    assert serve.process.wait(timeout=15) == 0
    final = received[-1]
    assert final["generated_at"] > signalled
    assert "r0" in final["last_used"]


@pytest.mark.slow
async def test_sigterm_ends_what_outlives_the_grace_and_cancels_it_upstream(
    serve: Serve, start_fake: StartFake
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=1000, token_delay=0.02))
    serve.write(
        [{"id": "r0", "model": "m", "url": fake.url}], "shutdown_grace_seconds = 0.5\nshutdown_delay_seconds = 0"
    )
    await serve.start()
    async with aiohttp.ClientSession() as session:
        stream = await session.post(
            serve.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        await stream.content.readany()
        began = time.monotonic()
        serve.signal(signal.SIGTERM)
        assert serve.process is not None
        assert await asyncio.to_thread(serve.process.wait, 15) == 0
        assert time.monotonic() - began < 5
        with pytest.raises(aiohttp.ClientPayloadError):
            await stream.read()
    await wait_for(lambda: fake.cancelled == 1)


@pytest.mark.slow
async def test_sighup_reloads_the_replicas_and_a_bad_file_changes_nothing(serve: Serve, start_fake: StartFake) -> None:
    a = await start_fake("m")
    b = await start_fake("m")
    serve.write([{"id": "a", "model": "m", "url": a.url}], "shutdown_delay_seconds = 0")
    await serve.start()
    serve.write(
        [{"id": "a", "model": "m", "url": a.url}, {"id": "b", "model": "m", "url": b.url}], "shutdown_delay_seconds = 0"
    )
    serve.signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return [r["id"] for r in (await endpoints(serve))["replicas"]] == ["a", "b"]

    await until(reloaded, timeout=10)
    serve.path.write_text(serve.path.read_text() + "colour = 'red'\n")
    serve.signal(signal.SIGHUP)
    await serve.says("reload refused, nothing changed")
    assert [r["id"] for r in (await endpoints(serve))["replicas"]] == ["a", "b"]
    serve.signal(signal.SIGTERM)
    assert serve.process is not None
    assert serve.process.wait(timeout=15) == 0
    out = serve.output()
    assert "reload refused, nothing changed" in out
    assert "colour: unknown key" in out


async def test_a_config_without_replicas_starts_ready_and_a_push_fills_it(serve: Serve, start_fake: StartFake) -> None:
    """No replicas is a valid start (the push API or discovery fills the set): ready, models 404 until then."""
    fake = await start_fake("m")
    serve.write([], "shutdown_delay_seconds = 0")
    await serve.start()  # waits for /readyz 200
    async with aiohttp.ClientSession() as session:
        async with session.get(serve.admin_url + "/readyz") as resp:
            assert resp.status == 200
        async with session.get(serve.client_url + "/v1/models") as resp:
            assert (await resp.json())["data"] == []
        async with session.post(serve.client_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "model_not_found"
        replica = {"id": "a", "model": CHAT["model"], "url": fake.url}
        async with session.put(serve.admin_url + "/api/v1/endpoints", json={"replicas": [replica]}) as resp:
            assert resp.status == 200
        async with session.post(serve.client_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
    serve.signal(signal.SIGTERM)
    assert serve.process is not None
    assert serve.process.wait(timeout=15) == 0


async def test_router_serve_says_where_it_listens_at_any_log_level(serve: Serve, start_fake: StartFake) -> None:
    """On port 0 its ports are known only from its output: at `--log-level warning` (the benchmarks') it says them."""
    fake = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start("--log-level", "warning")
    async with (
        aiohttp.ClientSession() as session,
        session.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
    ):
        assert resp.status == 200
    output = serve.output()
    assert (
        f"INFO router.listening: router listening on {serve.client_url} (clients) and {serve.admin_url} (admin)"
        in output
    )
    # The rest of the info lines stay quiet, as asked.
    assert [line for line in output.splitlines() if " INFO " in line and "router.listening" not in line] == []
