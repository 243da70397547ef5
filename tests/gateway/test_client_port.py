"""The client port through the router, against a hostile client on raw sockets.

What the server alone does is tested without the router
(tests/http/server/test_hostile_client.py); here are the ways a client can
try to get something past the router's own rules: its keys checked from a
request's head (never from a trailer), what it forwards to a replica
(never a hop-by-hop, framing or Upgrade field, never a fragment), its
routes' answers, and the protocol errors it exports.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import protocol_errors
from tests.support.wire import CHAT, Answer, Wire, post

GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"


def chunked_post(body: bytes, trailers: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n" % (len(body), body) + trailers + b"\r\n"
    )


async def test_a_key_sent_only_as_a_trailer_does_not_pass_the_key_check(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=["sk-right"])
    async with await Wire.open(server.client_address) as wire:
        wire.send(chunked_post(orjson.dumps(CHAT), b"Authorization: Bearer sk-right\r\n"))
        answer = await wire.answer()
    assert answer.status == 401
    assert fake.seen == []


async def test_underscored_framing_names_and_the_fragment_are_not_forwarded(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(
            post(
                path=b"/v1/chat/completions?x=1#frag",
                extra=b"Content_Length: 99\r\nTransfer_Encoding: chunked\r\nX_Custom: kept\r\n",
            )
        )
        assert (await wire.answer()).status == 200
    seen = fake.seen[-1]
    names = {name.lower() for name in seen.headers}
    assert "content_length" not in names and "transfer_encoding" not in names
    assert seen.path == "/v1/chat/completions?x=1"
    assert seen.body == orjson.dumps(CHAT)


async def test_upgrade_is_ignored_and_the_request_answered(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    body = orjson.dumps(CHAT)
    async with await Wire.open(server.client_address) as wire:
        # A websocket handshake on the model list, then (as curl --http2 does on
        # http://) an h2c upgrade on a POST with a body, then a plain request.
        wire.send(
            b"GET /v1/models HTTP/1.1\r\nHost: router\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        listing = await wire.answer()
        assert listing.status == 200 and listing.json()["object"] == "list"
        wire.send(
            post(
                body,
                extra=b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
            )
        )
        upgraded = await wire.answer()
        assert upgraded.status == 200 and upgraded.json()["object"] == "chat.completion"
        wire.send(post())
        assert (await wire.answer()).status == 200
    assert fake.seen[0].body == body
    assert "Upgrade" not in fake.seen[0].headers


async def test_allow_names_head_where_head_works(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(b"DELETE /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")
        refused = await wire.answer()
        assert refused.status == 405
        allowed = {m.strip() for m in (refused.header(b"allow") or b"").split(b",")}
        assert allowed == {b"GET", b"HEAD"}
        wire.send(b"HEAD /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")
        assert (await wire.answer(head_request=True)).status == 200


async def test_protocol_errors_are_counted_by_reason_and_logged_once_a_minute(
    start_fake: StartFake, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    caplog.set_level(logging.INFO, logger="router.http.server")
    for _ in range(3):
        async with await Wire.open(server.client_address) as wire:
            wire.send(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
            assert (await wire.answer()).status == 400
    async with await Wire.open(server.client_address) as wire:
        wire.send(b"GARBAGE\r\n\r\n")
        assert (await wire.answer()).status == 400
    counts = await protocol_errors(server.admin_url)
    assert counts == {"host": 3, "invalid_http": 1}
    lines = [r for r in caplog.records if r.name == "router.http.server"]
    assert [r.getMessage().split(":", 1)[0] for r in lines] == ["host", "invalid_http"]


def assert_unauthorized(answer: Answer) -> None:
    assert answer.status == 401
    # RFC 9110 11.6.1: a 401 carries a challenge.
    assert answer.header(b"www-authenticate") == b"Bearer"
    assert answer.json()["error"]["code"] == "invalid_api_key"  # type: ignore[index]


async def test_a_body_without_a_key_is_refused_from_its_head_and_holds_no_buffer(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=["sk-right"], max_buffered_body_bytes=3000)
    keyless = post(orjson.dumps({**CHAT, "pad": "x" * 2800}))
    async with await Wire.open(server.client_address) as stranger:
        # Most of a body that would take nearly all of the budget, and no key.
        stranger.send(keyless[:-20])
        refused = await stranger.answer()
        assert_unauthorized(refused)
        # Nothing of the body was read or kept: the connection closes after the answer.
        assert refused.header(b"connection") == b"close"
        async with await Wire.open(server.client_address) as wire:
            wire.send(post(extra=b"Authorization: Bearer sk-right\r\n"))
            assert (await wire.answer()).status == 200
        # The rest of the body is dropped as it comes; then the connection closes.
        stranger.send(keyless[-20:])
        assert await stranger.closed() == b""
    assert len(fake.seen) == 1


async def test_a_body_without_a_key_gets_401_instead_of_100_continue(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=["sk-right"])
    body = orjson.dumps(CHAT)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(body, extra=b"Expect: 100-continue\r\nAuthorization: Bearer sk-wrong\r\n")[: -len(body)])
        assert_unauthorized(await wire.answer())
    assert fake.seen == []


async def test_a_request_without_a_key_or_a_body_gets_401_and_the_connection_stays(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=["sk-right"])
    async with await Wire.open(server.client_address) as wire:
        wire.send(GET_MODELS)
        refused = await wire.answer()
        assert_unauthorized(refused)
        assert refused.header(b"connection") is None
        wire.send(b"GET /v1/models HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer sk-right\r\n\r\n")
        assert (await wire.answer()).status == 200


# What the server answers as the router's own -----------------------------------------------------


def request(body: bytes, *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/"
        + version
        + b"\r\nHost: router\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a Content-Length: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def test_expect_100_continue_is_answered_before_the_body(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    body = orjson.dumps(CHAT)
    try:
        full = request(body, extra=b"Expect: 100-continue\r\n")
        writer.write(full[: -len(body)])  # the head only
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        head, answer = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert orjson.loads(answer)["object"] == "chat.completion"
    finally:
        writer.close()
    # The replica never sees the Expect header (the router answered it).
    assert "Expect" not in fake.seen[-1].headers


async def test_a_204_from_the_replica_passes_without_a_body_or_length(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(fail_status=204, fail_body=b""))
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        # Asked as a stream, still no chunks: a 204 has no body at all.
        writer.write(request(orjson.dumps({**CHAT, "stream": True})) + request(orjson.dumps(CHAT)))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 204")
        assert b"content-length" not in head.lower()
        assert b"transfer-encoding" not in head.lower()
        # The next bytes are the second answer's head: nothing was sent between.
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert second.startswith(b"HTTP/1.1 204")
    finally:
        writer.close()
