"""The client port's protocol switch alone (Server's upgrade_check, Writer.switch, the Pipe), on raw sockets.

No router: a handler that switches every request it may, and echoes what
arrives upper-cased; raw sockets as clients, so that the bytes sent right
after the head, a client that refuses the switch, and the connection's end
are exact.
"""

from __future__ import annotations

import asyncio

from router.http.messages import Reply, Request
from router.http.writer import Writer
from tests.support.http_harness import StartServer

HEAD = b"GET /tunnel HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n"


def may_switch(request: Request) -> bool:
    return request.path == "/tunnel"


async def echo_upper(request: Request, writer: Writer) -> None:
    pipe = writer.switch(101, b"Switching Protocols", [(b"Upgrade", b"echo"), (b"Connection", b"Upgrade")])
    if pipe is None:
        writer.answer(Reply(426, b"no switch", [(b"Content-Type", b"text/plain")]))
        return
    try:
        while data := await pipe.read():
            if pipe.write(data.upper()):
                await pipe.drain()
    except ConnectionResetError:
        pass  # the client went away with bytes still to echo
    pipe.close()


async def read_until(reader: asyncio.StreamReader, wanted: bytes) -> bytes:
    got = b""
    while wanted not in got:
        chunk = await asyncio.wait_for(reader.read(65536), timeout=10)
        assert chunk, got
        got += chunk
    return got


async def test_a_switched_connection_carries_bytes_both_ways_even_those_sent_with_the_head(
    start_server: StartServer,
) -> None:
    harness = await start_server(echo_upper, upgrade_check=may_switch)
    reader, writer = await asyncio.open_connection(*harness.address)
    try:
        # Bytes right behind the head are the new protocol's, never parsed as HTTP.
        writer.write(HEAD + b"GET / HTTP/1.1\r\n\r\nfirst")
        got = await read_until(reader, b"FIRST")
        assert got.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
        assert b"X-Request-Id: " in got and b"GET / HTTP/1.1\r\n\r\nFIRST".upper() in got
        big = b"x" * (1 << 20)
        writer.write(big)
        await read_until(reader, b"X" * 1000)
        # The client's end ends the connection.
        writer.write_eof()
        await asyncio.wait_for(reader.read(), timeout=10)
        assert reader.at_eof()
    finally:
        writer.close()


async def test_a_request_the_check_does_not_pass_is_answered_in_http_and_the_connection_goes_on(
    start_server: StartServer,
) -> None:
    harness = await start_server(echo_upper, upgrade_check=lambda request: False)
    reader, writer = await asyncio.open_connection(*harness.address)
    try:
        writer.write(HEAD + HEAD)
        got = await read_until(reader, b"no switch")
        got += await read_until(reader, b"no switch") if got.count(b"no switch") < 2 else b""
        assert got.count(b"HTTP/1.1 426") == 2
    finally:
        writer.close()


async def test_a_switch_candidate_answered_in_http_closes_its_connection(start_server: StartServer) -> None:
    """What the client sent after the head may be the new protocol's: once answered, nothing more is read."""

    async def refuse(request: Request, writer: Writer) -> None:
        writer.answer(Reply(404, b"not here", [(b"Content-Type", b"text/plain")]))

    harness = await start_server(refuse, upgrade_check=may_switch)
    reader, writer = await asyncio.open_connection(*harness.address)
    try:
        writer.write(HEAD + b"\x81\x05hello")
        got = await asyncio.wait_for(reader.read(), timeout=10)
        assert got.startswith(b"HTTP/1.1 404") and b"Connection: close\r\n" in got and got.endswith(b"not here")
    finally:
        writer.close()
