"""WebSocket sessions (vLLM's /v1/realtime) through the real router, with aiohttp's client and server.

Routed by the query's model, relayed to the replica, and after its 101 the
bytes flow both ways until either side closes; the session counts as in
flight on its replica the whole time; every other Upgrade is ignored as before.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
import struct
from pathlib import Path

import aiohttp
import orjson
import pytest

from router.core.pool.replicas import Replica
from router.run.app import RouterServer
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry
from tests.support.clients import access_log_lines, get_json
from tests.support.raw_server import StartRaw, fixed
from tests.support.waiting import wait_for

# RFC 6455 4.2.2: the accept key is the client's key and this GUID, hashed.
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def replica(server: RouterServer, rid: str) -> Replica:
    found = server.pool.get(rid)
    assert found is not None
    return found


def ws_url(server: RouterServer, query: str = "") -> str:
    return server.client_url.replace("http://", "ws://") + "/v1/realtime" + query


async def test_a_session_reaches_the_replica_of_the_query_model_and_carries_both_ways(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    small, large = await start_fake("small"), await start_fake("large")
    server = await start_router([replica_entry("s", small), replica_entry("l", large)])
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server, "?model=large")) as ws:
        created = orjson.loads(await ws.receive_bytes())
        assert created == {"type": "session.created", "model": "large", "served_by": large.name}
        # In flight on its replica for the whole session: never idle while it is open.
        assert replica(server, "l").in_flight == 1 and replica(server, "l").last_used is not None
        for i in range(20):
            await ws.send_str(f"message {i}")
            assert await ws.receive_str() == f"message {i}"
        payload = bytes(range(256)) * 1024
        await ws.send_bytes(payload)
        assert await ws.receive_bytes() == payload
    await wait_for(lambda: replica(server, "l").in_flight == 0)
    assert small.seen == [] and [seen.path for seen in large.seen] == ["/v1/realtime?model=large"]


async def test_the_replica_closing_ends_the_clients_session(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server)) as ws:
        # No model in the query: the only model served.
        assert orjson.loads(await ws.receive_bytes())["served_by"] == fake.name
        await ws.send_str("close")
        message = await ws.receive()
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await wait_for(lambda: replica(server, "r0").in_flight == 0 and fake.active == 0)


async def test_an_alias_in_the_query_reaches_the_engine_under_the_models_name(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("whisper-large")
    server = await start_router([replica_entry("r0", fake)], models={"whisper-large": {"aliases": ["asr"]}})
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server, "?model=asr&x=1")) as ws:
        assert orjson.loads(await ws.receive_bytes())["model"] == "whisper-large"


async def test_an_unknown_model_is_404_and_no_session(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(ws_url(server, "?model=nope"))
        assert refused.value.status == 404
    assert fake.seen == []


async def test_a_session_idle_both_ways_is_ended(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], upstream_idle_timeout_seconds=0.3)
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server), autoping=False) as ws:
        await ws.receive_bytes()
        message = await asyncio.wait_for(ws.receive(), timeout=10)
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
    await wait_for(lambda: replica(server, "r0").in_flight == 0)


async def test_a_draining_router_waits_for_an_open_session(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], shutdown_grace_seconds=10)
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server)) as ws:
        await ws.receive_bytes()
        stopping = asyncio.get_running_loop().create_task(server.stop())
        # Into the drain: it no longer accepts, and waits for what is open.
        await wait_for(lambda: not server.ready and server._client_listener is None)
        # Still carried while the router drains.
        await ws.send_str("still here")
        assert await ws.receive_str() == "still here"
        assert not stopping.done()
        await ws.close()
    await asyncio.wait_for(stopping, timeout=10)


async def test_another_upgrade_is_ignored_as_before(start_fake: StartFake, start_router: StartRouter) -> None:
    """An Upgrade elsewhere (or not to a WebSocket) is answered in HTTP/1.1, and the connection goes on."""
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    assert server.client_address is not None
    host, port = server.client_address
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answers = b""
        while answers.count(b"HTTP/1.1 200") < 2:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=10)
            assert chunk
            answers += chunk
    finally:
        writer.close()


async def test_a_session_counts_as_a_request_of_the_replica_it_reached_and_a_refused_connect_apart(
    start_fake: StartFake, start_router: StartRouter, refused_url: RefusedUrl
) -> None:
    good = await start_fake("m")
    server = await start_router([{"id": "dead", "model": "m", "url": refused_url()}, replica_entry("good", good)])
    sessions = 0
    rows: dict[str, dict[str, int]] = {}
    # Picks are at random between the two: until one of them found the dead replica.
    while sessions < 30 and not rows.get("dead", {}).get("connects_failed"):
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server)) as ws:
            await ws.send_str("hi")
            await ws.receive(timeout=10)
        sessions += 1
        rows = {row["id"]: row for row in await get_json(server.admin_url + "/api/v1/replicas")}
    assert rows["dead"]["connects_failed"] >= 1
    assert rows["dead"]["requests"] == 0
    assert rows["good"]["requests"] == sessions
    assert rows["good"]["connects_failed"] == 0


async def logged_stalled(path: Path) -> None:
    """The session's one access-log line says the stall ended it."""
    await wait_for(lambda: len(access_log_lines(path)) == 1, timeout=5)
    (line,) = access_log_lines(path)
    assert line["path"] == "/v1/realtime" and line["status"] == 101 and line["outcome"] == "stalled"


def masked_binary_frame(payload: bytes) -> bytes:
    """A client's binary frame (RFC 6455 5.2), masked with a zero key so the payload goes as it is."""
    return b"\x82\xff" + struct.pack("!Q", len(payload)) + b"\0\0\0\0" + payload


async def test_a_replica_that_takes_nothing_it_is_sent_ends_the_session(
    start_router: StartRouter, raw_server: StartRaw, tmp_path: Path
) -> None:
    """The write-stall rule toward the replica: after its 101 it reads nothing more, and the router gives up on it."""
    released = asyncio.Event()

    async def switch_then_read_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head = raw.requests[-1].decode("latin-1")
        key = next(
            line.split(":", 1)[1].strip()
            for line in head.split("\r\n")
            if line.lower().startswith("sec-websocket-key:")
        )
        accept = base64.b64encode(hashlib.sha1(key.encode() + GUID).digest()).decode()
        writer.write(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode()
        )
        await writer.drain()
        # Neither reads nor ends: an engine wedged with the session open.
        await asyncio.wait_for(released.wait(), timeout=30)
        writer.close()

    raw = await raw_server(switch_then_read_nothing)
    log_path = tmp_path / "access.log"
    server = await start_router(
        [{"id": "r0", "model": "m", "url": f"http://{raw.address}"}],
        write_stall_timeout_seconds=0.5,
        upstream_idle_timeout_seconds=60,
        access_log=str(log_path),
    )
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(server)) as ws:
            assert replica(server, "r0").in_flight == 1

            async def flood() -> None:
                chunk = os.urandom(1 << 20)
                for _ in range(64):
                    await ws.send_bytes(chunk)

            sending = asyncio.get_running_loop().create_task(flood())
            try:
                # The router ends the session: the client's side closes, well before 64 MiB went anywhere.
                message = await asyncio.wait_for(ws.receive(), timeout=10)
                assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        await wait_for(lambda: replica(server, "r0").in_flight == 0)
        await logged_stalled(log_path)
    finally:
        released.set()


async def test_a_client_that_reads_nothing_it_is_sent_ends_the_session(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    """The write-stall rule toward the client: it sends and never reads, and the replica's echo has nowhere to go."""
    fake = await start_fake("m")
    log_path = tmp_path / "access.log"
    server = await start_router(
        [replica_entry("r0", fake)],
        write_stall_timeout_seconds=0.5,
        upstream_idle_timeout_seconds=60,
        access_log=str(log_path),
    )
    assert server.client_address is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small window, so that what the router sends it backs up in the router, not in this kernel.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, server.client_address)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                "GET /v1/realtime?model=m HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 101 ")
        await wait_for(lambda: fake.active == 1)
        # 8 MiB echoed back, and never read.
        chunk = os.urandom(1 << 20)
        for _ in range(8):
            writer.write(masked_binary_frame(chunk))
        await wait_for(lambda: replica(server, "r0").in_flight == 0, timeout=10)
        await wait_for(lambda: fake.active == 0, timeout=10)
        await logged_stalled(log_path)
    finally:
        writer.transport.abort()


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        pytest.param(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\nno", 403, id="refused"),
        pytest.param(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", 502, id="101-without-connection"
        ),
        pytest.param(b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n", 502, id="status-099"),
    ],
)
async def test_a_replica_that_will_not_switch_is_answered_for_and_counted(
    start_router: StartRouter, raw_server: StartRaw, reply: bytes, status: int
) -> None:
    """Its refusal is the client's; a 101 or a status line it may not send is a 502; either way it took the request."""
    raw = await raw_server(fixed(reply, close=True))
    server = await start_router([{"id": "r0", "model": "m", "url": f"http://{raw.address}"}])
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(ws_url(server))
        assert refused.value.status == status
    assert len(raw.requests) == 1
    await wait_for(lambda: replica(server, "r0").in_flight == 0)
    (row,) = await get_json(server.admin_url + "/api/v1/replicas")
    assert row["requests"] == 1 and row["connects_failed"] == 0
    # A refusal is an answer; a broken switch a failure, as a stream reset before its answer is.
    assert row["errors"] == (0 if status == 403 else 1)
    assert replica(server, "r0").errors == ({} if status == 403 else {"reset": 1})


async def test_a_replica_that_never_answers_the_upgrade_is_a_504_and_a_timeout(
    start_router: StartRouter, raw_server: StartRaw
) -> None:
    released = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.wait_for(released.wait(), timeout=30)
        writer.close()

    raw = await raw_server(silent)
    server = await start_router(
        [{"id": "r0", "model": "m", "url": f"http://{raw.address}"}], first_byte_timeout_seconds=0.3
    )
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(ws_url(server))
            assert refused.value.status == 504
        assert replica(server, "r0").errors == {"timeout": 1}
    finally:
        released.set()
