"""The client port's server against a hostile client, on raw sockets, with a stub handler.

Each test is one way a client can try to desynchronise the server, smuggle a
header past it, pin its memory or hold a connection forever; each names the
rule it holds (RFC 9110/9112) and what nginx answers where that differs. The
server runs alone (tests/support/http_harness.py): what reaches its handler is what a
router would have been given. The ways that need the router's own rules (its
keys, what it forwards) are tested through it (tests/gateway/test_client_port.py).
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from router.http.server.states import Reading
from tests.support.http_harness import StartServer, Stub
from tests.support.waiting import wait_for
from tests.support.wire import CHAT, Wire, post, stream_post

# Desync -----------------------------------------------------------------------------------


async def test_100_continue_is_sent_only_when_its_request_is_the_one_answered(start_server: StartServer) -> None:
    stub = Stub(tokens=6, token_delay=0.05)
    server = await start_server(stub)
    body = orjson.dumps(CHAT)
    async with await Wire.open(server.address) as wire:
        # A stream, and behind it the head of a request that waits for its 100.
        expecting = post(body, extra=b"Expect: 100-continue\r\n")
        wire.send(stream_post() + expecting[: -len(body)])
        streamed = await wire.answer()
        assert streamed.status == 200 and streamed.complete
        assert b"100 Continue" not in streamed.body
        interim = await wire.answer()
        assert interim.status == 100
        wire.send(body)
        final = await wire.answer()
        assert final.status == 200 and final.json()["object"] == "chat.completion"


@pytest.mark.parametrize("expect", [b"Expect: 100-continue\r\nExpect: nope\r\n", b"Expect: nope, 100-Continue\r\n"])
async def test_100_continue_among_other_expectations_gets_its_100(start_server: StartServer, expect: bytes) -> None:
    """Expect is a list (RFC 9110 10.1.1): a client that asks for 100-continue among other
    members, or in another Expect field, waits for the 100 before it sends its body."""
    stub = Stub()
    server = await start_server(stub, body_timeout=0.5)
    body = orjson.dumps(CHAT)
    async with await Wire.open(server.address) as wire:
        wire.send(post(body, extra=expect)[: -len(body)])
        assert (await wire.answer()).status == 100
        wire.send(body)
        assert (await wire.answer()).status == 200
    assert [seen.body for seen in stub.inference] == [body]


async def test_a_parse_error_behind_a_running_request_is_answered_after_it(start_server: StartServer) -> None:
    stub = Stub(tokens=4, token_delay=0.05)
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(stream_post() + post() + b"NOT HTTP AT ALL\r\n\r\n")
        first = await wire.answer()
        assert first.status == 200 and first.complete and first.body.endswith(b"data: [DONE]\n\n")
        second = await wire.answer()
        assert second.status == 200 and second.json()["object"] == "chat.completion"
        bad = await wire.answer()
        assert bad.status == 400 and bad.header(b"connection") == b"close"
        assert await wire.closed() == b""
    assert len(stub.inference) == 2


async def test_bytes_after_connection_close_lose_no_answer(start_server: StartServer) -> None:
    stub = Stub(tokens=3, token_delay=0.05)
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(stream_post(extra=b"Connection: close\r\n") + post())
        answer = await wire.answer()
        assert answer.status == 200 and answer.complete
        # Nothing is read after a request that closes the connection: no second answer, no 400.
        assert await wire.closed() == b""
    assert len(stub.inference) == 1


async def test_a_too_large_pipelined_request_gets_its_413_after_the_one_ahead(start_server: StartServer) -> None:
    stub = Stub(tokens=4, token_delay=0.05)
    server = await start_server(stub, max_body_bytes=1000)
    big = orjson.dumps({**CHAT, "pad": "x" * 2000})
    async with await Wire.open(server.address) as wire:
        wire.send(stream_post() + post(big))
        first = await wire.answer()
        assert first.status == 200 and first.complete
        refused = await wire.answer()
        assert refused.status == 413 and refused.json()["error"]["code"] == "request_too_large"  # type: ignore[index]
        assert await wire.closed() == b""
    assert len(stub.inference) == 1


# Smuggled headers ------------------------------------------------------------------------------


def chunked_post(body: bytes, trailers: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n" % (len(body), body) + trailers + b"\r\n"
    )


async def test_request_trailers_never_reach_the_handler(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(chunked_post(orjson.dumps(CHAT), b"X-Forwarded-For: 10.0.0.1\r\nX-Trailer: t\r\n"))
        answer = await wire.answer()
    assert answer.status == 200
    names = stub.inference[-1].names()
    assert b"x-forwarded-for" not in names and b"x-trailer" not in names


HOST_CASES = {
    # RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without
    # Host, with more than one, or with an invalid one.
    "no host": (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 400),
    "two hosts": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: 2\r\n\r\n{}", 400),
    "invalid host": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a/b@c\r\nContent-Length: 2\r\n\r\n{}", 400),
    # RFC 9112 6.1: Transfer-Encoding in HTTP/1.0 is a framing fault.
    "transfer-encoding on 1.0": (
        b"POST /v1/chat/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(orjson.dumps(CHAT)), orjson.dumps(CHAT)),
        400,
    ),
    "HTTP/2.0 request line": (b"POST /v1/chat/completions HTTP/2.0\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}", 505),
    "CONNECT": (b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 10.0.0.1:443\r\n\r\n", 405),
}


@pytest.mark.parametrize("name", list(HOST_CASES))
async def test_what_rfc_9112_requires_rejecting_is_rejected(start_server: StartServer, name: str) -> None:
    stub = Stub()
    server = await start_server(stub)
    data, status = HOST_CASES[name]
    async with await Wire.open(server.address) as wire:
        wire.send(data)
        answer = await wire.answer()
        assert answer.status == status
        assert answer.header(b"connection") == b"close"
        assert await wire.closed() == b""
    assert stub.seen == []


async def test_http_1_0_without_host_is_served(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(post(version=b"1.0", host=None))
        assert (await wire.answer()).status == 200


# Hangs and unbounded resources ---------------------------------------------------------------------


async def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub, body_timeout=0.5)
    data = post()
    async with await Wire.open(server.address) as wire:
        began = time.perf_counter()
        wire.send(data[:-5])
        answer = await wire.answer()
        assert 0.4 <= time.perf_counter() - began < 3.0
        assert answer.status == 408
        assert await wire.closed() == b""
    assert stub.seen == []


async def test_a_body_trickling_a_byte_at_a_time_gets_408_at_its_deadline(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub, body_timeout=0.6)
    data = post(orjson.dumps({**CHAT, "pad": "x" * 200}))
    head_end = data.index(b"\r\n\r\n") + 4
    async with await Wire.open(server.address) as wire:
        wire.send(data[:head_end])
        began = time.perf_counter()
        got: list[int] = []

        async def trickle() -> None:
            for byte in data[head_end:]:
                wire.send(bytes([byte]))
                # Real time: the body deadline is the server's, on its own clock.
                await asyncio.sleep(0.05)

        trickler = asyncio.create_task(trickle())
        try:
            answer = await wire.answer()
            got.append(answer.status)
        finally:
            trickler.cancel()
        # Progress does not extend the deadline: it runs from the head's end.
        assert 0.5 <= time.perf_counter() - began < 2.5
    assert got == [408]
    assert stub.seen == []


async def test_bodies_buffered_across_connections_are_capped(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub, max_buffered_body_bytes=3000)
    body = orjson.dumps({**CHAT, "pad": "x" * 1800})
    slow = [await Wire.open(server.address) for _ in range(2)]
    try:
        # The first upload reserves its length; the second would pass the cap.
        slow[0].send(post(body)[:-10])
        await wait_for(lambda: server.server.budget.held >= len(body) - 10)
        async with await Wire.open(server.address) as wire:
            began = time.perf_counter()
            wire.send(post(body)[:-10])
            refused = await wire.answer()
            assert refused.status == 503
            assert time.perf_counter() - began < 1.0
        # The first one completes, and its buffer is released: new bodies fit again.
        slow[0].send(post(body)[-10:])
        assert (await slow[0].answer()).status == 200
        slow[1].send(post(body))
        assert (await slow[1].answer()).status == 200
    finally:
        for wire in slow:
            await wire.__aexit__()
    await wait_for(lambda: server.server is not None and server.server.budget.held == 0)


async def test_a_client_that_never_reads_its_whole_answer_is_cut_off(start_server: StartServer) -> None:
    # An answer of tens of MB, far over the socket buffers.
    stub = Stub(padding=40_000_000)
    server = await start_server(stub, write_stall_timeout=0.5)
    client_server = server.server
    body = orjson.dumps({"model": "m", "input": ["x"] * 20000})
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(post(body, path=b"/v1/embeddings"))
        await reader.readexactly(100)  # the answer began; then the client reads nothing more
        await wait_for(lambda: not client_server.connections, timeout=10)
    finally:
        writer.close()
    assert client_server.protocol_errors.counts.get("write_stall") == 1


async def test_an_endless_header_line_is_refused_as_it_arrives(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub, header_timeout=30)
    async with await Wire.open(server.address) as wire:
        wire.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nX-Endless: ")
        began = time.perf_counter()
        answer: list[int] = []

        async def endless() -> None:
            while True:
                wire.send(b"a" * 512)
                # Real time: a head that arrives slowly, a read at a time, against the server's clock.
                await asyncio.sleep(0.001)

        sender = asyncio.create_task(endless())
        try:
            answer.append((await wire.answer(timeout=10)).status)
        finally:
            sender.cancel()
        # Refused when the line passed 8 KiB, not at the 30 s head deadline.
        assert time.perf_counter() - began < 3.0
    assert answer == [431]


async def test_a_head_of_many_short_lines_over_64_kib_is_431(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    lines = b"".join(b"X-Pad-%d: %b\r\n" % (i, b"v" * 1000) for i in range(70))
    async with await Wire.open(server.address) as wire:
        wire.send(post(extra=lines))
        assert (await wire.answer()).status == 431
    assert stub.seen == []


async def test_a_target_over_8_kib_is_414(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(post(path=b"/v1/chat/completions?q=" + b"a" * 9000))
        assert (await wire.answer()).status == 414
    assert stub.seen == []


# Wrong answers ------------------------------------------------------------------------------------


async def test_http_1_0_keep_alive_answers_say_keep_alive(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        for _ in range(2):
            wire.send(post(version=b"1.0", extra=b"Connection: keep-alive\r\n"))
            answer = await wire.answer()
            assert answer.status == 200
            assert answer.header(b"connection") == b"keep-alive"


# Found by the hostile review ---------------------------------------------------------------------


async def test_a_client_pipelining_without_end_holds_at_most_one_request_ahead(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    client_server = server.server
    one = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"
    _, writer = await asyncio.open_connection(*server.address)
    try:
        most = 0
        for _ in range(40):
            writer.write(one * 2000)
            # Real time: the server reads what it will meanwhile (how much is what is measured).
            await asyncio.sleep(0.005)
            for connection in client_server.connections:
                most = max(most, len(connection.state.pending))
        # Parsing stops at the first request queued behind the running one, a
        # slice of the read at most: never the thousands of a whole read.
        assert most <= 4096 // len(one) + 1
    finally:
        writer.close()


async def test_a_pipelined_requests_body_is_read_once_the_one_ahead_is_answered(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub, body_timeout=2)
    third = post()
    head_end = third.index(b"\r\n\r\n") + 4
    async with await Wire.open(server.address) as wire:
        wire.send(post() + post() + third[:head_end])
        for _ in range(2):
            assert (await wire.answer()).status == 200
        # The server reads again, the third request's body deadline armed from now.
        await wait_for(
            lambda: any(c.state.reading is Reading.BODY and not c.state.pending for c in server.server.connections)
        )
        wire.send(third[head_end:])
        assert (await wire.answer(timeout=1.5)).status == 200


async def test_endless_trailers_are_refused_as_they_arrive(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    body = orjson.dumps(CHAT)
    async with await Wire.open(server.address) as wire:
        wire.send(chunked_post(body, b"")[: -len(b"\r\n")] + b"X-T: ")
        began = time.perf_counter()
        statuses: list[int] = []

        async def endless() -> None:
            while True:
                wire.send(b"a" * 1024)
                # Real time: trailers that arrive slowly, a read at a time, against the server's clock.
                await asyncio.sleep(0.001)

        sender = asyncio.create_task(endless())
        try:
            statuses.append((await wire.answer(timeout=10)).status)
        finally:
            sender.cancel()
        assert time.perf_counter() - began < 3.0
    assert statuses == [431]
    assert stub.seen == []


async def test_an_announced_length_takes_no_share_of_the_body_budget_until_its_bytes_come(
    start_server: StartServer,
) -> None:
    stub = Stub()
    server = await start_server(stub, max_buffered_body_bytes=100_000)
    idle = [await Wire.open(server.address) for _ in range(3)]
    try:
        for wire in idle:
            # Together they promise 99,000 of the 100,000 bytes and send none:
            # no one else may be refused for what never came.
            wire.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 33000\r\n\r\n")
        await wait_for(lambda: sum(c.state.reading is Reading.BODY for c in server.server.connections) == len(idle))
        async with await Wire.open(server.address) as wire:
            wire.send(post(orjson.dumps({**CHAT, "pad": "x" * 2000})))
            assert (await wire.answer()).status == 200
    finally:
        for wire in idle:
            await wire.__aexit__()


async def test_a_refused_head_request_gets_a_head_only(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(b"HEAD /v1/models HTTP/1.1\r\n\r\n")  # no Host: 400
        answer = await wire.answer(head_request=True)
        assert answer.status == 400 and int(answer.header(b"content-length") or b"0") > 0
        # Nothing follows the head: the connection ends right after it.
        assert await wire.closed() == b""


async def test_an_absolute_form_target_is_accepted_and_forwarded_in_origin_form(start_server: StartServer) -> None:
    stub = Stub()
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(post(path=b"http://router/v1/chat/completions?x=1"))
        assert (await wire.answer()).status == 200
    assert stub.inference[-1].target == b"/v1/chat/completions?x=1"


async def test_upgrade_with_expect_behind_a_long_answer_gets_its_100(start_server: StartServer) -> None:
    stub = Stub(tokens=12, token_delay=0.1)
    server = await start_server(stub, body_timeout=0.5)
    body = orjson.dumps(CHAT)
    waiting = post(body, extra=b"Expect: 100-continue\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n")
    long_stream = post(orjson.dumps({**CHAT, "stream": True, "max_tokens": 12}))  # 1.2 s
    async with await Wire.open(server.address) as wire:
        wire.send(long_stream + waiting[: -len(body)])
        assert (await wire.answer(timeout=5)).status == 200
        # The body deadline did not run while the 100 was owed: no 408.
        assert (await wire.answer()).status == 100
        wire.send(body)
        assert (await wire.answer()).status == 200


# Deadlines run only while the router reads ---------------------------------------------------


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"


@pytest.mark.parametrize("part", ["head", "body"])
async def test_a_request_read_behind_a_queued_one_is_not_timed_out_while_the_router_waits(
    start_server: StartServer, part: str
) -> None:
    """A stream runs, a second request is queued behind it and part of a third came in the same
    read: the router stops reading there, so the third's head or body deadline may run only once
    it reads again (a client is not late for bytes the router is not taking)."""
    # A stream of about 1.2 s, longer than the deadlines and their sweep.
    stub = Stub(tokens=12, token_delay=0.1)
    server = await start_server(stub, header_timeout=0.5, body_timeout=0.5)
    long_stream = post(orjson.dumps({**CHAT, "stream": True, "max_tokens": 12}))
    third = post() if part == "body" else GET_MODELS
    cut = third.index(b"\r\n\r\n") + 10 if part == "body" else third.index(b"Host")
    async with await Wire.open(server.address) as wire:
        wire.send(long_stream + GET_MODELS + third[:cut])
        streamed = await wire.answer()
        assert streamed.status == 200 and streamed.complete
        wire.send(third[cut:])
        assert (await wire.answer()).status == 200
        assert (await wire.answer()).status == 200
    assert len(stub.inference) == (2 if part == "body" else 1)


async def test_a_refused_body_behind_a_queued_request_is_dropped_once_the_router_reads_again(
    start_server: StartServer,
) -> None:
    """A 413 read behind a queued request: its body is read and dropped from when the router
    reads again, not from when its head came, so that the client gets to send it and read
    every answer (closing on unread bytes would reset the connection under them)."""
    # A stream of about 2.5 s: longer than the 2 s a refused body is read and dropped.
    stub = Stub(tokens=25, token_delay=0.1)
    # (A short head timeout makes the deadlines' sweep run often.)
    server = await start_server(stub, max_body_bytes=1000, header_timeout=0.4)
    long_stream = post(orjson.dumps({**CHAT, "stream": True, "max_tokens": 25}))
    # Far more than the sockets' buffers hold: sent only as the router reads it.
    size = 16 * 1024 * 1024
    too_large = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Length: %d\r\n\r\n" % size
    async with await Wire.open(server.address) as wire:
        wire.send(long_stream + GET_MODELS + too_large)
        streamed = await wire.answer(timeout=10)
        assert streamed.status == 200 and streamed.complete
        wire.send(b"x" * size)
        await asyncio.wait_for(wire.writer.drain(), 10)
        assert (await wire.answer()).status == 200
        assert (await wire.answer()).status == 413
        assert await wire.closed() == b""
    assert len(stub.inference) == 1


# Per-request fields of a pipelined head ------------------------------------------------------


@pytest.mark.parametrize("versions", [("1.0", "1.1"), ("1.1", "1.0")])
async def test_a_pipelined_head_does_not_change_the_version_of_the_answer_being_written(
    start_server: StartServer, versions: tuple[str, str]
) -> None:
    """A stream's framing follows its own request's version (RFC 9112 6.1: never chunked to an
    HTTP/1.0 client), whatever the version of a head read while its answer waits."""
    first, second = (v.encode() for v in versions)
    release = asyncio.Event()
    stub = Stub(tokens=1, gate=release)
    server = await start_server(stub)
    client_server = server.server
    async with await Wire.open(server.address) as wire:
        wire.send(stream_post(version=first, extra=b"Connection: keep-alive\r\n"))
        await wait_for(lambda: len(stub.seen) == 1)
        # The next head arrives and is read while the stream waits for its answer.
        wire.send(b"GET /v1/models HTTP/" + second + b"\r\nHost: router\r\n\r\n")
        await wait_for(lambda: any(c.state.pending for c in client_server.connections))
        release.set()
        streamed = await wire.answer()
        assert streamed.status == 200 and streamed.complete
        assert streamed.body.endswith(b"data: [DONE]\n\n")
        if first == b"1.0":
            # No chunks to HTTP/1.0: the close ends the body, and nothing follows it.
            assert streamed.framing == "close" and streamed.header(b"transfer-encoding") is None
            assert streamed.header(b"connection") == b"close"
        else:
            assert streamed.framing == "chunked" and streamed.header(b"connection") is None
            listing = await wire.answer()
            assert listing.status == 200 and listing.json()["object"] == "list"
            # HTTP/1.0 without keep-alive: this answer closes the connection.
            assert listing.header(b"connection") == b"close"
            assert await wire.closed() == b""
