"""The gauges that say "now" read now: held and queued requests on /metrics between two usage ticks.

The router ticks once an hour here, so that a scrape showing the flood at
all shows what it read at the scrape; the usage map (made at the tick)
stays at its start-up figures meanwhile, which proves that no tick ran.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for

pytestmark = pytest.mark.slow

HOUR = 3600.0


async def gauge(session: aiohttp.ClientSession, serve: Serve, name: str) -> dict[tuple[str, ...], float]:
    """`name`'s samples on /metrics, parsed by prometheus_client, by label values."""
    async with session.get(serve.admin_url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        tuple(sample.labels.values()): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    }


async def usage_generated_at(session: aiohttp.ClientSession, serve: Serve) -> float:
    async with session.get(serve.admin_url + "/api/v1/usage") as resp:
        return float((await resp.json())["generated_at"])


def ask(serve: Serve) -> asyncio.Task[Any]:
    async def one() -> Any:
        async with openai.AsyncOpenAI(
            base_url=serve.client_url + "/v1", api_key="x", max_retries=0, timeout=60
        ) as client:
            return await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )

    return asyncio.create_task(one())


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one-process", "workers"])
async def test_held_requests_show_on_metrics_at_once_and_drop_when_served(
    serve: Serve, start_fake: StartFake, workers: tuple[str, ...]
) -> None:
    fake = await start_fake("m")
    serve.write([], "[models.m]\ncold_start_seconds = 60\nmax_held = 100", tick_seconds=HOUR)
    await serve.start(*workers)
    async with aiohttp.ClientSession() as session:
        started = await usage_generated_at(session, serve)
        tasks = [ask(serve) for _ in range(5)]

        async def five_held() -> bool:
            return (await gauge(session, serve, "router_held_requests")).get(("m",)) == 5.0

        await until(five_held, timeout=20, what="/metrics never showed the 5 held requests")
        # No tick ran: the usage map is the start-up one still.
        assert await usage_generated_at(session, serve) == started
        body = {"replicas": [{"id": "r0", "model": "m", "url": fake.url}]}
        async with session.put(serve.admin_url + "/api/v1/endpoints", json=body) as resp:
            assert resp.status == 200, await resp.text()
        for answer in await asyncio.gather(*tasks):
            assert answer.choices[0].message.content == "tok0 tok1 "
        # Served: the very next scrape says 0, the series kept (an empty queue is a fact).
        assert (await gauge(session, serve, "router_held_requests")) == {("m",): 0.0}
        assert await usage_generated_at(session, serve) == started


async def test_queued_requests_show_on_metrics_at_once_and_drop_as_the_queue_drains(
    serve: Serve, start_fake: StartFake
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(stall=True))
    serve.write(
        [{"id": "r0", "model": "m", "url": fake.url}],
        "max_in_flight_per_replica = 1\nqueue_timeout_seconds = 60",
        tick_seconds=HOUR,
    )
    await serve.start()
    async with aiohttp.ClientSession() as session:
        started = await usage_generated_at(session, serve)
        busy = ask(serve)
        await wait_for(lambda: len(fake.seen) == 1, timeout=20)
        fake.behaviour.stall = False
        tasks = [ask(serve) for _ in range(4)]
        key = ("m", "interactive", "default")

        async def queued(count: float) -> bool:
            return (await gauge(session, serve, "router_queued_requests")).get(key) == count

        await until(lambda: queued(4.0), timeout=20, what="/metrics never showed the 4 queued requests")
        assert await usage_generated_at(session, serve) == started
        # The stalled one's client leaves: its slot frees, and the queue drains one at a time.
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        await asyncio.gather(*tasks)
        assert (await gauge(session, serve, "router_queued_requests")) == {key: 0.0}
        assert await usage_generated_at(session, serve) == started
