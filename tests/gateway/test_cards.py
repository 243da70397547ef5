"""Model cards: what the engines' own /v1/models say of a model (max_model_len, root, parent), through the router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from router.core.cards import Cards
from router.run.app import RouterServer
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.helpers import get_json, wait_for

VLLM_CARD = {"max_model_len": 8192, "root": "/models/Llama-3.1-8B-Instruct", "permission": [{"id": "p"}]}


def sdk(server: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=30)


def cards(server: RouterServer) -> Cards:
    assert server.proxy is not None
    return server.proxy.catalog.cards


def card_read(server: RouterServer, model: str) -> bool:
    return cards(server).get(model) is not None


async def test_the_catalog_carries_the_engines_card_for_the_model_and_its_alias(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("llama", card=VLLM_CARD)
    plain = await start_fake("tiny")  # as llama.cpp: a card with none of the fields
    server = await start_router(
        [replica_entry("r0", fake), replica_entry("r1", plain)],
        models={"llama": {"aliases": ["default"]}},
        model_cards=True,
    )
    await wait_for(lambda: card_read(server, "llama") and card_read(server, "tiny"))
    async with sdk(server) as client:
        listed = {model.id: model.model_dump(exclude_none=True) for model in (await client.models.list()).data}
        one = (await client.models.retrieve("llama")).model_dump(exclude_none=True)
        alias = (await client.models.retrieve("default")).model_dump(exclude_none=True)
    assert listed["llama"]["max_model_len"] == 8192 and listed["llama"]["root"] == "/models/Llama-3.1-8B-Instruct"
    assert one == listed["llama"] and "permission" not in one and "parent" not in one
    # An alias's card says what it resolves to.
    assert alias["parent"] == "llama" and alias["max_model_len"] == 8192 and alias["id"] == "default"
    # Fields an engine did not say are left out, never made up.
    assert set(listed["tiny"]) == {"id", "object", "created", "owned_by"}


async def test_a_readmitted_replicas_card_is_read_again(start_fake: StartFake, start_router: StartRouter) -> None:
    """A restarted engine may serve another max_model_len: read again when it comes back."""
    fake = await start_fake("llama", card={"max_model_len": 4096})
    other = await start_fake("llama", card={"max_model_len": 4096})
    server = await start_router([replica_entry("r0", fake), replica_entry("r1", other)], model_cards=True)
    await wait_for(lambda: card_read(server, "llama"))
    fake.card = other.card = {"max_model_len": 32768}
    replica = server.pool.get("r0")
    assert replica is not None and server.pool.try_eject(replica, "a test")
    server.pool.readmit(replica, "a test")
    await wait_for(lambda: (card := cards(server).get("llama")) is not None and card.max_model_len == 32768)
    doc = await get_json(server.client_url + "/v1/models/llama")
    assert doc["max_model_len"] == 32768


@pytest.fixture
async def stuck_models() -> AsyncIterator[str]:
    """An engine whose /v1/models never answers, and whose chat completions do."""

    async def never(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_get("/v1/models", never)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_a_card_that_is_not_read_never_holds_a_request(stuck_models: str, start_router: StartRouter) -> None:
    server = await start_router([{"id": "r0", "model": "m", "url": stuck_models, "labels": {}}], model_cards=True)
    assert server.cards is not None
    await wait_for(lambda: server.cards is not None and server.cards.reads >= 1)
    async with sdk(server) as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        listed = (await client.models.list()).data
    assert [model.model_dump(exclude_none=True) for model in listed] == [
        {"id": "m", "object": "model", "created": listed[0].created, "owned_by": "router"}
    ]


async def test_model_cards_off_reads_nothing(start_fake: StartFake, start_router: StartRouter) -> None:
    """model_cards = false: no replica sees a request the router did not forward."""
    fake = await start_fake("llama", card=VLLM_CARD)
    server = await start_router([replica_entry("r0", fake)], model_cards=False)
    assert server.cards is None
    doc = await get_json(server.client_url + "/v1/models/llama")
    assert "max_model_len" not in doc and fake.seen == []
