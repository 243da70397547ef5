"""Model cards: what the engines' own /v1/models say of a model (max_model_len, root, parent), through the router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from router.control.cards import CARD_BYTES
from router.core.config.cards import MAX_ROOT_CHARS, Cards
from router.run.app import RouterServer
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import get_json
from tests.support.waiting import wait_for
from tests.support.wire import Exchange, StartRaw, chunk, json_answer

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
    assert replica is not None and server.pool.ejections.try_eject(replica, "a test")
    server.pool.ejections.readmit(replica, "a test")
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


async def test_an_endless_models_answer_is_cut_off_and_no_card_is_kept(
    start_router: StartRouter, start_raw: StartRaw
) -> None:
    """A replica that never ends its /v1/models: the read stops at CARD_BYTES (before: 646 MB of RSS in 4.5 s)."""
    sent = [0]

    async def endless(exchange: Exchange) -> None:
        await exchange.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = chunk(b'{"data": [' + b" " * 65536)
        with contextlib.suppress(ConnectionError):
            while sent[0] < 64 * CARD_BYTES:
                await exchange.write(piece)
                sent[0] += len(piece)
        exchange.close()

    replica = await start_raw(endless)
    server = await start_router([{"id": "r0", "model": "m", "url": replica.url}], model_cards=True)
    await wait_for(lambda: server.cards is not None and server.cards.reads == 1 and server.cards.pending == 1)
    await wait_for(lambda: not replica.handlers, timeout=10)
    assert sent[0] < 8 * CARD_BYTES
    assert cards(server).get("m") is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("root", "/models/" + "x" * (MAX_ROOT_CHARS + 1)), ("parent", "p" * 300), ("root", "/models/a\x1b[2Jb")],
    ids=["root-8-MiB", "parent-past-a-name", "root-with-a-control-byte"],
)
async def test_a_card_field_past_its_bound_is_left_out_of_every_clients_models(
    start_fake: StartFake, start_router: StartRouter, field: str, value: str
) -> None:
    fake = await start_fake("llama", card={"max_model_len": 8192, field: value})
    server = await start_router([replica_entry("r0", fake)], model_cards=True)
    await wait_for(lambda: card_read(server, "llama"))
    doc = await get_json(server.client_url + "/v1/models/llama")
    assert doc["max_model_len"] == 8192 and field not in doc


async def test_a_redirect_from_a_replicas_models_is_not_followed(
    start_router: StartRouter, start_raw: StartRaw
) -> None:
    """The router never fetches a URL a replica names, nor serves what it finds there."""
    card = b'{"data": [{"id": "llama", "max_model_len": 8192, "root": "/from/elsewhere"}]}'
    elsewhere = await start_raw(lambda exchange: exchange.write(json_answer(card)))

    async def redirect(exchange: Exchange) -> None:
        await exchange.write(
            b"HTTP/1.1 302 Found\r\nLocation: %b/v1/models\r\nContent-Length: 0\r\n\r\n" % elsewhere.url.encode()
        )

    replica = await start_raw(redirect)
    server = await start_router([{"id": "r0", "model": "llama", "url": replica.url}], model_cards=True)
    await wait_for(lambda: server.cards is not None and server.cards.reads == 1 and server.cards.pending == 1)
    assert len(replica.requests) == 1 and elsewhere.requests == []
    assert cards(server).get("llama") is None


async def test_a_replica_whose_read_failed_is_read_again_only_once_it_shows_life(
    start_router: StartRouter, start_raw: StartRaw
) -> None:
    """A replica down or cold is never polled: its card is looked for again once a request has reached it."""

    async def loading_models(exchange: Exchange) -> None:
        if exchange.head.startswith(b"GET /v1/models"):
            await exchange.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        else:
            await exchange.write(json_answer())

    replica = await start_raw(loading_models)
    server = await start_router([{"id": "r0", "model": "m", "url": replica.url}], model_cards=True)
    reader = server.cards
    assert reader is not None
    await wait_for(lambda: reader.reads == 1 and reader.pending == 1)
    # However long it has been, with no sign of life: not due, and looked for later still.
    later = asyncio.get_running_loop().time() + 100_000
    assert reader.due(later) == []
    assert reader.pending == 1
    async with sdk(server) as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    (due,) = reader.due(later + 2 * reader.retry_cap)
    assert due.id == "r0"
    # Read, it fails again, and waits for the next sign of life.
    assert not await reader.read(due)
