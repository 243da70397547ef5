"""Anthropic's Messages API through the real router, with the official `anthropic` SDK.

create, stream and count_tokens reach the replica of the model named, the
stream's own events pass untouched, and every error on these paths is
Anthropic-shaped (`{"type": "error", "error": {"type", "message"}}`), the
router's own and a replica's alike.
"""

from __future__ import annotations

import re

import aiohttp
import anthropic
import orjson
import pytest
from anthropic.types import MessageParam

from router.run.app import RouterServer
from router.tools.fake import Behaviour
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry

HELLO: list[MessageParam] = [{"role": "user", "content": "say hello to the router"}]


def sdk(server: RouterServer, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.client_url, api_key=api_key, max_retries=0, timeout=30)


async def test_create_reaches_the_replica_of_the_model_named(start_fake: StartFake, start_router: StartRouter) -> None:
    small, large = await start_fake("small", behaviour=Behaviour(tokens=3)), await start_fake("large")
    server = await start_router([replica_entry("s", small), replica_entry("l", large)])
    async with sdk(server) as client:
        message = await client.messages.create(model="small", max_tokens=16, messages=HELLO)
    assert message.content[0].type == "text" and message.content[0].text == "tok0 tok1 tok2 "
    assert message.model == "small" and message.usage.input_tokens == 5
    assert [seen.path for seen in small.seen] == ["/v1/messages"] and large.seen == []


async def test_a_stream_passes_anthropics_own_events_untouched(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=4))
    server = await start_router([replica_entry("r0", fake)])
    async with sdk(server) as client, client.messages.stream(model="m", max_tokens=8, messages=HELLO) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].type == "text" and final.content[0].text == "tok0 tok1 tok2 tok3 "
    # Byte for byte: the router's stream is the replica's.
    body = orjson.dumps({"model": "m", "max_tokens": 2, "stream": True, "messages": HELLO})
    async with aiohttp.ClientSession() as session:
        async with session.post(server.client_url + "/v1/messages", data=body) as through:
            routed = await through.read()
        async with session.post(fake.url + "/v1/messages", data=body) as direct:
            straight = await direct.read()
    # (The two answers differ only in their message ids.)
    assert re.sub(rb"msg_[\w-]+", b"id", routed) == re.sub(rb"msg_[\w-]+", b"id", straight)
    assert routed.startswith(b"event: message_start\ndata: ")


async def test_count_tokens_is_routed_by_model(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], models={"m": {"aliases": ["claude-local"]}})
    async with sdk(server) as client:
        counted = await client.messages.count_tokens(model="claude-local", messages=HELLO, system="be brief")
    assert counted.input_tokens == 7
    # The alias reaches the engine under the model's own name.
    assert orjson.loads(fake.seen[-1].body)["model"] == "m"


async def test_the_routers_own_errors_are_anthropic_shaped(
    start_fake: StartFake, start_router: StartRouter, refused_url: RefusedUrl
) -> None:
    fake = await start_fake("m")
    server = await start_router(
        [replica_entry("r0", fake), {"id": "gone", "model": "down", "url": refused_url(), "labels": {}}]
    )
    async with sdk(server) as client:
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(model="nope", max_tokens=4, messages=HELLO)
        with pytest.raises(anthropic.InternalServerError) as unserved:
            await client.messages.create(model="down", max_tokens=4, messages=HELLO)
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.count_tokens(model=7, messages=HELLO)  # type: ignore[arg-type]
    assert unknown.value.status_code == 404 and unknown.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model 'nope' does not exist or no replica serves it."},
    }
    assert unserved.value.status_code == 503
    assert isinstance(unserved.value.body, dict) and unserved.value.body["error"]["type"] == "overloaded_error"
    assert isinstance(bad.value.body, dict) and bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    # OpenAI's paths keep OpenAI's shape.
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + "/v1/chat/completions", json={"model": "nope"}) as r,
    ):
        assert set(await r.json()) == {"error"}


async def test_a_replicas_error_is_given_anthropics_shape_and_an_anthropic_one_passes_untouched(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    plain = await start_fake("m", behaviour=Behaviour(fail_status=400, fail_body=b'{"detail": "max_tokens: too big"}'))
    server = await start_router([replica_entry("r0", plain)])
    async with sdk(server) as client:
        with pytest.raises(anthropic.BadRequestError) as reshaped:
            await client.messages.create(model="m", max_tokens=4, messages=HELLO)
        assert reshaped.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: too big"},
        }
        # The fake, as vLLM, answers messages without `messages` in Anthropic's shape itself.
        async with (
            aiohttp.ClientSession() as session,
            session.post(server.client_url + "/v1/messages", json={"model": "m"}) as r,
        ):
            assert r.status == 400
    plain.behaviour = Behaviour()
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + "/v1/messages", json={"model": "m"}) as r,
    ):
        assert r.status == 400
        untouched = b'{"type":"error","error":{"type":"invalid_request_error","message":"messages: Field required"}}'
        assert await r.read() == untouched


async def test_the_sdks_x_api_key_is_a_client_key_and_is_never_forwarded(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=["sk-router"])
    async with sdk(server, api_key="sk-router") as client:
        assert (await client.messages.count_tokens(model="m", messages=HELLO)).input_tokens == 5
    assert "x-api-key" not in {name.lower() for name in fake.seen[-1].headers}
    async with sdk(server, api_key="sk-wrong") as client:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await client.messages.create(model="m", max_tokens=4, messages=HELLO)
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["type"] == "authentication_error"
    assert len(fake.seen) == 1


async def test_a_stream_the_replica_breaks_off_ends_with_anthropics_error_event(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=8, reset_after_chunks=2))
    server = await start_router([replica_entry("r0", fake)])

    async def read_all(client: anthropic.AsyncAnthropic) -> None:
        async with client.messages.stream(model="m", max_tokens=8, messages=HELLO) as stream:
            async for _ in stream:
                pass

    async with sdk(server) as client:
        with pytest.raises(anthropic.APIStatusError) as broken:
            await read_all(client)
    assert isinstance(broken.value.body, dict) and broken.value.body["type"] == "error"
    assert broken.value.body["error"]["type"] == "api_error"
    assert "broke off the stream" in broken.value.body["error"]["message"]
