"""The router in front of a replica that breaks HTTP/1.1, on raw sockets both ways.

Each replica here is written for its test and sends exact bytes: a body
delimited by close, a chunk cut off, bytes nobody asked for, two answers in
one write, trailers, silence, an endless head, a protocol switch. The client
must never get a corrupted, mixed-up or complete-looking broken answer, and
nothing may hang or be sent to the replica twice.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time

import orjson
import pytest

from tests.conftest import StartRouter
from tests.support.clients import in_flight, protocol_errors
from tests.support.waiting import until, until_cancelled, wait_for
from tests.support.wire import (
    JSON_OK,
    Exchange,
    StartRaw,
    Wire,
    chunk,
    json_answer,
    post,
    sse_head,
    stream_post,
)


def entry(url: str, rid: str = "r0") -> dict[str, str]:
    return {"id": rid, "model": "m", "url": url}


async def test_a_body_delimited_by_close_gets_one_last_chunk_and_the_connection_stays_in_step(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        if exchange.index == 1:
            await exchange.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
            await exchange.write(JSON_OK)
            exchange.close()
        else:
            await exchange.write(json_answer())

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post() + post())
        first = await wire.answer()
        assert first.status == 200 and first.complete and first.body == JSON_OK
        # The next bytes are the second answer's head: no stray last-chunk between.
        second = await wire.answer()
        assert second.status == 200 and second.body == JSON_OK


async def test_an_sse_stream_cut_mid_chunk_ends_with_an_error_event_and_no_last_chunk(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    event = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'

    async def answer(exchange: Exchange) -> None:
        await exchange.write(sse_head() + chunk(event) + b'40\r\ndata: {"cho')
        exchange.close()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(stream_post())
        answer_ = await wire.answer()
        assert answer_.status == 200
        assert not answer_.complete, "a cut-off stream must not end with a last-chunk"
        events = [e for e in answer_.body.split(b"\n\n") if e]
        assert events[0] + b"\n\n" == event
        error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_error"
        assert await wire.closed() == b""


async def test_a_gzipped_sse_stream_cut_off_gets_no_plain_text_event_inside_its_coded_bytes(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    """An error event in plain text among gzip bytes is garbage to the client's decoder: the stream just ends broken."""
    coded = gzip.compress(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' * 50)
    sent = coded[: len(coded) // 2]

    async def answer(exchange: Exchange) -> None:
        await exchange.write(sse_head(b"Content-Encoding: gzip\r\n") + chunk(sent) + b"40\r\n\x1f")
        exchange.close()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(stream_post())
        answer_ = await wire.answer()
        assert answer_.status == 200
        assert answer_.header(b"content-encoding") == b"gzip"
        assert not answer_.complete
        assert answer_.body == sent + b"\x1f"
        assert await wire.closed() == b""


async def test_a_chunked_json_answer_cut_off_is_closed_without_an_event_or_a_last_chunk(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunk(b'{"id": "x", ')
            + b'20\r\n"obj'
        )
        exchange.close()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
        assert answer_.status == 200 and not answer_.complete
        assert b"data:" not in answer_.body and b"error" not in answer_.body
        assert await wire.closed() == b""


async def test_a_request_whose_answer_was_partly_read_is_never_sent_again(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        if exchange.index == 1:
            await exchange.write(json_answer())  # pooled for the next request
        else:
            await exchange.write(b"HTTP/1.1 200 OK\r\nContent-Le")
            exchange.close()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        assert (await wire.answer()).status == 200
        wire.send(post())
        assert (await wire.answer()).status == 502
    # The second POST reached the replica once: it was not retried after part of its answer came.
    assert len(replica.requests) == 2


async def test_bytes_on_an_idle_pooled_connection_never_become_the_next_answer(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    evil = orjson.dumps({"id": "unsolicited", "object": "chat.completion", "choices": []})
    idle = asyncio.Event()

    async def answer(exchange: Exchange) -> None:
        await exchange.write(json_answer())
        if exchange.index == 1:
            # Long after the answer, on the now idle connection: an answer nobody asked for.
            await idle.wait()
            await exchange.write(json_answer(evil))

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)], upstream_keepalive_seconds=30)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        assert (await wire.answer()).body == JSON_OK
        # Answered and given back: the connection is idle in the router's pool.
        await wait_for(lambda: in_flight(server) == {"r0": 0})
        idle.set()

        async def unsolicited() -> bool:
            return (await protocol_errors(server.admin_url, "upstream")).get("unsolicited_bytes") == 1

        # The bytes nobody asked for are seen on the idle connection before the next request.
        await until(unsolicited)
        wire.send(post())
        assert (await wire.answer()).body == JSON_OK
    assert (await protocol_errors(server.admin_url, "upstream")).get("unsolicited_bytes") == 1


async def test_a_second_answer_in_the_same_write_never_reaches_another_request(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    evil = orjson.dumps({"id": "second", "object": "chat.completion", "choices": []})

    async def answer(exchange: Exchange) -> None:
        await exchange.write(json_answer() + json_answer(evil))

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)], upstream_keepalive_seconds=30)
    async with await Wire.open(server.client_address) as wire:
        for _ in range(3):
            wire.send(post())
            assert (await wire.answer()).body == JSON_OK
    # Each such connection was closed, not pooled: one connection per request, none left open.
    assert replica.connections == 3
    assert server.upstream.open_connections == 0


async def test_a_replicas_trailers_never_become_response_headers(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        # Head, body and trailers in one write: a trailer must not join the head.
        await exchange.write(
            sse_head(b"Trailer: X-Evil\r\n")
            + chunk(b"data: [DONE]\n\n")
            + b"0\r\nX-Evil: yes\r\nSet-Cookie: a=b\r\n\r\n"
        )

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(stream_post())
        answer_ = await wire.answer()
    assert answer_.status == 200 and answer_.complete
    names = {name.lower() for name, _ in answer_.headers}
    assert b"x-evil" not in names and b"set-cookie" not in names


async def test_a_stream_that_falls_silent_ends_with_an_error_event_after_the_idle_timeout(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(sse_head() + chunk(b"data: {}\n\n"))
        await until_cancelled()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)], upstream_idle_timeout_seconds=0.5)
    async with await Wire.open(server.client_address) as wire:
        began = time.perf_counter()
        wire.send(stream_post())
        answer_ = await wire.answer(timeout=10)
        assert 0.5 <= time.perf_counter() - began < 3.0
    assert not answer_.complete
    error = orjson.loads(answer_.body.split(b"\n\n")[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_error"
    assert (await protocol_errors(server.admin_url, "upstream")).get("idle_timeout") == 1


@pytest.mark.parametrize("status", [200, 500])
async def test_a_body_shorter_than_its_length_then_silence_is_answered_after_the_idle_timeout(
    start_raw: StartRaw, start_router: StartRouter, status: int
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(
            b'HTTP/1.1 %d Whatever\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a"' % status
        )
        await until_cancelled()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)], upstream_idle_timeout_seconds=0.5)
    async with await Wire.open(server.client_address) as wire:
        began = time.perf_counter()
        wire.send(post())
        answer_ = await wire.answer(timeout=10)
        assert 0.5 <= time.perf_counter() - began < 3.0
    assert answer_.status == 504
    assert answer_.json()["error"]["code"] == "upstream_timeout"  # type: ignore[index]
    assert len(replica.requests) == 1


@pytest.mark.parametrize("how", ["endless", "huge"])
async def test_an_endless_or_huge_replica_head_is_a_502_tried_once(
    start_raw: StartRaw, start_router: StartRouter, how: str
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        if how == "huge":
            await exchange.write(b"a" * 1_000_000)
        else:
            for _ in range(2000):
                await exchange.write(b"a" * 100)
                # Real time: each piece in a read of its own, as a slow replica's come.
                await asyncio.sleep(0.001)
        await until_cancelled()

    first = await start_raw(answer)
    second = await start_raw(answer)
    server = await start_router([entry(first.url, "a"), entry(second.url, "b")], max_attempts=4)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer(timeout=10)
    assert answer_.status == 502
    assert b"aaaa" not in answer_.head
    assert len(first.requests) + len(second.requests) == 1
    assert (await protocol_errors(server.admin_url, "upstream")).get("head_too_large") == 1


async def test_early_hints_past_64_kib_are_a_502_tried_once(start_raw: StartRaw, start_router: StartRouter) -> None:
    """The 64 KiB bound on a replica's head counts the interim heads before it, each in its own read too."""
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: </%b>; rel=preload\r\n\r\n" % (b"a" * 1000)

    async def answer(exchange: Exchange) -> None:
        for _ in range(100):
            await exchange.write(hint)
            # Real time: each head in a read of its own.
            await asyncio.sleep(0.002)
        await exchange.write(json_answer())

    first = await start_raw(answer)
    second = await start_raw(answer)
    server = await start_router([entry(first.url, "a"), entry(second.url, "b")], max_attempts=4)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer(timeout=10)
    assert answer_.status == 502
    assert len(first.requests) + len(second.requests) == 1
    assert (await protocol_errors(server.admin_url, "upstream")).get("head_too_large") == 1


async def test_interim_answers_are_not_forwarded(start_raw: StartRaw, start_router: StartRouter) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
        await exchange.write(json_answer())

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 200 and answer_.body == JSON_OK


async def test_a_replica_switching_protocols_is_a_502_without_a_traceback(
    start_raw: StartRaw, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    async def answer(exchange: Exchange) -> None:
        await exchange.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        await until_cancelled()

    caplog.set_level(logging.WARNING)
    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 502
    assert len(replica.requests) == 1
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    await wait_for(lambda: server.upstream.open_connections == 0)
    assert (await protocol_errors(server.admin_url, "upstream")).get("switched_protocols") == 1


# Found by the hostile review ---------------------------------------------------------------------


async def test_a_body_delimited_by_close_and_ended_by_a_reset_looks_broken(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    import socket
    import struct

    async def answer(exchange: Exchange) -> None:
        await exchange.write(
            b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{"id":"x","obj'
        )
        sock = exchange.writer.get_extra_info("socket")
        # SO_LINGER 0: the close is a reset, not an end.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        exchange.writer.transport.abort()

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 200 and not answer_.complete


async def test_a_large_answer_passes_through_with_its_length_and_a_large_error_is_a_502(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    from router.gateway.forward import WHOLE_ANSWER_BYTES

    big = b"x" * (WHOLE_ANSWER_BYTES * 3)

    async def answer(exchange: Exchange) -> None:
        status = 200 if exchange.index == 1 else 500
        await exchange.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (status, len(big))
        )
        for start in range(0, len(big), 65536):
            await exchange.write(big[start : start + 65536])

    replica = await start_raw(answer)
    server = await start_router([entry(replica.url)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        passed = await wire.answer(timeout=10)
        assert passed.status == 200 and passed.complete and passed.body == big
        assert passed.header(b"content-length") == b"%d" % len(big)
        wire.send(post())
        refused = await wire.answer(timeout=10)
    # An error answer that large is not an error message: never held whole.
    assert refused.status == 502


async def test_a_request_a_fresh_connection_took_is_not_sent_again_when_it_closes(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def answer(exchange: Exchange) -> None:
        exchange.close()  # took the whole request, answered nothing

    first = await start_raw(answer)
    second = await start_raw(answer)
    server = await start_router([entry(first.url, "a"), entry(second.url, "b")], max_attempts=4)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        assert (await wire.answer()).status == 502
    # The replica may have run it: it is not run again, there or elsewhere.
    assert len(first.requests) + len(second.requests) == 1


@pytest.mark.parametrize("gone", [False, True], ids=["replica-still-listening", "replica-gone"])
async def test_a_post_read_whole_on_a_reused_connection_then_dropped_is_a_502_sent_nowhere_else(
    start_raw: StartRaw, start_router: StartRouter, gone: bool
) -> None:
    """An engine that dies on a prompt it read on a kept-alive connection: 502, the prompt sent to no one again."""

    async def dies(exchange: Exchange) -> None:
        if exchange.index == 1:
            await exchange.write(json_answer())  # the connection goes back to the pool
            return
        if gone:
            # The replica is gone now: a new connection to it would be refused.
            assert first.server is not None
            first.server.close()
        exchange.close()

    async def serves(exchange: Exchange) -> None:
        await exchange.write(json_answer())

    first = await start_raw(dies)
    fallback = await start_raw(serves)
    server = await start_router(
        [entry(first.url, "a"), {"id": "b", "model": "m2", "url": fallback.url}],
        models={"m": {"fallbacks": ["m2"]}},
        max_attempts=4,
    )
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        assert (await wire.answer()).status == 200
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 502
    assert len(first.requests) == 2
    assert fallback.requests == []


@pytest.mark.parametrize("close_delimited", [False, True], ids=["gzip-chunked", "gzip-ended-by-close"])
async def test_a_replicas_gzip_transfer_coding_is_a_502_never_a_coded_body(
    start_raw: StartRaw, start_router: StartRouter, close_delimited: bool
) -> None:
    """Transfer-Encoding gzip (chunked or not) would pass the client a body still compressed, with nothing to say so."""
    coded = gzip.compress(JSON_OK)

    async def answer(exchange: Exchange) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        if close_delimited:
            await exchange.write(head + b"Transfer-Encoding: gzip\r\n\r\n" + coded)
            exchange.close()
        else:
            await exchange.write(head + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunk(coded) + b"0\r\n\r\n")

    replica = await start_raw(answer)
    other = await start_raw(answer)
    server = await start_router([entry(replica.url, "a"), entry(other.url, "b")], max_attempts=4)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 502
    assert answer_.json()["error"]["code"] == "upstream_error"  # type: ignore[index]
    # The replica answered: it had the request, which goes to no one else.
    assert len(replica.requests) + len(other.requests) == 1
    assert (await protocol_errors(server.admin_url, "upstream")).get("transfer_encoding") == 1


@pytest.mark.parametrize(
    "line",
    [b"HTTP/1.1 099 Weird", b"HTTP/1.1 200 O\x00K", b"HTTP/1.1 600 Beyond", b"HTTP/2.0 200 OK"],
    ids=["status-099", "nul-in-reason", "status-600", "http-2.0"],
)
async def test_a_replicas_invalid_status_line_is_a_502_tried_once(
    start_raw: StartRaw, start_router: StartRouter, line: bytes
) -> None:
    """A status outside 100-599, a NUL in the reason, HTTP/2.0: not an HTTP/1.1 answer to pass on."""

    async def answer(exchange: Exchange) -> None:
        await exchange.write(line + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")

    first = await start_raw(answer)
    second = await start_raw(answer)
    server = await start_router([entry(first.url, "a"), entry(second.url, "b")], max_attempts=4)
    async with await Wire.open(server.client_address) as wire:
        wire.send(post())
        answer_ = await wire.answer()
    assert answer_.status == 502
    assert b"\x00" not in answer_.head
    assert len(first.requests) + len(second.requests) == 1
    assert (await protocol_errors(server.admin_url, "upstream")).get("invalid_response") == 1
