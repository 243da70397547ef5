"""Per-tenant limits through `router serve` as clients meet them: the openai and anthropic SDKs, in memory.

Limits hit (requests and tokens), OpenAI's x-ratelimit-* headers on every
answer to a limited tenant, Retry-After honoured by the SDK, estimates
settled with the answers' usage, shadow mode, the Anthropic path's own error,
and hostile bounds (huge, negative, fractional max_tokens).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.clients import metric
from tests.support.processes import Serve

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def keys(**limits: int) -> str:
    """Tenant a (limited as told, two keys) and tenant b (not limited)."""
    extra = "".join(f"{name} = {value}\n" for name, value in limits.items())
    return (
        f'[api_keys.alpha]\nkey = "sk-alpha"\ntenant = "a"\n{extra}'
        f'[api_keys.alpha2]\nkey = "sk-alpha2"\ntenant = "a"\n'
        '[api_keys.beta]\nkey = "sk-beta"\ntenant = "b"\n'
    )


def sdk(serve: Serve, key: str = "sk-alpha", retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key=key, max_retries=retries, timeout=30)


async def started(serve: Serve, start_fake: StartFake, config: str, **behaviour: Any) -> Any:
    fake = await start_fake("m", behaviour=Behaviour(**behaviour))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], config)
    await serve.start()
    return fake


async def test_a_request_limit_refuses_the_next_with_429_and_tells_every_answer_where_it_stands(
    serve: Serve, start_fake: StartFake
) -> None:
    await started(serve, start_fake, keys(requests_per_minute=3))
    async with sdk(serve) as client, sdk(serve, "sk-alpha2") as other_key, sdk(serve, "sk-beta") as unlimited:
        remaining = []
        for c in (client, other_key, client):
            raw = await c.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=4)
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            assert "x-ratelimit-limit-tokens" not in raw.headers  # not limited by tokens
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
            reset = raw.headers["x-ratelimit-reset-requests"]
            assert reset.endswith("s") and float(reset.rstrip("ms")) > 0
        # Both keys of the tenant share its limit.
        assert remaining == ["2", "1", "0"]
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        error = refused.value
        assert error.code == "rate_limit_exceeded"
        assert error.type == "requests"
        headers = error.response.headers
        # One request every 20 s: the next in about 20.
        assert 19 <= int(headers["retry-after"]) <= 20
        assert 19_000 <= int(headers["retry-after-ms"]) <= 20_000
        assert headers["x-ratelimit-remaining-requests"] == "0"
        # Another tenant is not limited, and gets no headers.
        raw = await unlimited.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        assert "x-ratelimit-limit-requests" not in raw.headers
    assert await metric(serve.admin_url, "router_rate_limited_total") == {(("kind", "requests"), ("tenant", "a")): 1.0}


async def test_the_sdk_honours_retry_after_and_gets_through(serve: Serve, start_fake: StartFake) -> None:
    await started(serve, start_fake, keys(requests_per_minute=120))
    async with sdk(serve) as client, sdk(serve, retries=2) as patient:
        for _ in range(200):
            try:
                await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
            except openai.RateLimitError as exc:
                wait_ms = int(exc.response.headers["retry-after-ms"])
                break
        else:
            raise AssertionError("never limited")
        assert 0 < wait_ms <= 500
        began = time.monotonic()
        # The SDK waits retry-after-ms, then is admitted.
        answer = await patient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
        assert answer.choices[0].message.content
        assert time.monotonic() - began >= wait_ms / 1000 * 0.9


def _tokens_config(tpm: int, extra: str = "") -> str:
    return f"count_tokens = true\n[limits]\nunbounded_output_tokens = 50\n{extra}" + keys(tokens_per_minute=tpm)


async def test_tokens_are_estimated_on_admission_and_settled_with_the_answers_usage(
    serve: Serve, start_fake: StartFake
) -> None:
    # 60,000 per minute refill 1,000 a second: the figures are read to within what a few ms refill.
    fake = await started(serve, start_fake, _tokens_config(60_000), tokens=16)
    async with sdk(serve) as client:
        first = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=16)
        estimate = len(fake.seen[-1].body) // 4 + 16
        assert first.headers["x-ratelimit-limit-tokens"] == "60000"
        assert 60_000 - estimate - 1 <= int(first.headers["x-ratelimit-remaining-tokens"]) <= 60_000 - estimate
        # The answer took 4 + 16: the rest of the estimate came back when it ended.
        used = first.parse().usage
        assert used is not None and used.total_tokens == 20
        # A stream without usage says nothing of its tokens: its estimate is kept.
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, stream=True)
        async for _ in stream:
            pass
        kept = len(fake.seen[-1].body) // 4 + 16
        # The next request sees both: 20 taken by the first, the whole estimate by the stream.
        third = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=16)
        third_estimate = len(fake.seen[-1].body) // 4 + 16
        remaining = int(third.headers["x-ratelimit-remaining-tokens"])
        expected = 60_000 - 20 - kept - third_estimate
        # Refilled meanwhile (1,000 a second; a busy machine may take a few): never more than full.
        assert expected <= remaining <= min(expected + 3000, 60_000 - third_estimate)
        assert third.headers["x-ratelimit-reset-tokens"].endswith("ms")


async def test_a_token_limit_refuses_until_the_refill_and_a_stream_admitted_runs_to_its_end(
    serve: Serve, start_fake: StartFake
) -> None:
    await started(serve, start_fake, _tokens_config(300), tokens=200)
    async with sdk(serve) as client:
        # Estimated at 250 and more: admitted; it takes 200 + 4.
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=250, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 200
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=200)
        assert refused.value.type == "tokens"
        # About 100 remain, the request needs about 215 at 5 a second: some 20 s.
        assert 15 <= int(refused.value.response.headers["retry-after"]) <= 30


async def test_hostile_output_bounds_are_estimated_safely(serve: Serve, start_fake: StartFake) -> None:
    fake = await started(serve, start_fake, _tokens_config(60_000))
    async with sdk(serve) as client:
        with pytest.raises(openai.RateLimitError) as huge:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10**18)
        assert "Request too large" in huge.value.message
        headers = huge.value.response.headers
        assert "retry-after" not in headers and headers["x-should-retry"] == "false"
        seen = len(fake.seen)
        for bad in (-5, 16.5, "16"):
            # Never a credit: an unusable bound is the default of 50; the engine judges the request.
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=MESSAGES, extra_body={"max_tokens": bad}
            )
            estimate = len(fake.seen[-1].body) // 4 + 50
            assert int(raw.headers["x-ratelimit-remaining-tokens"]) <= 60_000 - estimate
        assert len(fake.seen) == seen + 3


async def test_shadow_mode_counts_and_logs_but_never_refuses_nor_adds_headers(
    serve: Serve, start_fake: StartFake
) -> None:
    await started(serve, start_fake, '[limits]\nmode = "shadow"\n' + keys(requests_per_minute=1))
    async with sdk(serve) as client:
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=1)
            assert "x-ratelimit-limit-requests" not in raw.headers
    assert await metric(serve.admin_url, "router_rate_limited_shadow_total") == {
        (("kind", "requests"), ("tenant", "a")): 2.0
    }
    assert await metric(serve.admin_url, "router_rate_limited_total") == {}
    assert "tenant a over its requests per minute limit (1; requested 1); shadow mode: let through" in serve.output()


async def test_the_anthropic_path_refuses_with_its_own_rate_limit_error(serve: Serve, start_fake: StartFake) -> None:
    await started(serve, start_fake, keys(requests_per_minute=1))
    async with anthropic.AsyncAnthropic(
        base_url=serve.client_url, api_key="sk-alpha", max_retries=0, timeout=30
    ) as claude:
        raw = await claude.messages.with_raw_response.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hello"}]
        )
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(anthropic.RateLimitError) as refused:
            await claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hello"}])
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert int(refused.value.response.headers["retry-after"]) >= 59


async def test_sighup_reads_the_limits_again_and_a_changed_tenant_starts_full(
    serve: Serve, start_fake: StartFake
) -> None:
    fake = await started(serve, start_fake, keys(requests_per_minute=1))
    async with sdk(serve) as client:
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
        serve.write([{"id": "r0", "model": "m", "url": fake.url}], keys(requests_per_minute=5))
        serve.signal(signal.SIGHUP)
        await serve.says("reloaded api_keys")
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=1)
        assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == ("5", "4")
