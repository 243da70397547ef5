"""Engines whose load pages are broken or hostile: routing goes on by the router's own counts, and nothing breaks.

Each replica here answers its requests as an engine would, but its
`/metrics` (or SGLang's `/v1/loads`) is one of the ways a page goes wrong:
endless, cut off, too large, slow, garbage, numbers that are no count. The
router must keep serving the model, show the replica's load as unknown (no
reading), never log a failed round, and not hammer the page.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
import orjson
import pytest
from aiohttp import web

from router.control.engines import PAGE_BYTES
from router.core.pool.reports import from_metrics, from_orca, from_sglang_loads
from router.run.app import RouterServer
from tests.conftest import StartRouter
from tests.support.clients import get_json
from tests.support.waiting import wait_for

GAUGES = 'vllm:num_requests_waiting{{model_name="m"}} {w}\nvllm:num_requests_running{{model_name="m"}} 1\n'
KV = 'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'


async def endless(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    line = (GAUGES.format(w=0) + "# padding\n" * 100).encode()
    for _ in range(100_000):  # bounded: far past the router's bound, which must stop it first
        await resp.write(line)
    return resp


async def cut_off(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Length": "100000"})
    await resp.prepare(request)
    await resp.write(GAUGES.format(w=0).encode())
    assert request.transport is not None
    request.transport.close()
    return resp


async def slow(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"vllm:num_requests_waiting")
    await asyncio.Event().wait()  # never finishes: the router's timeout must
    return resp


def page(text: str, status: int = 200) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=text, status=status, content_type="text/plain")

    return answer


PAGES: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
    "endless": endless,
    "cut off": cut_off,
    "slow": slow,
    "too large": page(GAUGES.format(w=0) + KV.format(kv=0.5) + "#" * (PAGE_BYTES + 10)),
    "garbage": page("\x00\xff{{{ not a page }}}\nvllm:num_requests_waiting{ 3\n"),
    "NaN": page(GAUGES.format(w="NaN") + KV.format(kv=0.5)),
    "infinite": page(GAUGES.format(w="+Inf") + KV.format(kv=0.5)),
    "negative": page(GAUGES.format(w=-50) + KV.format(kv=0.5)),
    "not a number": page(GAUGES.format(w="lots") + KV.format(kv=0.5)),
    "500": page("internal error", status=500),
    "another engine's": page("# HELP foo\nfoo_bar 1\n"),
}


@pytest.fixture
async def hostile() -> AsyncIterator[Callable[[str], Awaitable[tuple[str, list[int]]]]]:
    runners: list[web.AppRunner] = []

    async def start(kind: str) -> tuple[str, list[int]]:
        """A vLLM-like replica whose /metrics is `kind`: its URL, and a counter of its /metrics reads."""
        reads = [0]
        broken = PAGES[kind]

        async def metrics(request: web.Request) -> web.StreamResponse:
            reads[0] += 1
            return await broken(request)

        async def chat(request: web.Request) -> web.Response:
            doc = {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            }
            return web.json_response(doc)

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}", reads

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize("kind", sorted(PAGES))
async def test_a_broken_load_page_leaves_routing_to_the_routers_own_counts(
    kind: str, hostile: Any, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    url, reads = await hostile(kind)
    server: RouterServer = await start_router(
        [{"id": "r0", "model": "m", "url": url, "engine": "vllm"}], engine_metrics_seconds=0.02
    )
    caplog.set_level(logging.ERROR, logger="router")
    async with openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        # Traffic makes the model busy, so its engine is read; every request is answered all the same.
        for _ in range(5):
            answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            assert answer.choices[0].message.content == "ok"
        await wait_for(lambda: reads[0] >= 1)
        await asyncio.sleep(0.3)  # fifteen read intervals, in which a page that failed is not read again
        answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert answer.choices[0].message.content == "ok"
    (row,) = await get_json(server.admin_url + "/api/v1/replicas")
    assert row["engine_load"] is None and row["saturated"] is False
    # A failed read waits seconds before the next, not an interval.
    assert reads[0] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_the_parsers_refuse_numbers_that_are_no_count() -> None:
    for waiting in ("NaN", "+Inf", "-Inf", "-1", "1e400"):
        assert from_metrics("vllm", (GAUGES.format(w=waiting) + KV.format(kv=0.5)).encode()) is None, waiting
    assert from_orca(b"TEXT named_metrics.num_requests_waiting=inf, named_metrics.kv_cache_usage_perc=0.5") is None
    assert from_orca(b"TEXT named_metrics.num_requests_waiting=-3") is None
    bad = orjson.dumps({"loads": [{"num_waiting_reqs": -1, "num_running_reqs": 2, "token_usage": 0.3}]})
    assert from_sglang_loads(bad) is None
    # A KV share past its bounds is clamped, not refused: engines round (vLLM's reads 1.0000001 at full).
    reading = from_metrics("vllm", (GAUGES.format(w=2) + KV.format(kv=1.5)).encode())
    assert reading is not None and reading.kv == 1.0 and reading.waiting == 2
