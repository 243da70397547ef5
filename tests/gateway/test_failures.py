"""The data path when replicas fail, through real sockets: retries, fallbacks, errors, clients that leave, timeouts.

A replica that refuses, answers 503 or an error, is killed, resets a stream
or sends nothing: the client gets the next replica's answer, an OpenAI-shaped
error, or a stream ended by an error event, promptly, and the replica is freed.
The data path when all goes well is test_proxy.py's.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import orjson
import pytest

from router.tools.fake import Behaviour
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, in_flight, post, post_cut
from tests.support.waiting import wait_for


async def test_503_from_a_replica_is_retried_on_another(start_fake: StartFake, start_router: StartRouter) -> None:
    loading = await start_fake("m", behaviour=Behaviour(fail_status=503, fail_body=b'{"message": "Loading model"}'))
    healthy = await start_fake("m")
    server = await start_router([replica_entry("bad", loading), replica_entry("good", healthy)])
    sent = 0
    # Ties are broken at random: send until the loading one has been tried.
    while not loading.seen or sent < 6:
        status, headers, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
        assert headers["X-Served-By"] == healthy.name
        sent += 1
        assert sent < 200
    assert len(healthy.seen) == sent
    assert server.pool.tallies.retries.get("m", 0) == len(loading.seen)


async def test_connection_refused_is_retried_on_another_replica(
    start_fake: StartFake, start_router: StartRouter, refused_url: RefusedUrl
) -> None:
    healthy = await start_fake("m")
    dead = {"id": "dead", "model": "m", "url": refused_url()}
    server = await start_router([dead, replica_entry("good", healthy)])
    dead_replica = server.pool.get("dead")
    assert dead_replica is not None
    sent = 0
    # Ties are broken at random: send until the dead one has been picked at least twice.
    while dead_replica.errors.get("connect", 0) < 2 and sent < 200:
        status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
        sent += 1
    assert dead_replica.errors["connect"] == 2
    assert len(healthy.seen) == sent
    assert in_flight(server) == {"dead": 0, "good": 0}


async def test_every_replica_down_gives_a_prompt_503(start_router: StartRouter, refused_url: RefusedUrl) -> None:
    replicas = [{"id": f"d{i}", "model": "m", "url": refused_url()} for i in range(3)]
    server = await start_router(replicas, max_attempts=2)
    began = time.perf_counter()
    status, headers, answer = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert time.perf_counter() - began < 2.0
    assert status == 503
    error = orjson.loads(answer)["error"]
    assert error["code"] == "no_replica_available"
    # Nothing ejected yet: the trouble may pass in a moment.
    assert headers["Retry-After"] == "1"
    assert sum(sum(r.errors.values()) for r in server.pool) == 2
    assert server.pool.tallies.unserved == {"m": 1}


async def test_no_replica_available_says_when_to_try_again_and_counts_the_aliased_model(
    start_router: StartRouter, refused_url: RefusedUrl
) -> None:
    server = await start_router(
        [{"id": f"d{i}", "model": "m", "url": refused_url()} for i in range(2)],
        models={"m": {"aliases": ["alias"]}, "empty": {}},
        ejection_failures=1,
        ejection_base_seconds=20,
    )
    # Both refuse: one is ejected for 20 s (never more than half), the other tried too.
    status, headers, answer = await post(
        server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "alias"})
    )
    assert status == 503 and orjson.loads(answer)["error"]["code"] == "no_replica_available"
    assert [r.state.value for r in server.pool].count("ejected") == 1
    # The ejection ends in about 20 s: that is when to come back.
    assert 15 <= int(headers["Retry-After"]) <= 20
    # Demand is counted under the model the alias names.
    assert server.pool.tallies.unserved == {"m": 1}
    # A model declared with no replica at all: one must be started first.
    empty = orjson.dumps({**CHAT, "model": "empty"})
    status, headers, _ = await post(server.client_url + "/v1/chat/completions", empty)
    assert status == 503 and headers["Retry-After"] == "10"


async def test_a_replica_killed_mid_test_is_routed_around(start_fake: StartFake, start_router: StartRouter) -> None:
    first = await start_fake("m")
    second = await start_fake("m")
    server = await start_router([replica_entry("a", first), replica_entry("b", second)])
    for _ in range(4):
        status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
    await first.stop()
    before = len(second.seen)
    for _ in range(6):
        status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
    assert len(second.seen) - before == 6


async def test_fallbacks_serve_when_no_replica_of_the_model_can(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    broken = await start_fake("small", behaviour=Behaviour(fail_status=502, fail_body=b"bad gateway"))
    big = await start_fake("big")
    server = await start_router(
        [replica_entry("s0", broken), replica_entry("b0", big)], models={"small": {"fallbacks": ["big"]}}
    )
    status, headers, answer = await post(
        server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "small"})
    )
    assert status == 200
    assert headers["X-Served-By"] == big.name
    assert orjson.loads(big.seen[-1].body)["model"] == "big"
    assert server.pool.tallies.fallbacks == {("small", "big"): 1}
    assert orjson.loads(answer)["model"] == "big"


async def test_a_replica_4xx_is_its_answer_passed_through_not_retried(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    body = b'{"error": {"message": "too long", "type": "invalid_request_error", "param": null, "code": "ctx"}}'
    refusing = await start_fake("m", behaviour=Behaviour(fail_status=400, fail_body=body))
    server = await start_router([replica_entry("r0", refusing)])
    status, _, answer = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert (status, answer) == (400, body)
    assert len(refusing.seen) == 1


async def test_a_plain_error_from_a_replica_is_given_openai_shape(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    engine = await start_fake("m", behaviour=Behaviour(fail_status=500, fail_body=b'{"message": "bad role"}'))
    server = await start_router([replica_entry("r0", engine)])
    status, headers, answer = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert status == 500
    assert headers["Content-Type"].startswith("application/json")
    assert orjson.loads(answer)["error"]["message"] == "bad role"


async def test_the_replica_sees_a_client_leave_during_a_stream(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # Tokens 10 s apart: the replica must hear of it at once, not at the next chunk.
    fake = await start_fake("m", behaviour=Behaviour(tokens=4, token_delay=10.0))
    server = await start_router([replica_entry("r0", fake)])
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            server.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        assert resp.status == 200
        await resp.content.readany()
        assert server.pool.get("r0") is not None and in_flight(server) == {"r0": 1}
        resp.close()
    await wait_for(lambda: fake.cancelled == 1 and in_flight(server) == {"r0": 0}, timeout=1.0)


async def test_the_replica_sees_a_client_leave_before_the_first_token(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(first_token_delay=30.0))
    server = await start_router([replica_entry("r0", fake)])
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(session.post(server.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)))
        await wait_for(lambda: fake.active == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_for(lambda: fake.cancelled == 1, timeout=1.0)
    await wait_for(lambda: in_flight(server) == {"r0": 0})


async def test_a_reset_mid_stream_ends_the_clients_stream_with_an_error_event(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    flaky = await start_fake("m", behaviour=Behaviour(tokens=10, reset_after_chunks=3))
    other = await start_fake("m")
    server = await start_router([replica_entry("a", flaky), replica_entry("b", other)])
    server.pool.set_draining("b", True)
    status, body, complete = await post_cut(
        server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "stream": True})
    )
    assert status == 200
    assert not complete, "a stream the replica broke off must not end like a complete one"
    events = [e for e in body.split(b"\n\n") if e]
    assert len(events) == 4
    assert b"tok1 " in events[2]
    error = orjson.loads(events[3].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_error"
    assert len(flaky.seen) == 1 and other.seen == []
    assert in_flight(server) == {"a": 0, "b": 0}
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    await client.close()


async def test_no_response_head_within_the_first_byte_timeout_is_504(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    stalled = await start_fake("m", behaviour=Behaviour(stall=True))
    server = await start_router([replica_entry("r0", stalled)], first_byte_timeout_seconds=0.3)
    began = time.perf_counter()
    status, _, answer = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert 0.3 <= time.perf_counter() - began < 3.0
    assert status == 504
    assert orjson.loads(answer)["error"]["code"] == "upstream_timeout"
    await wait_for(lambda: stalled.cancelled == 1)


async def test_a_slow_stream_is_not_cut_by_the_first_byte_timeout(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    slow = await start_fake("m", behaviour=Behaviour(tokens=8, token_delay=0.1))
    server = await start_router([replica_entry("r0", slow)], first_byte_timeout_seconds=0.3)
    status, _, body = await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "stream": True}))
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n")
    assert body.count(b"tok") == 8
