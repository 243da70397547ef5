"""Per-tenant limits at their edges, through `router serve`: a client that leaves before its answer,
paths that generate nothing, an upstream that limits too, and a reload the process cannot apply.

Each was a way to spend a tenant's tokens without paying for them, or to tell the client two
things at once.
"""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import StartFake
from tests.limits.test_limits_served import MESSAGES, keys, sdk, started
from tests.support.processes import Serve
from tests.support.waiting import until

# 60,000 a minute refill 1,000 a second: a kept estimate of 5,000 and more stands out of what
# a few seconds refill.
_TPM = 60_000
_COUNTING = "count_tokens = true\n"


async def _idle(serve: Serve) -> bool:
    """Nothing in flight at the router: a request its client left has been let go (and settled)."""
    async with aiohttp.ClientSession() as http, http.get(serve.admin_url + "/api/v1/replicas") as resp:
        replicas = orjson.loads(await resp.read())
    return all(r["in_flight"] == 0 for r in replicas)


async def test_a_client_that_leaves_after_its_request_went_out_keeps_the_estimate_taken(
    serve: Serve, start_fake: StartFake
) -> None:
    """The engine may have prefilled and written most of it: what it took is unknown, and unknown is not zero."""
    fake = await started(serve, start_fake, _COUNTING + keys(tokens_per_minute=_TPM), first_token_delay=2.0)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8000}
    url = serve.client_url + "/v1/chat/completions"
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-alpha"}) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=0.5))
        assert len(fake.seen) == 1
        left = len(fake.seen[-1].body) // 4 + 8000
        await until(lambda: _idle(serve), what="the request its client left is still in flight")
        fake.behaviour.first_token_delay = 0.0
        async with http.post(url, json=dict(body, max_tokens=10)) as raw:
            assert raw.status == 200
            remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
    estimate = len(fake.seen[-1].body) // 4 + 10
    # Refilled meanwhile (1,000 a second), but never the 8,000 the left request was estimated at.
    assert remaining <= _TPM - left - estimate + 4000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"model": "m", "input": "hi"}),
    ],
)
async def test_a_path_that_generates_nothing_is_estimated_at_its_input(
    serve: Serve, start_fake: StartFake, path: str, body: dict[str, object]
) -> None:
    """No unbounded output on a token count or an embedding: a tenant of 1,000 a minute is not refused
    as too large, and its bucket loses about a request's bytes, not the 1,024 of a generation."""
    await started(serve, start_fake, _COUNTING + keys(tokens_per_minute=1000))
    headers = {"Authorization": "Bearer sk-alpha", "x-api-key": "sk-alpha", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for _ in range(5):
            async with http.post(serve.client_url + path, json=body) as raw:
                assert raw.status == 200, await raw.text()
                remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
    assert remaining >= 1000 - 5 * (len(orjson.dumps(body)) // 4 + 4)


async def test_the_tenants_ratelimit_headers_replace_an_upstreams_own(serve: Serve, start_fake: StartFake) -> None:
    """Behind an upstream that limits too, the client gets one value of each header: the router's, for its tenant."""
    upstream = {
        "x-ratelimit-limit-requests": "10000",
        "x-ratelimit-remaining-requests": "9999",
        "x-ratelimit-reset-requests": "6ms",
        "x-ratelimit-limit-tokens": "2000000",
    }
    await started(serve, start_fake, keys(requests_per_minute=3), extra_headers=upstream)
    async with sdk(serve) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=1)
        stream = await client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, max_tokens=1, stream=True
        )
        async for _ in stream.parse():
            pass
    for answer, remaining in ((raw, "2"), (stream, "1")):
        assert answer.headers.get_list("x-ratelimit-remaining-requests") == [remaining]
        assert answer.headers.get_list("x-ratelimit-limit-requests") == ["3"]
        # The tenant is limited by requests alone: the upstream's token header goes, none takes its place.
        assert "x-ratelimit-limit-tokens" not in answer.headers


async def test_sighup_refuses_a_token_limit_this_process_cannot_settle(serve: Serve, start_fake: StartFake) -> None:
    """Started without counting, the router reads no usage: a key given tokens_per_minute is refused with the file."""
    fake = await started(serve, start_fake, keys(requests_per_minute=100))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], _COUNTING + keys(tokens_per_minute=1200))
    serve.signal(signal.SIGHUP)
    await serve.says("a key sets tokens_per_minute, and this router reads no usage")
    async with sdk(serve) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=500)
    # The keys as they were: limited by requests, no token limit taken on.
    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    assert "x-ratelimit-limit-tokens" not in raw.headers


async def test_sighup_says_that_a_changed_limits_table_waits_for_a_restart(serve: Serve, start_fake: StartFake) -> None:
    fake = await started(serve, start_fake, keys(requests_per_minute=100))
    serve.write(
        [{"id": "r0", "model": "m", "url": fake.url}], '[limits]\nmode = "shadow"\n' + keys(requests_per_minute=1)
    )
    serve.signal(signal.SIGHUP)
    await serve.says("changed [limits]")
    async with sdk(serve) as client:
        # The tenant's new limit is taken on (a full bucket of 1); the mode waits: still enforced.
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)


async def test_sighup_says_that_a_first_tenant_limit_waits_for_a_restart(serve: Serve, start_fake: StartFake) -> None:
    fake = await started(serve, start_fake, keys())
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], keys(requests_per_minute=1))
    serve.signal(signal.SIGHUP)
    await serve.says("limits tenants a, and this router started with no tenant limited")
    async with sdk(serve) as client:
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=1)
            assert "x-ratelimit-limit-requests" not in raw.headers


async def test_an_image_whose_bytes_pass_the_limit_is_taken_as_the_whole_bucket(
    serve: Serve, start_fake: StartFake
) -> None:
    """A base64 image is thousands of tokens by its bytes and about a thousand to the engine: admitted
    once the bucket is full, taking all of it until its usage settles, never refused as too large."""
    fake = await started(serve, start_fake, _COUNTING + keys(tokens_per_minute=100_000))
    image = "data:image/png;base64," + "A" * 500_000
    async with sdk(serve) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m",
            max_tokens=16,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}],
        )
    assert raw.status_code == 200 and len(fake.seen) == 1
    # Its debit was the whole bucket (125,000 by its bytes): nothing remained as it was admitted.
    assert raw.headers["x-ratelimit-remaining-tokens"] == "0"
