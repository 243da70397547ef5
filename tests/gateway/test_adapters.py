"""LoRA adapters: a request naming one reaches only the replicas whose engine lists it in /v1/models."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from router.core.config.cards import MAX_ADAPTERS, adapters_of
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.waiting import wait_for


def sdk(server: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=30)


def asked(fake: FakeReplica, model: str) -> int:
    """Requests `fake` got that named `model`."""
    return sum(1 for seen in fake.seen if seen.body and json.loads(seen.body).get("model") == model)


def listed(server: RouterServer, adapter: str) -> bool:
    return server.pool.adapters.base_of(adapter) is not None


async def test_an_adapters_requests_reach_only_the_replicas_that_list_it(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    with_sql = await start_fake("llama", adapters=["sql-lora"])
    plain = [await start_fake("llama") for _ in range(2)]
    server = await start_router(
        [replica_entry("r0", with_sql), replica_entry("r1", plain[0]), replica_entry("r2", plain[1])],
        model_cards=True,
    )
    await wait_for(lambda: listed(server, "sql-lora"))
    async with sdk(server) as client:
        for _ in range(6):
            answer = await client.chat.completions.create(
                model="sql-lora", messages=[{"role": "user", "content": "select"}]
            )
            # Sent under the adapter's name, which the engine applies and answers under.
            assert answer.model == "sql-lora"
        for _ in range(6):
            await client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}])
        catalog = {m.id: m.model_dump(exclude_none=True) for m in (await client.models.list()).data}
        one = (await client.models.retrieve("sql-lora")).model_dump(exclude_none=True)
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(model="no-such-lora", messages=[{"role": "user", "content": "x"}])
    assert asked(with_sql, "sql-lora") == 6 and all(asked(fake, "sql-lora") == 0 for fake in plain)
    assert sum(asked(fake, "llama") for fake in (with_sql, *plain)) == 6
    assert catalog["sql-lora"]["parent"] == "llama" and one == catalog["sql-lora"]
    assert "parent" not in catalog["llama"]
    assert unknown.value.code == "model_not_found"


async def test_an_adapter_loaded_or_unloaded_at_run_time_is_found_while_the_replica_has_traffic(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # Answers that take a moment, so that requests at once overlap.
    fakes = [await start_fake("llama", behaviour=Behaviour(first_token_delay=0.05)) for _ in range(2)]
    server = await start_router([replica_entry(f"r{i}", fake) for i, fake in enumerate(fakes)], model_cards=True)
    assert server.cards is not None
    await wait_for(lambda: server.cards is not None and server.cards.reads >= 2)
    server.cards.refresh = 0.1
    # vLLM's /v1/load_lora_adapter on one engine: found once that replica has had a request since.
    fakes[1].adapters.append("new-lora")
    async with sdk(server) as client:

        async def busy() -> None:
            # Requests at once, so that least-loaded sends some to each replica.
            ask = client.chat.completions.create
            await asyncio.gather(*(ask(model="llama", messages=[{"role": "user", "content": "hi"}]) for _ in range(8)))
            assert all(asked(fake, "llama") for fake in fakes)

        await busy()
        await wait_for(lambda: listed(server, "new-lora"))
        for _ in range(3):
            await client.chat.completions.create(model="new-lora", messages=[{"role": "user", "content": "x"}])
        assert asked(fakes[1], "new-lora") == 3 and asked(fakes[0], "new-lora") == 0
        # Unloaded: no replica lists it any more, and it is unknown again.
        fakes[1].adapters.clear()
        await busy()
        await wait_for(lambda: not listed(server, "new-lora"))
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="new-lora", messages=[{"role": "user", "content": "x"}])


async def test_an_adapters_replicas_all_gone_is_a_503_that_names_the_adapter(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    with_sql = await start_fake("llama", adapters=["sql-lora"])
    plain = await start_fake("llama")
    server = await start_router([replica_entry("r0", with_sql), replica_entry("r1", plain)], model_cards=True)
    await wait_for(lambda: listed(server, "sql-lora"))
    server.pool.set_draining("r0", True)
    async with sdk(server) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "x"}])
    # Never sent to the replica without it, nor to another model: no fallback answers as the adapter.
    assert refused.value.status_code == 503 and "sql-lora" in refused.value.message
    assert asked(plain, "sql-lora") == 0


def test_only_entries_whose_parent_is_the_replicas_model_are_its_adapters() -> None:
    doc = {
        "data": [
            {"id": "llama", "parent": None},
            {"id": "sql-lora", "parent": "llama"},
            {"id": "other-lora", "parent": "mistral"},
            {"id": 7, "parent": "llama"},
            {"id": "bad\nname", "parent": "llama"},
            {"id": "x" * 300, "parent": "llama"},
            "not an entry",
        ]
    }
    assert adapters_of(doc, "llama") == {"sql-lora"}
    assert adapters_of({"data": "x"}, "llama") == frozenset() == adapters_of([], "llama")
    many = {"data": [{"id": f"a{i}", "parent": "llama"} for i in range(MAX_ADAPTERS + 50)]}
    assert len(adapters_of(many, "llama")) == MAX_ADAPTERS
