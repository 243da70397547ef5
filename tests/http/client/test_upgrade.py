"""The upgrade client (router/http/client/upgrade.py) against replicas that switch, refuse, or misbehave.

A WebSocket's request goes on a connection of its own: after a 101 the
replica's bytes are the new protocol's, handed over in a Pipe from the first
byte past the head; any other answer is read whole, within bounds, for the
client; whatever else the replica does is a ConnectFailed, HeadTimeout or
ConnectionBroken saying how far it got, never a hang or a buffer without
bound. Each replica is a real socket on 127.0.0.1 sending exact bytes.
"""

from __future__ import annotations

import asyncio

import pytest

from router.http.client import MAX_HEAD_BYTES, ConnectFailed, ConnectionBroken, HeadTimeout
from router.http.client.upgrade import Answer, upgrade
from router.http.origin import Origin
from tests.conftest import RefusedUrl
from tests.support.raw_server import RawServer, StartRaw, fixed

HEAD = (
    b"GET /v1/realtime?model=m HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"


async def ask(raw: RawServer, *, head_timeout: float = 5, limit: int = 1 << 20) -> Answer:
    return await upgrade(raw.origin, HEAD, connect_timeout=2, head_timeout=head_timeout, limit=limit)


async def test_a_101_hands_over_the_bytes_that_follow_its_head_and_carries_both_ways(raw_server: StartRaw) -> None:
    """The new protocol's first bytes may come in the head's own read: they are the pipe's first."""
    heard: list[bytes] = []

    async def switch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(SWITCH + b"\x81\x05hello")
        heard.append(await reader.readexactly(4))
        writer.close()

    raw = await raw_server(switch)
    answer = await ask(raw)
    assert answer.status == 101 and answer.pipe is not None
    assert (b"upgrade", b"websocket") in [(name.lower(), value) for name, value in answer.headers]
    assert await answer.pipe.read() == b"\x81\x05hello"
    answer.pipe.write(b"back")
    await answer.pipe.drain()
    # The replica's close ends the pipe: read() gives b"" once.
    assert await asyncio.wait_for(answer.pipe.read(), timeout=5) == b""
    assert heard == [b"back"] and raw.requests == [HEAD]


async def test_a_refusal_is_read_whole_for_the_client_and_the_connection_closed(raw_server: StartRaw) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 9\r\n\r\nforbidden"))
    answer = await ask(raw)
    assert (answer.status, answer.reason, answer.body, answer.pipe) == (403, b"Forbidden", b"forbidden", None)


async def test_a_refusal_whose_body_ends_with_the_connection_is_whole_at_its_close(raw_server: StartRaw) -> None:
    """RFC 9112 6.3: no length and no chunks, the body is what came before the close."""
    raw = await raw_server(fixed(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\nno websocket here", close=True))
    answer = await ask(raw)
    assert (answer.status, answer.body, answer.pipe) == (400, b"no websocket here", None)


async def test_interim_answers_are_passed_over_for_the_one_that_follows(raw_server: StartRaw) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + SWITCH + b"first"))
    answer = await ask(raw)
    assert answer.status == 101 and answer.pipe is not None
    assert answer.reason == b"Switching Protocols"
    assert all(name.lower() != b"link" for name, _ in answer.headers)
    assert await answer.pipe.read() == b"first"
    answer.pipe.close()


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", "not valid HTTP", id="not-http"),
        pytest.param(
            b"HTTP/1.1 101 Switching\x01Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
            "control character",
            id="control-byte-in-reason",
        ),
        pytest.param(
            b"HTTP/2.0 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2\r\n\r\n", "HTTP/2.0", id="http-2"
        ),
        pytest.param(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            "without Connection: Upgrade",
            id="101-without-connection",
        ),
        pytest.param(b"HTTP/1.1 " + b"x" * 100 + b"\r\n\r\n", "not valid HTTP", id="no-status"),
        # A refusal is the client's only if its status line is one to pass on, as any answer's (client/reader.py).
        pytest.param(
            b"HTTP/1.1 403 Forbid\x7fden\r\nContent-Length: 0\r\n\r\n", "control character", id="refusal-control-byte"
        ),
        pytest.param(b"HTTP/1.0 099 Odd\r\nContent-Length: 0\r\n\r\n", "status 99", id="refusal-status-099"),
        pytest.param(
            b"HTTP/1.1 600 Beyond\r\nConnection: close\r\n\r\nbody", "status 600", id="refusal-600-close-delimited"
        ),
    ],
)
async def test_a_replica_that_speaks_no_http_breaks_the_connection_before_any_head(
    raw_server: StartRaw, reply: bytes, said: str
) -> None:
    raw = await raw_server(fixed(reply, close=True))
    with pytest.raises(ConnectionBroken, match=said) as broken:
        await ask(raw)
    assert broken.value.before_head


async def test_a_head_without_end_is_cut_off_at_the_head_bound(raw_server: StartRaw) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\n")
        line = b"X-Padding: " + b"p" * 1000 + b"\r\n"
        for _ in range(2 * MAX_HEAD_BYTES // len(line)):
            if writer.is_closing():
                return
            writer.write(line)
            try:
                await writer.drain()
            except ConnectionError:
                return

    raw = await raw_server(endless)
    with pytest.raises(ConnectionBroken, match="head is over") as broken:
        await ask(raw)
    assert broken.value.before_head


async def test_a_refusal_past_the_limit_is_not_buffered(raw_server: StartRaw) -> None:
    body = b"x" * 200_000
    raw = await raw_server(fixed(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % len(body) + body))
    with pytest.raises(ConnectionBroken, match="over 65536 bytes") as broken:
        await ask(raw, limit=65536)
    assert not broken.value.before_head


@pytest.mark.parametrize(
    "reply",
    [pytest.param(b"", id="nothing"), pytest.param(b"HTTP/1.1 101 Swi", id="half-a-head")],
)
async def test_a_replica_that_closes_before_its_head_is_whole_breaks_it_before_the_head(
    raw_server: StartRaw, reply: bytes
) -> None:
    raw = await raw_server(fixed(reply, close=True))
    with pytest.raises(ConnectionBroken, match="closed the connection") as broken:
        await ask(raw)
    assert broken.value.before_head


async def test_a_refusal_cut_short_of_its_length_is_broken_after_its_head(raw_server: StartRaw) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 100\r\n\r\nonly this", close=True))
    with pytest.raises(ConnectionBroken, match="closed the connection") as broken:
        await ask(raw)
    assert not broken.value.before_head


async def test_a_silent_replica_is_a_head_timeout_and_its_connection_goes(raw_server: StartRaw) -> None:
    released = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        # Until the router hangs up (EOF), or the test ends.
        reading = asyncio.ensure_future(reader.read())
        await asyncio.wait([reading, asyncio.ensure_future(released.wait())], return_when=asyncio.FIRST_COMPLETED)
        reading.cancel()
        writer.close()

    raw = await raw_server(silent)
    try:
        with pytest.raises(HeadTimeout):
            await ask(raw, head_timeout=0.3)
    finally:
        released.set()


async def test_a_refused_connection_is_connect_failed(refused_url: RefusedUrl) -> None:
    with pytest.raises(ConnectFailed):
        await upgrade(Origin.parse(refused_url()), HEAD, connect_timeout=2, head_timeout=2)
