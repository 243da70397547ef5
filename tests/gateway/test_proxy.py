"""The data path, through real sockets: the openai SDK in front, fake replicas behind."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from multidict import CIMultiDict

from router.tools.fake import Behaviour
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, in_flight, post, post_cut, samples, scrape
from tests.support.waiting import wait_for


async def test_async_sdk_chat_and_completions_get_the_replicas_answers(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="unused", max_retries=0)
    chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content == "tok0 tok1 tok2 "
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    completion = await client.completions.create(model="m", prompt="hi", max_tokens=2)
    assert completion.choices[0].text == "tok0 tok1 "
    embedding = await client.embeddings.create(model="m", input=["a", "b"])
    assert len(embedding.data) == 2 and len(embedding.data[1].embedding) == 8
    await client.close()
    assert in_flight(server) == {"r0": 0}


async def test_async_sdk_streams_arrive_whole_and_in_order(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 5
    completions = await client.completions.create(model="m", prompt="x", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in completions]) == "tok0 tok1 tok2 "
    await client.close()


async def test_sync_sdk_works_streaming_and_not(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])

    def use_sync_client() -> tuple[str, str]:
        with openai.OpenAI(base_url=server.client_url + "/v1", api_key="unused", max_retries=0) as client:
            whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
            streamed = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            return whole.choices[0].message.content or "", text

    whole, streamed = await asyncio.to_thread(use_sync_client)
    assert whole == streamed == "tok0 tok1 "


async def test_stream_bytes_are_passed_through_unchanged(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 4})
    _, direct_headers, direct = await post(fake.url + "/v1/chat/completions", body)
    status, headers, proxied = await post(server.client_url + "/v1/chat/completions", body)
    assert status == 200
    assert headers["Content-Type"] == direct_headers["Content-Type"] == "text/event-stream; charset=utf-8"
    # Ids carry a per-replica counter; everything else must be byte-identical.
    assert proxied.replace(b"-1", b"-0") == direct.replace(b"-1", b"-0")
    assert proxied.endswith(b"data: [DONE]\n\n")


async def test_request_body_is_forwarded_byte_for_byte(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    body = b'{ "messages" : [ {"role":"user","content":"caf\\u00e9 \xc3\xa9"} ],\n  "model":"m", "temperature": 0.10 }'
    status, _, _ = await post(server.client_url + "/v1/chat/completions", body)
    assert status == 200
    assert fake.seen[-1].body == body
    assert fake.seen[-1].path == "/v1/chat/completions"


async def test_query_string_is_kept(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    status, _, _ = await post(server.client_url + "/v1/completions?api-version=2024-01", orjson.dumps(CHAT))
    assert status == 200
    assert fake.seen[-1].path == "/v1/completions?api-version=2024-01"


async def test_hop_by_hop_headers_stay_behind_and_end_to_end_ones_pass(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake(
        "m",
        behaviour=Behaviour(
            extra_headers={
                "X-Request-Id": "req-42",
                "Keep-Alive": "timeout=5",
                "X-Upstream-Only": "1",
                "Connection": "X-Upstream-Only",
            }
        ),
    )
    server = await start_router([replica_entry("r0", fake)])
    status, headers, _ = await post(
        server.client_url + "/v1/chat/completions",
        orjson.dumps(CHAT),
        {
            "Content-Type": "application/json",
            "X-Request-Id": "req-42",
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=9",
            "TE": "trailers",
            "Proxy-Authorization": "Basic Zm9vOmJhcg==",
            "Upgrade": "websocket",
            "X-Custom": "kept",
        },
    )
    assert status == 200
    seen = {k.lower(): v for k, v in fake.seen[-1].headers.items()}
    assert seen["x-request-id"] == "req-42"
    assert seen["x-custom"] == "kept"
    for name in ("x-secret-hop", "keep-alive", "te", "proxy-authorization", "upgrade"):
        assert name not in seen, name
    assert seen.get("connection", "keep-alive").lower() == "keep-alive"
    assert headers["X-Request-Id"] == "req-42"
    assert headers["X-Served-By"] == fake.name
    assert "X-Upstream-Only" not in headers
    assert "Keep-Alive" not in headers


async def test_hop_by_hop_headers_stay_behind_after_many_names_were_seen(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # The filter remembers a bounded number of names' verdicts: a client that
    # sends new names on every request fills it, and later names, hop-by-hop
    # ones spelled anew among them, are still judged, never passed by default.
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    url = server.client_url + "/v1/chat/completions"
    for batch in range(12):
        names = {f"X-Filler-{batch}-{n}": "1" for n in range(90)}
        status, _, _ = await post(url, orjson.dumps(CHAT), {"Content-Type": "application/json", **names})
        assert status == 200
    assert sum(name.lower().startswith("x-filler-11-") for name in fake.seen[-1].headers) == 90
    status, _, _ = await post(
        url,
        orjson.dumps(CHAT),
        {
            "Content-Type": "application/json",
            "CONNECTION": "keep-alive, X-Named-Late",
            "X-Named-Late": "1",
            "KEEP-ALIVE": "timeout=9",
            "Proxy-Late": "1",
            "Transfer_Encoding": "chunked",
            "X-Late-Arrival": "kept",
        },
    )
    assert status == 200
    seen = {k.lower(): v for k, v in fake.seen[-1].headers.items()}
    assert seen["x-late-arrival"] == "kept"
    for name in ("x-named-late", "keep-alive", "proxy-late", "transfer_encoding"):
        assert name not in seen, name


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": 7}', "model"),
        (b'{"model": ""}', "model"),
        (b'{"model": "m", "x": "\xff\xfe"}', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),
    ],
)
async def test_bad_bodies_get_an_openai_shaped_400(
    start_fake: StartFake, start_router: StartRouter, body: bytes, fragment: str
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    status, headers, answer = await post(server.client_url + "/v1/chat/completions", body)
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    error = orjson.loads(answer)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert fake.seen == []


async def test_bodies_above_the_limit_get_413_with_or_without_a_length(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], max_body_bytes=1000)
    big = orjson.dumps({**CHAT, "pad": "x" * 2000})
    status, _, answer = await post(server.client_url + "/v1/chat/completions", big)
    assert status == 413
    assert orjson.loads(answer)["error"]["code"] == "request_too_large"

    async def chunks() -> Any:
        for _ in range(4):
            yield b"x" * 400

    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + "/v1/chat/completions", data=chunks()) as resp,
    ):
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    assert fake.seen == []


async def test_api_keys_are_required_when_set_and_never_forwarded(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=["k-one", "k-two"])
    url = server.client_url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"}):
        status, _, answer = await post(url, orjson.dumps(CHAT), headers)
        assert status == 401
        assert orjson.loads(answer)["error"]["code"] == "invalid_api_key"
    status, _, _ = await post(url, orjson.dumps(CHAT), {"Authorization": "Bearer k-two"})
    assert status == 200
    assert "authorization" not in {k.lower() for k in fake.seen[-1].headers}
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="k-one", max_retries=0)
    assert [m.id async for m in client.models.list()] == ["m"]
    bad = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await client.close()
    await bad.close()


async def test_models_lists_served_models_and_their_aliases(start_fake: StartFake, start_router: StartRouter) -> None:
    a = await start_fake("a")
    b = await start_fake("b")
    server = await start_router(
        [replica_entry("a0", a), replica_entry("b0", b)],
        models={"a": {"aliases": ["alpha"]}, "ghost": {"aliases": ["boo"]}},
    )
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0)
    names = [m.id async for m in client.models.list()]
    assert sorted(names) == ["a", "alpha", "b"]
    await client.close()
    assert a.seen == [] and b.seen == []


async def test_unknown_model_is_404_model_not_found(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found"
    await client.close()
    assert server.pool.tallies.unserved == {"nope": 1}


async def test_an_alias_reaches_the_model_under_its_own_name(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("llama-3.1-8b")
    server = await start_router([replica_entry("r0", fake)], models={"llama-3.1-8b": {"aliases": ["llama"]}})
    status, _, answer = await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "llama"}))
    assert status == 200
    assert orjson.loads(fake.seen[-1].body)["model"] == "llama-3.1-8b"
    assert orjson.loads(fake.seen[-1].body)["messages"] == CHAT["messages"]
    assert orjson.loads(answer)["model"] == "llama-3.1-8b"


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


async def test_unknown_paths_and_methods_get_openai_shaped_errors(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with aiohttp.ClientSession() as session:
        for method, path, status in (
            ("GET", "/v1/chat/completions", 405),
            ("GET", "/api/v1/usage", 404),
            ("GET", "/metrics", 404),
            ("PUT", "/api/v1/endpoints", 404),
            ("GET", "/healthz", 404),
        ):
            async with session.request(method, server.client_url + path) as resp:
                assert resp.status == status, path
                assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_admin_port_answers_liveness_and_readiness(start_router: StartRouter) -> None:
    server = await start_router()
    async with aiohttp.ClientSession() as session:
        async with session.get(server.admin_url + "/healthz") as resp:
            assert resp.status == 200
        async with session.get(server.admin_url + "/readyz") as resp:
            assert resp.status == 200
        server.ready = False
        async with session.get(server.admin_url + "/readyz") as resp:
            assert resp.status == 503
        server.ready = True


async def test_a_replica_closing_idle_connections_never_fails_a_request(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # The replica drops idle connections after 0.3 s, and the router is told to
    # keep them far longer: requests spaced around 0.3 s meet connections the
    # replica is closing, and must still all succeed.
    fake = await start_fake("m", keepalive_timeout=0.3)
    server = await start_router([replica_entry("r0", fake)], upstream_keepalive_seconds=30)
    async with aiohttp.ClientSession() as session:
        for gap in (0.28, 0.3, 0.32, 0.29, 0.31, 0.3, 0.33, 0.27):
            async with session.post(server.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp:
                assert resp.status == 200
                await resp.read()
            # Real time: each request comes as the replica's keep-alive timer (its clock) runs out.
            await asyncio.sleep(gap)
    assert in_flight(server) == {"r0": 0}


async def test_a_release_on_one_model_never_wakes_another_models_waiter(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """Two models, one slot each: b's waiter is served when b frees, not when a's queue moves.

    With one queue for every model, b0's release woke a's older waiter, which
    found a still busy and queued again at the tail, while b's waiter slept on
    and got 503 server_overloaded after the queue timeout with b idle.
    """
    a = await start_fake("a", behaviour=Behaviour(token_delay=0.1))
    b = await start_fake("b", behaviour=Behaviour(token_delay=0.1))
    server = await start_router(
        [replica_entry("a0", a), replica_entry("b0", b)], max_in_flight_per_replica=1, queue_timeout_seconds=1.0
    )
    url = server.client_url + "/v1/chat/completions"

    def ask(model: str, tokens: int) -> asyncio.Task[tuple[int, CIMultiDict[str], bytes]]:
        body = orjson.dumps({**CHAT, "model": model, "max_tokens": tokens, "stream": True})
        return asyncio.create_task(post(url, body))

    a1, b1 = ask("a", 20), ask("b", 3)  # a0 busy for 2 s, b0 for 0.3 s
    await wait_for(lambda: in_flight(server) == {"a0": 1, "b0": 1})
    a2 = ask("a", 1)  # waits: the oldest waiter
    await wait_for(lambda: server.pool.queues.waiting("a") == 1)
    began = time.perf_counter()
    b2 = ask("b", 1)  # waits behind it
    status, _, _ = await b2
    assert status == 200
    # Served when b0 freed (about 0.25 s from here), well before the 1 s queue timeout.
    assert time.perf_counter() - began < 0.9
    assert (await b1)[0] == 200
    assert (await a2)[0] == 503  # a0 stayed busy past the queue timeout
    assert (await a1)[0] == 200


async def test_waits_for_a_slot_under_the_limits_are_observed_per_model_refused_ones_included(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """router_queue_wait_seconds counts every wait at the limits, by class: the one served, the one refused with 503."""
    fake = await start_fake("m", behaviour=Behaviour(token_delay=0.1))
    server = await start_router([replica_entry("r0", fake)], max_in_flight_per_replica=1, queue_timeout_seconds=1.0)
    url = server.client_url + "/v1/chat/completions"

    def ask(tokens: int) -> asyncio.Task[tuple[int, CIMultiDict[str], bytes]]:
        return asyncio.create_task(post(url, orjson.dumps({**CHAT, "max_tokens": tokens, "stream": True})))

    assert samples(await scrape(server), "router_queue_wait_seconds_count") == {}
    long = ask(20)  # r0 busy for about 2 s
    await wait_for(lambda: in_flight(server) == {"r0": 1})
    assert (await ask(1))[0] == 503
    assert (await long)[0] == 200
    short = ask(5)  # busy for about 0.5 s, within the queue timeout
    await wait_for(lambda: in_flight(server) == {"r0": 1})
    waiting = ask(1)  # served once the short one ends
    assert (await short)[0] == 200
    assert (await waiting)[0] == 200
    text = await scrape(server)
    waits = (("model", "m"), ("priority", "interactive"))
    assert samples(text, "router_queue_wait_seconds_count") == {waits: 2}
    # The refused wait lasted the whole queue timeout.
    assert samples(text, "router_queue_wait_seconds_sum")[waits] >= 1.0
