"""Tenants' shares of a full model counted in tokens, through `router serve` and the openai SDK.

Two tenants of equal weight wait for one slot: one sends long prompts, the
other short ones. Counted in requests they alternate; counted in tokens each
gets the slot for about as many tokens as the other (docs/fairness.md), so
the short-prompt tenant gets about cost(long) / cost(short) requests through
for each long one, the counts bounded by one turn (QUANTUM_TOKENS) and one request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest

from router.core.config.tenants import QUANTUM_TOKENS
from router.tools.fake import FakeReplica
from tests.conftest import StartFake
from tests.support.clients import metrics, samples
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for

LONG = "L" * 2000
KEYS = """
[api_keys.long]
key = "sk-long"
tenant = "long"
[api_keys.short]
key = "sk-short"
tenant = "short"
"""


def estimate(body: bytes) -> int:
    """The router's estimate of a request (docs/fairness.md): its bytes / 4, plus 4 x max_tokens an answer."""
    parsed = orjson.loads(body)
    return (len(body) >> 2) + 4 * int(parsed["max_tokens"]) * int(parsed.get("n", 1))


async def queued(serve: Serve, tenant: str, count: int) -> None:
    async def there() -> bool:
        found = samples(await metrics(serve.admin_url), "router_queued_requests")
        return found.get((("model", "m"), ("priority", "interactive"), ("tenant", tenant))) == count

    await until(there, timeout=20, what=f"{count} of {tenant}'s requests never queued")


async def saturated(
    serve: Serve, fake: FakeReplica, settings: str, long: int, short: int, answers: int = 1
) -> tuple[list[str], list[bytes]]:
    """Two tenants queued behind one stalled request, `long` then `short` requests: whose each request
    reaching the replica was, in order, and its body. `answers` > 1: the long tenant's requests are
    short prompts that ask for that many answers each (`n`), where otherwise their prompts are long."""
    serve.write(
        [{"id": "r0", "model": "m", "url": fake.url}],
        f"max_in_flight_per_replica = 1\nqueue_timeout_seconds = 60\nmodel_cards = false\n{settings}\n{KEYS}",
    )
    await serve.start()
    url = serve.client_url + "/v1"
    async with (
        openai.AsyncOpenAI(base_url=url, api_key="sk-long", max_retries=0) as long_client,
        openai.AsyncOpenAI(base_url=url, api_key="sk-short", max_retries=0) as short_client,
    ):

        def ask(client: openai.AsyncOpenAI, content: str, n: int = 1) -> asyncio.Task[Any]:
            return asyncio.create_task(
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": content}], max_tokens=2, n=n
                )
            )

        fake.behaviour.stall = True
        busy = ask(short_client, "busy")
        await wait_for(lambda: len(fake.seen) == 1, timeout=10)
        tasks = [ask(long_client, LONG if answers == 1 else "many", answers) for _ in range(long)]
        await queued(serve, "long", long)
        tasks += [ask(short_client, f"s{i}") for i in range(short)]
        await queued(serve, "short", short)
        fake.behaviour.stall = False
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        for answer in await asyncio.gather(*tasks):
            assert answer.choices[0].message.content == "tok0 tok1 "
    bodies = [seen.body for seen in fake.seen[1:]]
    sent = [orjson.loads(body)["messages"][0]["content"] for body in bodies]
    return ["short" if content.startswith("s") else "long" for content in sent], bodies


@pytest.mark.parametrize(
    ("unit", "answers"),
    [("requests", 1), ("tokens", 1), ("tokens", 64)],
    ids=["requests", "tokens-long-prompts", "tokens-many-answers"],
)
async def test_the_short_prompt_tenant_gets_as_many_more_requests_through_as_the_long_ones_cost(
    start_fake: StartFake, serve: Serve, unit: str, answers: int
) -> None:
    """The long tenant's requests cost more by their prompts, or by the answers they ask for (`n`,
    each a bound's worth of output, as the limits count it)."""
    fake = await start_fake("m")
    order, bodies = await saturated(serve, fake, f'fairness_unit = "{unit}"', long=4, short=48, answers=answers)
    if unit == "requests":
        # One each, in turn, while both wait: the long prompts' cost counts for nothing.
        assert order[:8] == ["long", "short"] * 4
        return
    cost = {tenant: estimate(body) for tenant, body in zip(order, bodies, strict=True)}
    assert cost["long"] > 15 * cost["short"]
    # While both wait, their tokens served differ by at most a turn and a request.
    last_long = max(i for i, tenant in enumerate(order) if tenant == "long")
    for end in range(1, last_long + 1):
        served = order[:end]
        tokens = {t: served.count(t) * cost[t] for t in ("long", "short")}
        assert abs(tokens["long"] - tokens["short"]) <= QUANTUM_TOKENS + cost["long"], (end, served)
    # So about cost(long) / cost(short) short requests for each long one: here 40-odd before the second.
    second = [i for i, tenant in enumerate(order) if tenant == "long"][1]
    assert second >= QUANTUM_TOKENS // cost["short"] - 2


async def test_usage_settles_the_estimate_when_tokens_are_counted(start_fake: StartFake, serve: Serve) -> None:
    """The fake answers that each request took 4 prompt tokens and 2 out: once settled, the long
    prompts cost what the short ones do, and the long tenant's turn pays for all four of them."""
    fake = await start_fake("m")
    order, _ = await saturated(serve, fake, 'fairness_unit = "tokens"\ncount_tokens = true', long=4, short=48)
    assert order[:4] == ["long"] * 4


async def test_a_mistyped_unit_is_one_line_with_what_it_means(serve: Serve) -> None:
    serve.write([], 'fairness_unit = "token"')
    with pytest.raises(AssertionError):
        await serve.start()
    out = serve.output()
    assert "fairness_unit: unknown value 'token' (known: requests, tokens); did you mean 'tokens'?" in out
