"""The router in front of a replica that compresses its answers: read under their Content-Encoding, or passed on.

A replica's error the router reshapes is read through its coding (gzip,
deflate, several members), one it cannot read passes through as it came, and
the Responses API's memory finds an answer's id whatever coding or framing it
came in. The replicas that break HTTP itself are in test_broken_replica.py.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable

import openai
import orjson
import pytest

from tests.conftest import StartRouter
from tests.support.wire import (
    Exchange,
    StartRaw,
    Wire,
    chunk,
    json_answer,
    post,
    sse_head,
)


def entry(url: str, rid: str = "r0") -> dict[str, str]:
    return {"id": rid, "model": "m", "url": url}


# Compressed answers: read under their Content-Encoding, or passed on untouched ----------------------


def error_answer(status: int, body: bytes, coding: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 %d Whatever\r\nContent-Type: %b\r\nContent-Encoding: %b\r\nVary: Accept-Encoding\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (status, content_type, coding, len(body), body)
    )


@pytest.mark.parametrize("status", [400, 503])
@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"detail": "the prompt is too long: 9000 tokens, at most 8192"}', b"application/json"),
        (
            b'{"error": {"message": "the prompt is too long: 9000 tokens, at most 8192",'
            b' "type": "invalid_request_error", "param": null, "code": null}}',
            b"application/json",
        ),
        (b"the prompt is too long: 9000 tokens, at most 8192", b"text/plain"),
    ],
    ids=["detail", "openai-shaped", "plain-text"],
)
async def test_the_openai_sdk_gets_the_words_of_a_gzipped_replica_error(
    start_raw: StartRaw, start_router: StartRouter, body: bytes, content_type: bytes, status: int
) -> None:
    """The SDK asks for gzip; the replica's middleware compresses its error: the client still reads its message."""

    async def answer(exchange: Exchange) -> None:
        await exchange.write(error_answer(status, gzip.compress(body), b"gzip", content_type))

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    client = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=10)
    async with client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == status
    assert "the prompt is too long: 9000 tokens, at most 8192" in info.value.message
    assert b"accept-encoding: gzip" in replica.requests[0].lower()


@pytest.mark.parametrize(
    ("coding", "body"),
    [
        (b"br", b"\x1b\x1f\x00\xf8\x25\x40\xa2\x8c\x2c\x00\x07"),
        (b"zstd", b"\x28\xb5\x2f\xfd\x20\x05\x29\x00\x00hello"),
        # Inflates to 16 MiB: past what the router decodes, so it is not read at all.
        (b"gzip", gzip.compress(b" " * (16 << 20))),
        (b"gzip", b"\x1f\x8b\x08\x00 not gzip after all"),
    ],
    ids=["br", "zstd", "gzip-bomb", "not-gzip"],
)
async def test_an_error_the_router_cannot_read_passes_through_untouched(
    start_raw: StartRaw, start_router: StartRouter, coding: bytes, body: bytes
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(error_answer(500, body, coding))

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer(timeout=10)
    assert answer_.status == 500
    assert answer_.body == body
    assert answer_.header(b"content-encoding") == coding


async def test_a_reshaped_error_no_longer_names_the_replicas_coding(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(error_answer(422, gzip.compress(b'{"detail": "bad role"}'), b"gzip"))

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 422
    assert answer_.header(b"content-encoding") is None
    assert answer_.json()["error"]["message"] == "bad role"  # type: ignore[index]


def sse_event(ident: str) -> bytes:
    created = {"type": "response.created", "response": {"id": ident, "object": "response", "status": "in_progress"}}
    return b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def two_members(data: bytes) -> bytes:
    """Two gzip members, the first ending 40 bytes in: inside the first event's id."""
    return gzip.compress(data[:40]) + gzip.compress(data[40:])


# A stream's codings, each with the Content-Encoding it is sent under.
STREAM_CODINGS: dict[str, tuple[Callable[[bytes], bytes], bytes]] = {
    "gzipped-sse": (gzip.compress, b"gzip"),
    "gzip-members-sse": (two_members, b"gzip"),
    "raw-deflate-sse": (raw_deflate, b"deflate"),
}


@pytest.mark.parametrize(
    "form", ["gzipped-json", "raw-deflate-json", "gzipped-sse", "gzip-members-sse", "raw-deflate-sse", "chunked-json"]
)
async def test_the_responses_memory_finds_the_id_of_a_compressed_or_chunked_answer(
    start_raw: StartRaw, start_router: StartRouter, form: str
) -> None:
    """GET /v1/responses/{id} reaches the replica that made it, whatever framing or coding its answer had."""
    ident = f"resp_{form.replace('-', '_')}"
    doc = orjson.dumps({"id": ident, "object": "response", "status": "completed", "output": []})

    async def answer(exchange: Exchange) -> None:
        if exchange.head.startswith(b"GET"):
            await exchange.write(json_answer(doc))
        elif form.endswith("-json") and form != "chunked-json":
            coded, coding = (gzip.compress(doc), b"gzip") if form == "gzipped-json" else (raw_deflate(doc), b"deflate")
            await exchange.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: %b\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (coding, len(coded), coded)
            )
        elif form in STREAM_CODINGS:
            code, coding = STREAM_CODINGS[form]
            coded = code(sse_event(ident) + b"event: response.completed\ndata: {}\n\n")
            await exchange.write(sse_head(b"Content-Encoding: %b\r\n" % coding))
            for start in range(0, len(coded), 7):
                await exchange.write(chunk(coded[start : start + 7]))
            await exchange.write(b"0\r\n\r\n")
        else:
            await exchange.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunk(doc[:10])
                + chunk(doc[10:])
                + b"0\r\n\r\n"
            )

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(orjson.dumps({"model": "m", "input": "hi"}), path=b"/v1/responses"))
        assert (await wire.answer()).status == 200
        wire.send(b"GET /v1/responses/%b HTTP/1.1\r\nHost: router\r\n\r\n" % ident.encode())
        fetched = await wire.answer()
    assert fetched.status == 200, fetched.body
    assert fetched.json()["id"] == ident
    assert replica.requests[-1].startswith(b"GET /v1/responses/" + ident.encode())
