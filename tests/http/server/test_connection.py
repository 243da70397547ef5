"""A client connection's life on the server alone: its deadlines, its flow, what a handler leaves undone, shutdown.

Each test drives one way a connection ends or goes on, with a handler
written for it, on a real socket: the keep-alive and discard deadlines, a
head left unfinished behind a running request, a client that reads slowly
or not at all, a handler that answers nothing, fails, or is cancelled, and
a shutdown that outlasts its grace.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from router.gateway.answers import server_error
from router.http.messages import Reply, Request
from router.http.server import Server
from router.http.writer import Writer
from tests.support.http_harness import StartServer, Stub, serving
from tests.support.waiting import until_cancelled, wait_for
from tests.support.wire import CHAT, Wire, post, stream_post

GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def answered(body: bytes = b"ok") -> Reply:
    return Reply(200, body, [])


async def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(start_server: StartServer) -> None:
    server = await start_server(keepalive_timeout=0.3)
    async with await Wire.open(server.address) as wire:
        wire.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await wire.answer()).status == 200
        # Nothing more from the client: the connection is closed, with nothing more written.
        assert await wire.closed() == b""
    await wait_for(lambda: not server.server.connections)


async def test_a_head_left_unfinished_behind_a_running_request_is_dropped_in_its_turn(
    start_server: StartServer,
) -> None:
    """The answer ahead is written whole; the head that missed its deadline gets no answer, and the
    connection closes after the one ahead."""
    stub = Stub(tokens=6, token_delay=0.1)
    server = await start_server(stub, header_timeout=0.2)
    async with await Wire.open(server.address) as wire:
        wire.send(stream_post() + b"GET /v1/models HTTP/1.1\r\nHo")
        streamed = await wire.answer()
        assert streamed.status == 200 and streamed.complete
        assert await wire.closed() == b""
    assert server.server.protocol_errors.counts == {"head_timeout": 1}
    assert [seen.path for seen in stub.seen] == ["/v1/chat/completions"]


async def test_a_refused_body_that_goes_on_past_its_window_closes_the_connection(start_server: StartServer) -> None:
    """A 413 is answered at once; the client sends on, slowly, past the 2 s its body is read and
    dropped for: the connection closes then, answer or no."""
    server = await start_server(max_body_bytes=10)
    async with await Wire.open(server.address) as wire:
        wire.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        assert (await wire.answer()).status == 413

        async def trickle() -> None:
            for _ in range(100):
                wire.send(b"x" * 10)
                # Real time: the window is the server's 2 s, on its own clock.
                await asyncio.sleep(0.05)

        sender = asyncio.create_task(trickle())
        try:
            assert await wire.closed(timeout=10) == b""
        finally:
            sender.cancel()


async def test_a_refused_body_stopping_behind_a_running_request_is_answered_in_its_turn(
    start_server: StartServer,
) -> None:
    """Its window passes while the request ahead still runs: nothing more is read, and once that
    one is answered the refusal is, and the connection closes."""
    stub = Stub(tokens=25, token_delay=0.1)
    server = await start_server(stub, max_body_bytes=1000, header_timeout=0.5)
    too_large = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    async with await Wire.open(server.address) as wire:
        # A stream of about 2.5 s: longer than the 2 s a refused body is read and dropped.
        wire.send(post(orjson.dumps({**CHAT, "stream": True, "max_tokens": 25})))
        await wait_for(lambda: len(stub.seen) == 1)
        wire.send(too_large + b"x" * 10)
        streamed = await wire.answer(timeout=10)
        assert streamed.status == 200 and streamed.complete
        assert (await wire.answer()).status == 413
        assert await wire.closed() == b""


async def test_a_connection_closing_on_what_its_client_does_not_read_is_cut_off(start_server: StartServer) -> None:
    """A stream that breaks closes its connection once the client has what was written; a client
    that reads none of it is cut off after the write-stall timeout, not kept for ever."""

    async def handler(request: Request, writer: Writer) -> None:
        writer.start(200, b"OK", [])
        for _ in range(200):
            writer.write(b"x" * 65536)  # (never waiting for the client: all of it queued)
        writer.abort()

    server = await start_server(handler, write_stall_timeout=0.3)
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(GET)
        await reader.readexactly(100)  # the answer began; then the client reads nothing more
        await wait_for(lambda: not server.server.connections, timeout=10)
    finally:
        writer.close()
    assert server.server.protocol_errors.counts == {"write_stall": 1}


async def test_a_client_that_reads_slowly_but_steadily_gets_its_whole_answer(start_server: StartServer) -> None:
    """The handler's writes are paused while the client's buffers are full, and resumed as it reads."""
    pieces = 400
    piece = b"y" * 65536

    async def handler(request: Request, writer: Writer) -> None:
        writer.start(200, b"OK", [])
        for _ in range(pieces):
            if writer.write(piece):
                await writer.drain()
        writer.end()

    server = await start_server(handler, write_stall_timeout=5.0)
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(GET)
        await reader.readuntil(b"\r\n\r\n")
        got = 0
        while True:
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
            size = int(size_line, 16)
            if size == 0:
                break
            got += len(await reader.readexactly(size + 2)) - 2
            # Real time: a client that reads slowly, so that the server's writes wait for it.
            await asyncio.sleep(0.0005)
    finally:
        writer.close()
    assert got == pieces * len(piece)
    assert server.server.protocol_errors.counts == {}


async def test_drain_returns_at_once_while_the_client_takes_what_is_written(start_server: StartServer) -> None:
    async def handler(request: Request, writer: Writer) -> None:
        writer.start(200, b"OK", [])
        await writer.drain()
        writer.write(b"done")
        writer.end()

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(GET)
        answer = await wire.answer()
    assert answer.complete and answer.body == b"done"


async def test_a_handler_that_answers_nothing_gets_its_request_a_500(start_server: StartServer) -> None:
    async def handler(request: Request, writer: Writer) -> None:
        return

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(GET + GET)
        for _ in range(2):
            answer = await wire.answer()
            assert answer.status == 500 and answer.json()["error"]["code"] == "internal_error"  # type: ignore[index]


async def test_a_handler_that_fails_after_its_head_leaves_the_stream_broken(start_server: StartServer) -> None:
    async def handler(request: Request, writer: Writer) -> None:
        writer.start(200, b"OK", [])
        writer.write(b"partial")
        raise RuntimeError("the source broke")

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(GET)
        answer = await wire.answer()
        assert answer.status == 200 and answer.body == b"partial" and not answer.complete


async def test_a_handler_cancelled_when_its_client_leaves_lets_go_of_its_body(start_server: StartServer) -> None:
    began = asyncio.Event()

    async def handler(request: Request, writer: Writer) -> None:
        began.set()
        await until_cancelled()

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(post(orjson.dumps(CHAT)))
        await asyncio.wait_for(began.wait(), 5)
        assert server.server.budget.held > 0
    await wait_for(lambda: not server.server.connections and server.server.budget.held == 0)


async def test_shutdown_cancels_what_still_runs_after_its_grace() -> None:
    cancelled = asyncio.Event()
    began = asyncio.Event()

    async def handler(request: Request, writer: Writer) -> None:
        began.set()
        try:
            await until_cancelled()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving(handler) as harness, await Wire.open(harness.address) as wire:
        wire.send(GET)
        await asyncio.wait_for(began.wait(), 5)
        await harness.server.shutdown(0.1)
        assert cancelled.is_set()
        assert await wire.closed() == b""


async def test_bytes_after_a_request_that_closes_the_connection_are_not_read_even_later(
    start_server: StartServer,
) -> None:
    stub = Stub(tokens=3, token_delay=0.05)
    server = await start_server(stub)
    async with await Wire.open(server.address) as wire:
        wire.send(stream_post(extra=b"Connection: close\r\n"))
        await wait_for(lambda: len(stub.seen) == 1)
        # A separate read, while the answer is being written.
        wire.send(post())
        answer = await wire.answer()
        assert answer.status == 200 and answer.complete
        assert await wire.closed() == b""
    assert len(stub.seen) == 1


async def test_a_body_announced_while_the_budget_is_spent_is_refused_from_its_head(start_server: StartServer) -> None:
    """A body held by a handler that has not returned counts in the budget; a head announcing
    another body then gets 503 before a byte of it is sent."""
    gate = asyncio.Event()
    stub = Stub(gate=gate)
    body = orjson.dumps({**CHAT, "pad": "x" * 1000})
    server = await start_server(stub, max_buffered_body_bytes=len(body))
    async with await Wire.open(server.address) as holder:
        holder.send(post(body))
        await wait_for(lambda: len(stub.seen) == 1)
        async with await Wire.open(server.address) as wire:
            wire.send(post(b"{}")[: -len(b"{}")])
            refused = await wire.answer()
            assert refused.status == 503 and refused.json()["error"]["code"] == "server_overloaded"  # type: ignore[index]
        gate.set()
        assert (await holder.answer()).status == 200


async def test_a_refused_body_that_turns_to_garbage_closes_the_connection_at_once(start_server: StartServer) -> None:
    """Its 413 is answered; bytes that are no chunked body end the dropping there, not at its window."""
    server = await start_server(max_body_bytes=10)
    async with await Wire.open(server.address) as wire:
        wire.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n14\r\n" + b"x" * 20
        )
        assert (await wire.answer()).status == 413
        wire.send(b"\r\nzz\r\n")
        assert await wire.closed(timeout=1.5) == b""


async def test_a_head_that_passes_64_kib_in_the_read_that_ends_it_is_431(start_server: StartServer) -> None:
    """Heads are bounded as they arrive; one that ends in the read that takes it past 64 KiB is
    bounded when it ends."""
    stub = Stub()
    server = await start_server(stub)
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    filler = b"".join(b"X-Pad-%02d: %b\r\n" % (i, b"v" * 1000) for i in range(64))
    # Past 64 KiB by a few bytes, ending well inside the server's last 4 KiB slice of the read.
    tail = b"X-Last: " + b"v" * (64 * 1024 + 200 - len(head) - len(filler)) + b"\r\n\r\n"
    async with await Wire.open(server.address) as wire:
        wire.send(head + filler + tail)
        assert (await wire.answer()).status == 431
    assert stub.seen == []


async def test_a_connection_shows_its_client_and_both_its_states(start_server: StartServer) -> None:
    shown: list[str] = []

    async def handler(request: Request, writer: Writer) -> None:
        shown.extend(repr(c) for c in server.server.connections)
        writer.answer(answered())

    server = await start_server(handler)
    async with await Wire.open(server.address) as wire:
        wire.send(GET)
        assert (await wire.answer()).status == 200
        host, port = wire.writer.get_extra_info("sockname")[:2]
    assert shown == [f"<Connection {host}:{port} Reading.IDLE Answering.ACTIVE pending=0>"]


async def test_a_connection_without_an_address_gives_its_requests_none(tmp_path: Path) -> None:
    """On a Unix socket a client has no host and port: its requests' `peer` is empty, never made up."""
    peers: list[str] = []

    async def handler(request: Request, writer: Writer) -> None:
        peers.append(request.peer)
        writer.answer(answered())

    server = Server(handler, max_body_bytes=1024, header_timeout=5.0, error=server_error, log_exception=print)
    path = str(tmp_path / "client-port.sock")
    listener = await asyncio.get_running_loop().create_unix_server(server, path)
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(GET)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        listener.close()
        await server.shutdown(0.1)
        await listener.wait_closed()
    assert peers == [""]
