"""WebSocket upgrades by RFC 9110 7.8 and RFC 6455, keys, aliases and stalls, on raw sockets.

The client is a raw socket (exact bytes out, every byte back), the replica
the fake (a real aiohttp WebSocket) or one written for the test. What is
judged: only an HTTP/1.1 GET whose Upgrade names `websocket` is tunnelled;
a replica may switch only to what was asked; a refusal of the router's own
(a missing key) is an answer, never a traceback; a replica's answer that is
no switch passes as it comes; the query reaches the replica as it was sent,
but for the model's name; a client that takes nothing is reset.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket

import pytest

from router.core.pool.replicas import Replica
from router.run.app import RouterServer
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import get_json
from tests.support.raw_server import StartRaw, fixed
from tests.support.waiting import wait_for
from tests.support.wire import Answer, Wire, chunk

KEY = "sk-tenant"


def upgrade(
    query: bytes = b"?model=m", *, version: bytes = b"1.1", upgrade: bytes = b"websocket", extra: bytes = b""
) -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (
        b"GET /v1/realtime" + query + b" HTTP/" + version + b"\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: "
        + upgrade + b"\r\nSec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n" + extra + b"\r\n"
    )  # fmt: skip


def replica(server: RouterServer, rid: str) -> Replica:
    found = server.pool.get(rid)
    assert found is not None
    return found


async def switched(server: RouterServer, request: bytes) -> tuple[Wire, bytes]:
    """The raw connection, once the router answered `request`'s upgrade, and its head."""
    wire = await Wire.open(server.client_address)
    wire.send(request)
    head = await asyncio.wait_for(wire.reader.readuntil(b"\r\n\r\n"), timeout=10)
    return wire, head


@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer wrong\r\n"], ids=["no-key", "wrong-key"])
async def test_an_upgrade_without_a_valid_key_is_a_401_and_no_traceback(
    start_fake: StartFake, start_router: StartRouter, caplog: pytest.LogCaptureFixture, auth: bytes
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=[KEY])
    caplog.set_level(logging.ERROR)
    async with await Wire.open(server.client_address) as wire:
        wire.send(upgrade(extra=auth))
        answer = await wire.answer()
    assert answer.status == 401
    assert answer.json()["error"] == {
        "message": "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' (or 'X-Api-Key').",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert fake.seen == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_an_upgrade_with_the_key_is_switched_and_the_key_never_reaches_the_replica(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], api_keys=[KEY])
    wire, head = await switched(server, upgrade(extra=f"Authorization: Bearer {KEY}\r\n".encode()))
    async with wire:
        assert head.startswith(b"HTTP/1.1 101 ")
    (seen,) = fake.seen
    assert "Authorization" not in seen.headers


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(upgrade(version=b"1.0"), id="http-1.0"),
        pytest.param(upgrade(upgrade=b"notwebsocket"), id="upgrade-notwebsocket"),
        pytest.param(upgrade(upgrade=b"h2c, websocketx"), id="upgrade-list-without-websocket"),
        pytest.param(b"GET /v1/realtime?model=m HTTP/1.1\r\nHost: x\r\n\r\n", id="no-upgrade"),
    ],
)
async def test_a_request_that_does_not_ask_for_a_websocket_is_426_and_reaches_no_replica(
    start_fake: StartFake, start_router: StartRouter, request_bytes: bytes
) -> None:
    """RFC 9110 7.8: an HTTP/1.0 request's Upgrade is ignored; Upgrade is a list of protocol names, not text."""
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(request_bytes)
        answer = await wire.answer()
    assert answer.status == 426
    assert answer.header(b"upgrade") == b"websocket"
    assert fake.seen == []
    assert replica(server, "r0").requests == 0


async def test_websocket_is_found_in_an_upgrade_list_in_any_case(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    wire, head = await switched(server, upgrade(upgrade=b"h2c, WebSocket"))
    async with wire:
        assert head.startswith(b"HTTP/1.1 101 ")


async def test_a_101_to_a_protocol_the_client_did_not_ask_for_is_a_502(
    start_router: StartRouter, raw_server: StartRaw
) -> None:
    raw = await raw_server(
        fixed(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n\x00\x00", close=True)
    )
    server = await start_router([{"id": "r0", "model": "m", "url": f"http://{raw.address}"}])
    async with await Wire.open(server.client_address) as wire:
        wire.send(upgrade())
        answer = await wire.answer()
    assert answer.status == 502
    assert b"h2c" in answer.body
    await wait_for(lambda: replica(server, "r0").in_flight == 0)
    assert replica(server, "r0").errors == {"reset": 1}


async def test_a_replicas_event_stream_in_answer_to_an_upgrade_passes_as_it_comes(
    start_router: StartRouter, raw_server: StartRaw
) -> None:
    """The first event reaches the client while the replica still holds the rest back."""
    release = asyncio.Event()

    async def events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(chunk(b"data: first\n\n"))
        await writer.drain()
        await asyncio.wait_for(release.wait(), timeout=30)
        writer.write(chunk(b"data: last\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    raw = await raw_server(events)
    server = await start_router([{"id": "r0", "model": "m", "url": f"http://{raw.address}"}])
    wire = await Wire.open(server.client_address)
    try:
        wire.send(upgrade())
        head = await asyncio.wait_for(wire.reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head
        first = await asyncio.wait_for(wire.reader.readuntil(b"data: first\n\n"), timeout=10)
        assert first.endswith(b"data: first\n\n")
        release.set()
        rest = await asyncio.wait_for(wire.reader.read(), timeout=10)
        assert b"data: last\n\n" in rest and rest.endswith(b"0\r\n\r\n"), (first, rest)
    finally:
        release.set()
        wire.writer.close()
    await wait_for(lambda: replica(server, "r0").in_flight == 0)
    (row,) = await get_json(server.admin_url + "/api/v1/replicas")
    assert row["requests"] == 1 and row["errors"] == 0


async def test_a_replicas_stream_cut_short_looks_cut_short_to_the_client(
    start_router: StartRouter, raw_server: StartRaw
) -> None:
    raw = await raw_server(
        fixed(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 100\r\n\r\ndata: x\n\n", close=True
        )
    )
    server = await start_router([{"id": "r0", "model": "m", "url": f"http://{raw.address}"}])
    async with await Wire.open(server.client_address) as wire:
        wire.send(upgrade())
        answer: Answer = await wire.answer()
    assert answer.status == 200 and not answer.complete
    await wait_for(lambda: replica(server, "r0").errors == {"reset": 1})


async def test_an_alias_rewrites_the_querys_model_and_nothing_else(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("whisper-large")
    server = await start_router([replica_entry("r0", fake)], models={"whisper-large": {"aliases": ["asr"]}})
    wire, head = await switched(server, upgrade(b"?x=%ff&model=asr&z&y=a+b%20c"))
    async with wire:
        assert head.startswith(b"HTTP/1.1 101 ")
    (seen,) = fake.seen
    assert seen.path == "/v1/realtime?x=%ff&model=whisper-large&z&y=a+b%20c"


async def test_a_client_that_takes_nothing_is_reset_not_left_with_megabytes_unsent(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """After the write-stall timeout the router's socket is reset: no orphan holds the echo for minutes."""
    fake = await start_fake("m")
    server = await start_router(
        [replica_entry("r0", fake)], write_stall_timeout_seconds=0.5, upstream_idle_timeout_seconds=60
    )
    assert server.client_address is not None
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, server.client_address)
        await loop.sock_sendall(sock, upgrade())
        head = b""
        while b"\r\n\r\n" not in head:
            head += await asyncio.wait_for(loop.sock_recv(sock, 1), timeout=10)
        assert head.startswith(b"HTTP/1.1 101 ")
        # 8 MiB in masked binary frames, echoed back by the replica and never read.
        frame = b"\x82\xff" + (1 << 20).to_bytes(8, "big") + b"\0\0\0\0" + os.urandom(1 << 20)
        for _ in range(8):
            await loop.sock_sendall(sock, frame)
        await wait_for(lambda: replica(server, "r0").in_flight == 0, timeout=10)
        # Now read: a reset arrives before the echo's megabytes do.
        with pytest.raises(ConnectionResetError):
            await read_all(loop, sock, 8 << 20)

    finally:
        sock.close()


async def read_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> None:
    """`size` bytes from `sock`; fails if it ends cleanly before."""
    received = 0
    while received < size:
        piece = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), timeout=10)
        assert piece, "the router closed without a reset, after sending the rest"
        received += len(piece)
