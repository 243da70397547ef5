"""Limits shared through a real `redis-server`: two routers, workers, Redis killed and restarted, hostile Redis fakes.

The routers are `router serve` processes, the clients the openai SDK (or a
plain HTTP client where the connection matters); Redis is Debian's
redis-server started per test on a Unix socket, or a fake on a raw socket
that answers garbage or nothing.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from router.core.config.limits import TenantLimit
from router.core.limits.buckets import Buckets
from router.gateway.redis_limits import SCRIPT, SHA
from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.clients import metric
from tests.support.processes import Serve
from tests.support.redis import fake_redis, need_redis, redis_server
from tests.support.waiting import until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT = orjson.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 4})


def config(redis_url: str, limits: str = "", extra: str = "", **key: int) -> str:
    line = "".join(f"{name} = {value}\n" for name, value in key.items())
    return (
        f'count_tokens = true\n{extra}[limits]\nredis_url = "{redis_url}"\n{limits}'
        f'[api_keys.alpha]\nkey = "sk-alpha"\ntenant = "a"\n{line}'
    )


def sdk(serve: Serve) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key="sk-alpha", max_retries=0, timeout=30)


async def serving(tmp_path: Path, name: str, fake_url: str, text: str, *args: str) -> Serve:
    serve = Serve(tmp_path / f"{name}.toml")
    serve.write([{"id": "r0", "model": "m", "url": fake_url}], text)
    await serve.start(*args)
    return serve


async def post_fresh(serve: Serve) -> tuple[int, Any]:
    """One request on a connection of its own (with --workers, any worker may take it)."""
    headers = {"Authorization": "Bearer sk-alpha", "Content-Type": "application/json", "Connection": "close"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(serve.client_url + "/v1/chat/completions", data=CHAT, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status, resp.headers


async def test_two_routers_share_one_tenants_limit_exactly(tmp_path: Path, start_fake: StartFake) -> None:
    need_redis()
    fake = await start_fake("m")
    async with redis_server(tmp_path) as redis:
        # In database 3 (SELECT once per connection).
        text = config(redis.url + "?db=3", requests_per_minute=4)
        routers = [await serving(tmp_path, name, fake.url, text) for name in ("a", "b")]
        try:
            remaining = []
            for i in range(4):
                async with sdk(routers[i % 2]) as client:
                    raw = await client.chat.completions.with_raw_response.create(
                        model="m", messages=MESSAGES, max_tokens=4
                    )
                    remaining.append(raw.headers["x-ratelimit-remaining-requests"])
            assert remaining == ["3", "2", "1", "0"]
            for serve in routers:
                async with sdk(serve) as client:
                    with pytest.raises(openai.RateLimitError) as refused:
                        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
                assert 14 <= int(refused.value.response.headers["retry-after"]) <= 15
            # One round trip per request: the script loaded once per router, each check one EVALSHA.
            for serve in routers:
                calls = await metric(serve.admin_url, "router_rate_limit_redis_calls_total")
                assert calls == {(("call", "check"),): 3.0, (("call", "load"),): 1.0, (("call", "select"),): 1.0}
            assert await redis.command(b"EXISTS", b"router:limits:a") == b":0\r\n"
            assert await redis.command(b"EXISTS", b"router:limits:a", db=3) == b":1\r\n"
        finally:
            for serve in routers:
                serve.output()


async def test_settlements_reach_redis_with_the_next_check_or_within_a_second(
    tmp_path: Path, start_fake: StartFake
) -> None:
    need_redis()
    fake = await start_fake("m", behaviour=Behaviour(tokens=16))
    async with redis_server(tmp_path) as redis:
        serve = await serving(tmp_path, "a", fake.url, config(redis.url, tokens_per_minute=300))
        try:
            async with sdk(serve) as client:
                await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100)
            estimate = len(fake.seen[-1].body) // 4 + 100

            async def settled() -> bool:
                reply = await redis.command(b"HGET", b"router:limits:a", b"t")
                level = float(reply.split(b"\r\n")[1])
                # Taken: the estimate, then given back all but the 20 the answer took (refilled 5 a second).
                assert level <= 300
                return level >= 300 - 20 - 1 and level < 300 - 20 + 10

            before = await redis.command(b"HGET", b"router:limits:a", b"t")
            assert float(before.split(b"\r\n")[1]) <= 300 - estimate + 5
            await until(settled, timeout=3, what="the settlement never reached Redis")
            calls = await metric(serve.admin_url, "router_rate_limit_redis_calls_total")
            assert calls == {(("call", "check"),): 1.0, (("call", "flush"),): 1.0, (("call", "load"),): 1.0}
            # Under load, settlements ride on the next check: at most one round trip per request, and a flush.
            async with sdk(serve) as client:
                for _ in range(20):
                    await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
            calls = await metric(serve.admin_url, "router_rate_limit_redis_calls_total")
            assert calls[(("call", "check"),)] == 21.0
            assert calls[(("call", "flush"),)] <= 3.0
        finally:
            serve.output()


async def test_with_workers_and_redis_a_limit_is_one_for_all_workers(tmp_path: Path, start_fake: StartFake) -> None:
    need_redis()
    fake = await start_fake("m")
    async with redis_server(tmp_path) as redis:
        serve = await serving(tmp_path, "w", fake.url, config(redis.url, requests_per_minute=5), "--workers", "2")
        try:
            statuses = [(await post_fresh(serve))[0] for _ in range(16)]
            assert statuses.count(200) == 5 and statuses.count(429) == 11
            # The supervisor sums its workers' counters.
            found = await metric(serve.admin_url, "router_rate_limited_total")
            assert found == {(("kind", "requests"), ("tenant", "a")): 11.0}
        finally:
            serve.output()


async def test_with_workers_in_memory_a_limit_is_per_worker(tmp_path: Path, start_fake: StartFake) -> None:
    fake = await start_fake("m")
    serve = Serve(tmp_path / "router.toml")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], '[api_keys.alpha]\nkey = "sk-alpha"\ntenant = "a"\n'
                "requests_per_minute = 3\n")  # fmt: skip
    await serve.start("--workers", "2")
    try:
        statuses = [(await post_fresh(serve))[0] for _ in range(24)]
        # Each worker has the whole limit: at least one limit's worth, at most one per worker.
        assert 3 <= statuses.count(200) <= 6
        assert statuses.count(200) + statuses.count(429) == 24
    finally:
        serve.output()


async def test_redis_killed_and_restarted_under_load_fails_open_then_recovers(
    tmp_path: Path, start_fake: StartFake
) -> None:
    need_redis()
    fake = await start_fake("m")
    async with redis_server(tmp_path) as redis:
        text = config(redis.url, "redis_timeout_seconds = 0.2\n", requests_per_minute=100_000)
        serve = await serving(tmp_path, "a", fake.url, text)
        statuses: list[int] = []
        checked: list[bool] = []
        stop = asyncio.Event()

        async def load() -> None:
            headers = {"Authorization": "Bearer sk-alpha", "Content-Type": "application/json"}
            url = serve.client_url + "/v1/chat/completions"
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    async with session.post(url, data=CHAT, headers=headers) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                        checked.append("x-ratelimit-remaining-requests" in resp.headers)

        try:
            clients = [asyncio.create_task(load()) for _ in range(4)]
            await until(lambda: asyncio.sleep(0, len(checked) > 20), timeout=10, what="no load")
            redis.kill()
            mark = len(checked)
            await until(lambda: asyncio.sleep(0, checked[mark:].count(False) > 20), timeout=10, what="not open")
            await redis.start()
            mark = len(checked)
            await until(lambda: asyncio.sleep(0, checked[mark:].count(True) > 20), timeout=10, what="no recovery")
            stop.set()
            await asyncio.gather(*clients)
            # Every request answered: fail open.
            assert set(statuses) == {200}
            unchecked = await metric(serve.admin_url, "router_rate_limit_unchecked_total")
            assert unchecked[(("outcome", "admitted"),)] == checked.count(False)
            errors = await metric(serve.admin_url, "router_rate_limit_redis_errors_total")
            assert errors.get((("reason", "connect"),), 0) + errors.get((("reason", "reset"),), 0) >= 1
            # Rate-limited: a line for the outage and one for the recovery, not one per request.
            out = serve.output()
            assert 1 <= out.count("unavailable (") <= 3
            assert "answers again" in out
        finally:
            stop.set()
            serve.output()


async def _hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(65536):
        pass
    writer.close()


def _answers(data: bytes) -> Any:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            writer.write(data)
        writer.close()

    return answer


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (_hangs, "timeout"),
        (_answers(b"HTTP/1.1 400 Bad Request\r\n\r\n"), "protocol"),
        (_answers(b"+OK\r\n"), "protocol"),
        (_answers(b"$999999999\r\n"), "protocol"),
        (_answers(b"*3\r\n:1\r\n"), "timeout"),
        (_answers(b"-ERR unknown command\r\n"), "error"),
    ],
    ids=["hangs", "http", "ok-to-all", "huge-bulk", "half-array", "errors"],
)
async def test_a_redis_that_hangs_or_answers_garbage_admits_unchecked_within_the_timeout(
    tmp_path: Path, start_fake: StartFake, answer: Any, reason: str
) -> None:
    fake = await start_fake("m")
    async with fake_redis(answer) as url:
        serve = await serving(
            tmp_path, "a", fake.url, config(url, "redis_timeout_seconds = 0.1\n", requests_per_minute=1)
        )
        try:
            async with sdk(serve) as client:
                for _ in range(5):
                    began = time.monotonic()
                    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
                    # Admitted unchecked, past the limit of 1, each within about one timeout.
                    assert "x-ratelimit-limit-requests" not in raw.headers
                    assert time.monotonic() - began < 2.0
            errors = await metric(serve.admin_url, "router_rate_limit_redis_errors_total")
            assert set(errors) == {(("reason", reason),)}
            assert (await metric(serve.admin_url, "router_rate_limit_unchecked_total")) == {
                (("outcome", "admitted"),): 5.0
            }
        finally:
            serve.output()


async def test_redis_unavailable_refuse_answers_503(tmp_path: Path, start_fake: StartFake) -> None:
    fake = await start_fake("m")
    async with fake_redis(_hangs) as url:
        limits = 'redis_timeout_seconds = 0.05\nredis_unavailable = "refuse"\n'
        serve = await serving(tmp_path, "a", fake.url, config(url, limits, requests_per_minute=10))
        try:
            async with sdk(serve) as client:
                with pytest.raises(openai.InternalServerError) as refused:
                    await client.chat.completions.create(model="m", messages=MESSAGES)
            assert refused.value.status_code == 503
            assert (await metric(serve.admin_url, "router_rate_limit_unchecked_total")) == {
                (("outcome", "refused"),): 1.0
            }
            assert fake.seen == []
        finally:
            serve.output()


async def test_the_script_decides_as_the_buckets_do_and_reloads_after_a_flush(
    tmp_path: Path, start_fake: StartFake
) -> None:
    need_redis()
    async with redis_server(tmp_path) as redis:
        # Directly: a slow refill (1 token and 1/60 request a second), the same costs through both.
        limit = TenantLimit(tokens_per_minute=60, requests_per_minute=4)
        buckets = Buckets({"a": limit}, time.monotonic)
        loaded = await redis.command(b"SCRIPT", b"LOAD", SCRIPT)
        assert loaded.split(b"\r\n")[1] == SHA
        for cost in (10, 30, 25, 5, 61, 1, 1):
            reply = await redis.command(b"EVALSHA", SHA, b"1", b"k", b"4", b"60", b"%d" % cost, b"1", b"0")
            verdict = buckets.admit("a", cost)
            kind, large, _, requests, tokens = (int(x[1:]) for x in reply.split(b"\r\n")[1:6])
            assert (kind == 0, large == 1) == (verdict.admitted, verdict.too_large), cost
            assert (requests // 1000, max(tokens // 1000, 0)) == (
                verdict.remaining_requests,
                verdict.remaining_tokens,
            ), cost
        # A flushed script cache: the router loads it again and goes on (NOSCRIPT).
        fake = await start_fake("m")
        serve = await serving(tmp_path, "a", fake.url, config(redis.url, requests_per_minute=100))
        try:
            async with sdk(serve) as client:
                await client.chat.completions.create(model="m", messages=MESSAGES)
                assert await redis.command(b"SCRIPT", b"FLUSH") == b"+OK\r\n"
                raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
                assert raw.headers["x-ratelimit-remaining-requests"] == "98"
            calls = await metric(serve.admin_url, "router_rate_limit_redis_calls_total")
            assert calls == {(("call", "check"),): 3.0, (("call", "load"),): 2.0}
        finally:
            serve.output()
