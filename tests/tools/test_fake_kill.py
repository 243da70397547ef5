"""The fake replica's kill(), which the soak and the fault tests rest on: a killed engine keeps nothing open.

A connection the loop accepted a turn before the kill once outlived it with
its request read and never answered (asyncio drops a connection whose
transport it makes after its server closed, unclosed): the soak's router
waited on it for its first-byte timeout while every held request timed out.
"""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from router.tools.fake import Behaviour, FakeReplica

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def read_to_the_end(sock: socket.socket) -> bytes:
    """What the peer sent before it closed or reset the connection."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


# Loop turns between the client's connect and the kill: each lands the kill in another
# step of the accept (in the kernel's backlog, accepted, transport made, handler running).
@pytest.mark.parametrize("turns", [0, 1, 2, 3, 4, 6])
async def test_a_connection_made_as_the_replica_is_killed_is_reset_and_the_port_refuses(turns: int) -> None:
    # An engine still at the prompt: whatever turn the kill lands on, no answer can be under way.
    fake = FakeReplica(models=("m",), behaviour=Behaviour(first_token_delay=30))
    await fake.start("127.0.0.1", 0)
    port = int(fake.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(REQUEST)
        for _ in range(turns):
            await asyncio.sleep(0)
        async with asyncio.timeout(5):
            await fake.kill()
        sock.settimeout(5)
        answer = await asyncio.to_thread(read_to_the_end, sock)
    assert answer == b"", answer
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


async def test_a_killed_replica_restarts_on_its_port_and_answers() -> None:
    fake = FakeReplica(models=("m",))
    await fake.start("127.0.0.1", 0)
    port = int(fake.url.rsplit(":", 1)[1])
    await fake.kill()
    await fake.start("127.0.0.1", port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(REQUEST.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
            answer = await asyncio.to_thread(read_to_the_end, sock)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    finally:
        await fake.stop()
