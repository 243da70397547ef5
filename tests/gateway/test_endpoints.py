"""Every endpoint the engines serve passes through, routed by its model; every request can be seen.

The Responses API through the official SDK (create, stream, retrieve, and
`previous_response_id` reaching the replica that keeps the response), audio
as multipart form data (the model is a form field; the body crosses byte for
byte), rerank, score, tokenize and the rest as plain HTTP; request ids both
ways; the access log, parsed and matched field by field.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from router.tools.fake.echo import ECHOED
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, access_log_lines
from tests.support.processes import Serve
from tests.support.waiting import wait_for


def sdk(server: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=30)


async def post_json(
    server: RouterServer, path: str, body: dict[str, Any] | bytes, **headers: str
) -> tuple[int, Any, Any]:
    data = io.BytesIO(body) if isinstance(body, bytes) else orjson.dumps(body)
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + path, data=data, headers={"Content-Type": "application/json", **headers}) as r,
    ):
        raw = await r.read()
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            doc = raw
        return r.status, r.headers.copy(), doc


def form(fields: list[tuple[str, str | bytes]], boundary: str = "XyZboundary") -> tuple[bytes, str]:
    """Multipart form data by hand: the exact bytes, to check they cross unchanged."""
    out = b""
    for name, value in fields:
        out += f"--{boundary}\r\n".encode()
        if isinstance(value, bytes):
            out += f'Content-Disposition: form-data; name="{name}"; filename="audio.wav"\r\n'.encode()
            out += b"Content-Type: audio/wav\r\n\r\n" + value + b"\r\n"
        else:
            out += f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


# Routing by model, whatever the endpoint ------------------------------------------------------------


async def test_the_responses_api_through_the_sdk_create_stream_and_retrieve(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=3))
    server = await start_router([replica_entry("r0", fake)])
    async with sdk(server) as client:
        created = await client.responses.create(model="m", input="hi")
        assert created.output_text == "tok0 tok1 tok2 "
        events = [event async for event in await client.responses.create(model="m", input="hi", stream=True)]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        streamed_id = events[0].response.id
        again = await client.responses.retrieve(created.id)
        assert again.id == created.id
        items = await client.responses.input_items.list(streamed_id)
        assert items.data == []
    # Both ids were remembered with their replica: the GETs reached it.
    assert [seen.path.split("/")[-1] for seen in fake.seen[-2:]] == [created.id, "input_items"]


async def test_the_sdks_responses_stream_helper_builds_the_response_as_it_arrives(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """`client.responses.stream(...)` needs each output item announced before its deltas, as OpenAI sends them."""
    fake = await start_fake("m", behaviour=Behaviour(tokens=3))
    server = await start_router([replica_entry("r0", fake)])
    async with sdk(server) as client, client.responses.stream(model="m", input="hi") as stream:
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert deltas == ["tok0 ", "tok1 ", "tok2 "]
    assert final.output_text == "tok0 tok1 tok2 " and final.status == "completed"
    assert final.id in fake.responses


async def test_previous_response_id_reaches_the_replica_that_made_the_response_every_time(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fakes = [await start_fake("m", name=f"f{i}") for i in range(2)]
    server = await start_router([replica_entry(f"r{i}", fake) for i, fake in enumerate(fakes)])
    async with sdk(server) as client:
        first = await client.responses.create(model="m", input="hi")
        maker = next(f for f in fakes if first.id in f.responses)
        previous = first.id
        for _ in range(200):
            # Least-loaded alone would spread these over both; each must reach the maker.
            turn = await client.responses.create(model="m", input="and then?", previous_response_id=previous)
            assert turn.id in maker.responses
            previous = turn.id
    other = next(f for f in fakes if f is not maker)
    assert other.responses == {}


async def test_a_response_whose_replica_is_gone_is_a_404_saying_so(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with sdk(server) as client:
        created = await client.responses.create(model="m", input="hi")
        server.pool.set_replicas([])
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.create(model="m", input="more", previous_response_id=created.id)
        assert "gone" in gone.value.message
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.retrieve("resp_never_seen")
        assert "resp_never_seen" in unknown.value.message


async def test_a_transcription_uploads_5_mb_as_multipart_through_the_sdk(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("whisper")
    server = await start_router([replica_entry("r0", fake)])
    audio = os.urandom(5 * 1024 * 1024)
    async with sdk(server) as client:
        heard = await client.audio.transcriptions.create(model="whisper", file=("a.wav", audio))
    assert heard.text == f"{len(audio)} bytes of audio heard by {fake.name}"
    assert fake.seen[-1].path == "/v1/audio/transcriptions"


async def test_a_multipart_body_crosses_byte_for_byte_with_the_model_after_a_20_mb_file(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("whisper")
    server = await start_router([replica_entry("r0", fake)], max_body_bytes=64 * 1024 * 1024)
    body, content_type = form([("file", os.urandom(20 * 1024 * 1024)), ("language", "en"), ("model", "whisper")])
    status, _, doc = await post_json(server, "/v1/audio/translations", body, **{"Content-Type": content_type})
    assert status == 200
    assert doc["model"] == "whisper" and doc["file_bytes"] == 20 * 1024 * 1024
    assert doc["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_a_multipart_body_without_a_model_field_among_several_models_is_a_400_naming_it(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake, other = await start_fake("whisper"), await start_fake("tts")
    server = await start_router([replica_entry("r0", fake), replica_entry("r1", other)])
    body, content_type = form([("file", b"RIFF...."), ("language", "en")])
    status, _, doc = await post_json(server, "/v1/audio/transcriptions", body, **{"Content-Type": content_type})
    assert status == 400
    assert doc["error"]["param"] == "model" and "'tts', 'whisper'" in doc["error"]["message"]
    assert fake.seen == [] and other.seen == []


async def test_an_alias_is_rewritten_in_a_multipart_form_too(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("whisper")
    server = await start_router([replica_entry("r0", fake)], models={"whisper": {"aliases": ["ears"]}})
    body, content_type = form([("file", b"abc"), ("model", "ears")])
    status, _, doc = await post_json(server, "/v1/audio/transcriptions", body, **{"Content-Type": content_type})
    assert status == 200 and doc["model"] == "whisper"


@pytest.mark.parametrize("path", ECHOED)
async def test_the_engines_other_endpoints_are_routed_by_model_and_cross_byte_for_byte(
    start_fake: StartFake, start_router: StartRouter, path: str
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    body = b'{"model": "m",  "query": "a", "documents": ["b", "c"], "extra": [1, 2.50]}'
    status, _, doc = await post_json(server, path, body)
    assert status == 200
    assert doc["path"] == path and doc["served_by"] == fake.name
    assert doc["body_sha256"] == hashlib.sha256(body).hexdigest()
    # Routed like a completion: the usage stamp is set.
    replica = server.pool.get("r0")
    assert replica is not None and replica.last_used is not None


async def test_speech_audio_streams_through(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("tts")
    server = await start_router([replica_entry("r0", fake)])
    async with sdk(server) as client:
        speech = await client.audio.speech.create(model="tts", voice="alloy", input="hello")
        audio = speech.read()
    assert audio == b"".join(bytes([i]) * 1024 for i in range(4))


async def test_a_path_outside_routed_paths_keeps_its_404(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], routed_paths=["/v1/chat/completions"])
    status, _, doc = await post_json(server, "/v1/rerank", {"model": "m"})
    assert status == 404 and doc["error"]["code"] == "unknown_url"
    assert fake.seen == []


async def test_models_retrieve_answers_from_the_catalog(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], models={"m": {"aliases": ["em"]}})
    async with sdk(server) as client:
        assert (await client.models.retrieve("m")).id == "m"
        assert (await client.models.retrieve("em")).id == "em"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")


# Request ids ------------------------------------------------------------------------------------------


async def test_a_request_id_is_the_clients_or_a_new_one_and_goes_both_ways(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    _, headers, _ = await post_json(server, "/v1/chat/completions", CHAT, **{"X-Request-Id": "client-id-1"})
    assert headers["X-Request-Id"] == "client-id-1"
    assert seen_id(fake) == ["client-id-1"]
    _, headers, _ = await post_json(server, "/v1/chat/completions", CHAT)
    made = headers["X-Request-Id"]
    assert seen_id(fake) == [made]
    # A UUID: engines check the header's shape (llama.cpp's server refuses anything else with 400).
    assert uuid.UUID(made).version == 4 and str(uuid.UUID(made)) == made
    _, headers, _ = await post_json(server, "/v1/chat/completions", CHAT)
    assert headers["X-Request-Id"] != made and uuid.UUID(headers["X-Request-Id"]).version == 4
    # Too long, or not visible ASCII: replaced, never forwarded as sent.
    _, headers, _ = await post_json(server, "/v1/chat/completions", CHAT, **{"X-Request-Id": "x" * 300})
    assert headers["X-Request-Id"] != "x" * 300
    assert seen_id(fake) == [headers["X-Request-Id"]]


def seen_id(fake: FakeReplica) -> list[str]:
    """The X-Request-Id values the replica's last request carried (aiohttp spells the name its own way)."""
    return [value for name, value in fake.seen[-1].headers.items() if name.lower() == "x-request-id"]


async def test_every_log_line_a_request_causes_names_its_id(
    start_fake: StartFake, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    from router.run.logs import RequestIdFilter

    flaky = await start_fake("m", behaviour=Behaviour(tokens=10, reset_after_chunks=3))
    server = await start_router([replica_entry("r0", flaky)])
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.WARNING, logger="router")
    with pytest.raises(aiohttp.ClientPayloadError):  # the stream breaks off, and looks it
        await post_json(server, "/v1/chat/completions", {**CHAT, "stream": True}, **{"X-Request-Id": "trace-me"})
    broke = [r for r in caplog.records if "broke off" in r.getMessage()]
    assert broke and all("[req trace-me]" in r.getMessage() for r in broke)


# The access log ---------------------------------------------------------------------------------------


async def test_the_access_log_has_one_line_per_request_field_by_field(
    start_fake: StartFake, start_router: StartRouter, refused_url: RefusedUrl, tmp_path: Path
) -> None:
    good = await start_fake("m", behaviour=Behaviour(tokens=50, token_delay=0.01))
    log_path = tmp_path / "access.log"
    server = await start_router(
        [{"id": "dead", "model": "m", "url": refused_url()}, replica_entry("good", good)],
        access_log=str(log_path),
        models={"m": {"aliases": ["em"]}},
    )
    # Answered whole through an alias; the refused replica is tried first or not at all.
    status, _, _ = await post_json(server, "/v1/chat/completions", {**CHAT, "model": "em"}, **{"X-Request-Id": "a1"})
    assert status == 200
    # A request that tries the dead one first is retried (attempts 2); the pick among
    # equals is random, so enough requests that one of them surely does (1 - 2^-30).
    for i in range(30):
        await post_json(server, "/v1/chat/completions", CHAT, **{"X-Request-Id": f"r{i}"})
    # A client that leaves in the middle of a stream.
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            server.client_url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Request-Id": "leaver"},
        ) as resp,
    ):
        await resp.content.readany()
    await post_json(server, "/v1/nope", CHAT, **{"X-Request-Id": "lost"})
    await wait_for(lambda: log_path.exists() and len(access_log_lines(log_path)) == 33, timeout=5)
    by_id = {line["id"]: line for line in access_log_lines(log_path)}
    first = by_id["a1"]
    assert first["method"] == "POST" and first["path"] == "/v1/chat/completions"
    assert first["model"] == "em" and first["served_model"] == "m" and first["status"] == 200
    assert first["bytes_in"] == len(orjson.dumps({**CHAT, "model": "em"})) and first["bytes_out"] > 100
    assert first["outcome"] == "ok" and first["ttfb_seconds"] > 0 and first["duration_seconds"] >= first["ttfb_seconds"]
    assert first["client"].startswith("127.0.0.1:") and first["held_seconds"] is None
    retried = [line for key, line in by_id.items() if key.startswith("r") and line["attempts"] == 2]
    assert retried and all(line["replica"] == "good" and line["status"] == 200 for line in retried)
    leaver = by_id["leaver"]
    assert leaver["outcome"] == "client_gone" and leaver["status"] == 200
    lost = by_id["lost"]
    assert lost["status"] == 404 and lost["model"] is None and lost["attempts"] == 0
    text = log_path.read_text()
    assert "messages" not in text and "Bearer" not in text


async def test_a_body_refused_for_want_of_a_key_has_its_access_log_line(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    """Refused from its head (its body never read), the request still has its line, under its id."""
    fake = await start_fake("m")
    log_path = tmp_path / "access.log"
    server = await start_router([replica_entry("r0", fake)], access_log=str(log_path), api_keys=["sk-right"])
    status, headers, answer = await post_json(server, "/v1/chat/completions", CHAT, **{"X-Request-Id": "keyless"})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert headers["X-Request-Id"] == "keyless"
    await wait_for(lambda: log_path.exists() and len(access_log_lines(log_path)) == 1, timeout=5)
    line = access_log_lines(log_path)[0]
    assert line["id"] == "keyless" and line["status"] == 401 and line["bytes_in"] == 0
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions" and line["attempts"] == 0
    assert fake.seen == []


async def test_rotating_the_access_log_with_sighup_under_load_loses_no_line(
    serve: Serve, start_fake: StartFake, tmp_path: Path
) -> None:
    fake = await start_fake("m")
    log_path = tmp_path / "access.log"
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], f'access_log = "{log_path}"')
    await serve.start()
    sent = 0

    async def load(seconds: float) -> None:
        nonlocal sent
        deadline = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                async with session.post(serve.client_url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200
                    await resp.read()
                    sent += 1

    loaders = [asyncio.create_task(load(2.0)) for _ in range(4)]
    rotated = []
    for i in range(3):
        # The log is rotated under load, each time after a dozen more requests, once the router
        # has written lines to the file it reopened (a batch at a time).
        await wait_for(lambda i=i: sent >= 12 * (i + 1) and bool(access_log_lines(log_path)), timeout=10)
        moved = tmp_path / f"access.log.{i}"
        log_path.rename(moved)
        rotated.append(moved)
        serve.signal(signal.SIGHUP)
    await asyncio.gather(*loaders)
    # The last batch is written within 0.2 s.
    await wait_for(lambda: sum(len(access_log_lines(path)) for path in [*rotated, log_path]) >= sent)
    counted = sum(len(access_log_lines(path)) for path in [*rotated, log_path])
    assert sent > 50 and counted == sent
    # Every rotated file got lines: the reopen took effect each time.
    assert all(access_log_lines(path) for path in rotated)
