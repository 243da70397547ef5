"""Tokens counted through `router serve` as its users drive it: the openai and anthropic SDKs, /metrics, status, top.

Every answer shape the router reads usage from (a whole chat answer, a chat
stream that asked for its usage, the Responses API's stream, Anthropic's
Messages stream) against fake replicas that say their usage as vLLM does;
what the SDKs get is what the replica sent, and the counts are read the way
an operator reads them: Prometheus text, GET /api/v1/status, `router ctl top`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.clients import get_json, run_ctl
from tests.support.processes import Serve
from tests.support.waiting import until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
HELLO: list[MessageParam] = [{"role": "user", "content": "hello there router"}]
KEYS = '[api_keys.alpha]\nkey = "sk-alpha"\ntenant = "a"\n[api_keys.beta]\nkey = "sk-beta"\ntenant = "b"\n'


def openai_sdk(serve: Serve, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key=key, max_retries=0, timeout=30)


async def token_samples(serve: Serve, completion: int) -> dict[tuple[str, str, str], float]:
    """router_tokens_total by (model, tenant, kind), once the completion tokens add up to `completion`."""
    found: dict[tuple[str, str, str], float] = {}

    async def added_up() -> bool:
        nonlocal found
        async with aiohttp.ClientSession() as session, session.get(serve.admin_url + "/metrics") as resp:
            text = await resp.text()
        found = {
            (s.labels["model"], s.labels["tenant"], s.labels["kind"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "router_tokens_total"
        }
        return sum(v for (_, _, kind), v in found.items() if kind == "completion") >= completion

    await until(added_up, timeout=10, what=f"the tokens never added up to {completion}")
    return found


async def test_every_answer_shape_through_the_sdks_is_counted_by_tenant(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=5))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "count_tokens = true\n" + KEYS)
    await serve.start()
    async with openai_sdk(serve, "sk-alpha") as client:
        whole = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5)
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        async with client.responses.stream(model="m", input="hi", max_output_tokens=2) as events:
            async for _ in events:
                pass
            response = await events.get_final_response()
    # What the SDKs read is the replica's own usage, passed untouched.
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert response.usage is not None and response.usage.output_tokens == 2
    async with (
        anthropic.AsyncAnthropic(base_url=serve.client_url, api_key="sk-beta", max_retries=0, timeout=30) as claude,
        claude.messages.stream(model="m", max_tokens=4, messages=HELLO) as messages,
    ):
        final = await messages.get_final_message()
    assert final.usage.input_tokens == 3 and final.usage.output_tokens == 4
    found = await token_samples(serve, completion=5 + 3 + 2 + 4)
    assert found == {
        # Two chat answers of 4 prompt tokens each and a response of 4 input tokens.
        ("m", "a", "prompt"): 12,
        ("m", "a", "cached"): 0,
        ("m", "a", "completion"): 10,
        # Anthropic's message_start (three words, the fake's count) and message_delta.
        ("m", "b", "prompt"): 3,
        ("m", "b", "cached"): 0,
        ("m", "b", "completion"): 4,
    }
    status = await get_json(serve.admin_url + "/api/v1/status")
    assert [(t["tenant"], t["prompt_tokens"], t["completion_tokens"]) for t in status["tenants"]] == [
        ("a", 12, 10),
        ("b", 3, 4),
    ]
    code, out = await asyncio.to_thread(run_ctl, "top", "--once", "--interval", "0.1", "--server", serve.admin_url)
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.startswith("TENANT"))
    assert header.split() == ["TENANT", "TOK/S", "PROMPT", "CACHED", "COMPLETION", "UNKNOWN"]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["a"], ["b"])}
    assert rows["a"][2:] == ["12", "0", "10", "0"] and rows["b"][2:] == ["3", "0", "4", "0"]


async def test_a_stream_that_did_not_ask_for_usage_gets_none_and_is_unknown(
    serve: Serve, start_fake: StartFake
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=3))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "count_tokens = true\n" + KEYS)
    await serve.start()
    async with openai_sdk(serve, "sk-alpha") as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert "stream_options" not in json.loads(fake.seen[-1].body)
    status: dict[str, Any] = {}

    async def counted() -> bool:
        nonlocal status
        status = await get_json(serve.admin_url + "/api/v1/status")
        return bool(status["tenants"])

    await until(counted, timeout=10, what="the status never showed the tenant")
    assert status["tenants"] == [
        {"tenant": "a", "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "unknown_requests": 1}
    ]


async def test_with_two_workers_the_supervisor_sums_every_workers_tokens(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=2))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "count_tokens = true\n" + KEYS)
    await serve.start("--workers", "2")
    # Each request on its own connection, so that both workers take some.
    for _ in range(12):
        async with openai_sdk(serve, "sk-alpha") as client:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    found = await token_samples(serve, completion=24)
    assert found == {("m", "a", "prompt"): 48, ("m", "a", "cached"): 0, ("m", "a", "completion"): 24}
