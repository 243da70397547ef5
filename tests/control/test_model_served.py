"""A replica whose engine does not serve the model the router sends it: said, and refused by the fake as vLLM does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import openai
import pytest

from router.core.config.cards import lists_model
from router.run.app import RouterServer
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import get_json, run_ctl, samples, scrape
from tests.support.waiting import until, wait_for

# What vLLM answers when started without --served-model-name: its listing names the weights' path.
UNNAMED = {"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B-Instruct", "owned_by": "vllm"}]}


def test_a_listing_that_names_the_model_serves_it() -> None:
    doc = {"data": [{"id": "llama", "owned_by": "vllm"}, {"id": "sql-lora", "parent": "llama"}]}
    assert lists_model(doc, "llama", "vllm") is True


def test_a_vllm_listing_without_the_model_does_not_serve_it() -> None:
    assert lists_model(UNNAMED, "llama-3.1-8b", "vllm") is False
    # An engine not recognised is taken at its listing's word.
    assert lists_model(UNNAMED, "llama-3.1-8b", None) is False


def test_engines_that_answer_under_any_name_or_no_listing_say_nothing() -> None:
    assert lists_model({"data": [{"id": "/models/tiny.gguf"}]}, "tiny", "llamacpp") is None
    assert lists_model({"data": [{"id": "x"}]}, "tiny", "tgi") is None
    assert lists_model({"error": "no"}, "tiny", "vllm") is None
    assert lists_model([], "tiny", "vllm") is None


Rows = dict[str, dict[str, object]]


async def replicas(server: RouterServer) -> Rows:
    return {row["id"]: row for row in await get_json(server.admin_url + "/api/v1/replicas")}


async def replicas_when(server: RouterServer, condition: Callable[[Rows], bool]) -> Rows:
    """/api/v1/replicas once `condition` holds of it (the usage tick publishes what the cards said)."""
    rows: Rows = {}

    async def holds() -> bool:
        nonlocal rows
        rows = await replicas(server)
        return condition(rows)

    await until(holds, what="/api/v1/replicas never showed it")
    return rows


async def test_a_replica_that_does_not_list_its_model_is_said_in_every_view(
    start_fake: StartFake, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    """The log once, /api/v1/replicas, the metric, /api/v1/status and ctl status."""
    good = await start_fake("llama")
    unnamed = await start_fake("meta-llama/Llama-3.1-8B-Instruct")
    caplog.set_level(logging.INFO, logger="router.control.cards")
    server = await start_router(
        [replica_entry("good", good), replica_entry("unnamed", unnamed, model="llama")],
        model_cards=True,
        tick_seconds=0.05,
    )
    rows = await replicas_when(
        server, lambda rows: rows["unnamed"]["serves_model"] is False and rows["good"]["serves_model"] is True
    )
    assert rows["unnamed"]["serves_model"] is False and rows["good"]["serves_model"] is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unnamed" in warnings[0] and "--served-model-name llama" in warnings[0]
    # /metrics shows the last tick's snapshot, the admin API one taken now: a tick later at most.
    missing: dict[tuple[tuple[str, str], ...], float] = {}

    async def scraped() -> bool:
        nonlocal missing
        missing = samples(await scrape(server), "router_replicas_not_serving_model")
        return bool(missing)

    await until(scraped, what="/metrics never said it")
    assert missing == {(("model", "llama"),): 1.0}
    status = await get_json(server.admin_url + "/api/v1/status")
    assert status["not_serving"] == [{"id": "unnamed", "model": "llama", "url": unnamed.url}]
    code, out = await asyncio.to_thread(run_ctl, "status", "--server", server.admin_url)
    assert code == 0 and "not serving their model" in out and "unnamed" in out.split("not serving")[1]
    # Read again (it had traffic since), still missing: no second warning.
    cards = server.cards
    replica = server.pool.get("unnamed")
    assert cards is not None and replica is not None
    cards.refresh = 0
    async with aiohttp.ClientSession() as session:
        while replica.requests == 0:
            async with session.post(
                server.client_url + "/v1/chat/completions",
                json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
            ) as resp:
                await resp.read()
    await wait_for(lambda: cards._read_with.get(replica) == replica.requests)
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1


async def test_a_replica_not_read_yet_says_null(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("llama")
    server = await start_router([replica_entry("r0", fake)], tick_seconds=0.05)
    await wait_for(lambda: True, 0.1)
    assert (await replicas(server))["r0"]["serves_model"] is None
    assert samples(await scrape(server), "router_replicas_not_serving_model") == {}


async def test_the_fake_refuses_a_model_it_does_not_serve_as_vllm_does(start_fake: StartFake) -> None:
    fake = await start_fake("llama", adapters=["sql-lora"])
    async with openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="llama-3.1-8b", messages=[{"role": "user", "content": "hi"}])
        # Its models and its LoRA adapters are served.
        for model in ("llama", "sql-lora"):
            answer = await client.completions.create(model=model, prompt="hi", max_tokens=2)
            assert answer.choices
    assert caught.value.status_code == 404
    assert caught.value.body == {
        "message": "The model `llama-3.1-8b` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


async def test_the_fake_answers_a_request_naming_no_model(start_fake: StartFake) -> None:
    """vLLM serves its first model when the request names none (serving_engine.py, _is_model_supported)."""
    fake = await start_fake("llama")
    async with (
        aiohttp.ClientSession() as session,
        session.post(fake.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp,
    ):
        assert resp.status == 200
