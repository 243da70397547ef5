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
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, in_flight, post, samples, scrape
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
