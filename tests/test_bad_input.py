"""Request smuggling vectors on the client port: 400, connection closed, nothing forwarded."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import StartFake, StartRouter, replica_entry

BODY = b'{"model": "m", "messages": []}'
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"

VECTORS = {
    "two different content-lengths": HEAD + b"Content-Length: 30\r\nContent-Length: 5\r\n\r\n" + BODY,
    "content-length and transfer-encoding": HEAD
    + b"Content-Length: 30\r\nTransfer-Encoding: chunked\r\n\r\n1e\r\n"
    + BODY
    + b"\r\n0\r\n\r\n",
    "chunked, identity": HEAD + b"Transfer-Encoding: chunked, identity\r\n\r\n" + BODY,
    "bare LF line ends": HEAD.replace(b"\r\n", b"\n") + b"Content-Length: 30\n\n" + BODY,
    "obs-fold": HEAD + b"Content-Length: 30\r\nX-Folded: a\r\n b\r\n\r\n" + BODY,
    "NUL in a header": HEAD + b"Content-Length: 30\r\nX-Nul: a\x00b\r\n\r\n" + BODY,
    "negative content-length": HEAD + b"Content-Length: -1\r\n\r\n" + BODY,
    "oversize header": HEAD + b"X-Big: " + b"a" * 20_000 + b"\r\nContent-Length: 30\r\n\r\n" + BODY,
    "too many headers": HEAD + b"".join(b"X-H%d: 1\r\n" % i for i in range(200)) + b"Content-Length: 30\r\n\r\n" + BODY,
}


async def send_raw(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(65536), 5)
        # The connection must be closed after the answer: nothing left to smuggle.
        rest = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    return answer + rest


@pytest.mark.parametrize("name", list(VECTORS))
async def test_smuggling_vectors_are_refused_and_never_forwarded(
    start_fake: StartFake, start_router: StartRouter, name: str
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    host, port = server.client_address  # type: ignore[misc]
    answer = await send_raw(host, port, VECTORS[name])
    assert answer.split(b" ", 2)[1] == b"400", answer[:200]
    assert fake.seen == []
