"""The upstream client against replicas whose answers are malformed: heads without end, odd codings,
protocol switches, empty pieces, garbage; and what a connection shows of itself, and the keep-alive sweep.

The replicas that misbehave in time (silence, races, answers nobody asked
for) are in test_upstream_client.py; the rule is the same: a clear error,
the connection closed, never a request sent twice once the replica may have
acted on it, and each case counted by reason in `Client.protocol_errors`.
"""

from __future__ import annotations

import asyncio
import gzip
import logging

import pytest

from router.http.client import (
    MAX_HEAD_BYTES,
    ConnectionBroken,
    HeadTooLarge,
    Response,
)
from tests.support.raw_server import HEAD, OK, StartRaw, fixed
from tests.support.upstream import MakeClient, Recorder, never_drained, ok_once
from tests.support.waiting import wait_for


async def until_hung_up(reader: asyncio.StreamReader) -> None:
    """The replica's silence: nothing more until the client closes the connection."""
    try:
        await reader.read(1)
    except ConnectionError:
        pass


# 6. Heads (and trailers) without end --------------------------------------------------


async def endless(writer: asyncio.StreamWriter, start: bytes) -> None:
    """`start`, then a line that never ends, a KiB at a time, until the client hangs up."""
    writer.write(start)
    for _ in range(4096):
        writer.write(b"a" * 1024)
        await writer.drain()
        # Real time, a millisecond: each KiB a read of its own, as from a slow replica (on
        # loopback, writes not paced coalesce, and the client would see a few large reads).
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("slowly", [True, False], ids=["endless-line-slowly", "1-MB-at-once"])
async def test_a_head_over_64_kib_is_head_too_large_and_not_retried(
    raw_server: StartRaw, make_client: MakeClient, slowly: bool
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            writer.write(OK)
        elif slowly:
            await endless(writer, b"HTTP/1.1 200 OK\r\nX-Endless: ")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 1024 * 1024 + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    # On a reused connection, where a break before the head could be retried.
    await ok_once(client, raw)
    with pytest.raises(HeadTooLarge) as info:
        await asyncio.wait_for(client.request(raw.origin, HEAD, b"{}"), 10)
    assert info.value.before_head
    assert info.value.answered
    assert len(raw.requests) == 2
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"head_too_large": 1}


async def test_a_head_just_under_64_kib_is_fine(raw_server: StartRaw, make_client: MakeClient) -> None:
    big = b"a" * (MAX_HEAD_BYTES - 1024)
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nX-Big: " + big + b"\r\nContent-Length: 5\r\n\r\nhello"))
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert resp.header(b"x-big") == big
    assert await resp.read() == b"hello"
    resp.release()
    assert client.protocol_errors.counts == {}


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </%b>; rel=preload\r\n\r\n" % (b"a" * 1000)


@pytest.mark.parametrize("at_once", [True, False], ids=["in-one-write", "a-write-each"])
async def test_interim_heads_count_towards_the_64_kib_bound(
    raw_server: StartRaw, make_client: MakeClient, at_once: bool
) -> None:
    """100 KiB of 103 Early Hints before the answer: over the bound, which counts every head before the answer's."""
    count = 100

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if at_once:
            writer.write(EARLY_HINTS * count + OK)
        else:
            for _ in range(count):
                writer.write(EARLY_HINTS)
                await writer.drain()
                # Real time, a millisecond: each head a read of its own (unpaced, they coalesce).
                await asyncio.sleep(0.001)
            writer.write(OK)
        await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    with pytest.raises(HeadTooLarge) as info:
        await asyncio.wait_for(client.request(raw.origin, HEAD, b"{}"), 10)
    assert info.value.answered
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"head_too_large": 1}


async def test_interim_heads_under_the_bound_are_dropped_and_the_answer_read(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    raw = await raw_server(fixed(EARLY_HINTS * 40 + OK))
    client = make_client()
    await ok_once(client, raw)
    await ok_once(client, raw)
    assert raw.connections == 1
    assert client.protocol_errors.counts == {}


async def test_endless_trailers_break_the_answer(raw_server: StartRaw, make_client: MakeClient) -> None:
    # Bytes keep coming, so the idle sweep never fires; httptools would grow
    # the trailer field without end.
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await endless(writer, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Endless: ")

    raw = await raw_server(answer)
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    with pytest.raises(ConnectionBroken) as info:
        await asyncio.wait_for(resp.read(), 10)
    assert not info.value.before_head
    resp.release()
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"trailers_too_large": 1}


# 6b. Transfer codings ------------------------------------------------------------------


GZIPPED = gzip.compress(b'{"id": "x"}')


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(GZIPPED), GZIPPED),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n" + GZIPPED,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n" + GZIPPED,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n{}",
    ],
    ids=["gzip-chunked", "gzip-to-the-close", "chunked-gzip", "chunked-twice", "identity"],
)
async def test_a_transfer_coding_other_than_chunked_alone_breaks_the_answer(
    raw_server: StartRaw, make_client: MakeClient, answer: bytes
) -> None:
    """Only chunked is decoded: a body under any other transfer coding would reach the client still coded."""
    raw = await raw_server(fixed(answer, close=True))
    client = make_client()
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    assert info.value.answered
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"transfer_encoding": 1}


@pytest.mark.parametrize("coding", [b"chunked", b"Chunked", b" CHUNKED "])
async def test_chunked_in_any_case_is_decoded(raw_server: StartRaw, make_client: MakeClient, coding: bytes) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: %b\r\n\r\n5\r\nhello\r\n0\r\n\r\n" % coding))
    client = make_client()
    await ok_once(client, raw)
    assert client.protocol_errors.counts == {}


# 7. Protocol switch -------------------------------------------------------------------


async def test_switching_protocols_is_broken_without_a_traceback(
    raw_server: StartRaw, make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    raw = await raw_server(
        fixed(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x05hello")
    )
    client = make_client()
    with caplog.at_level(logging.INFO):
        with pytest.raises(ConnectionBroken) as info:
            await client.request(raw.origin, HEAD, b"{}")
        # A few turns of the loop, no real time: the dropped connection's end is called back
        # (call_soon), and anything logged on the way is in.
        for _ in range(3):
            await asyncio.sleep(0)
    assert "switched protocols" in str(info.value)
    assert info.value.before_head
    assert info.value.answered
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"switched_protocols": 1}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert [r.name for r in caplog.records] == ["router.http.client"]


async def test_interim_answers_are_still_dropped(raw_server: StartRaw, make_client: MakeClient) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + OK))
    client = make_client()
    await ok_once(client, raw)
    assert client.protocol_errors.counts == {}


# 8. No empty piece -------------------------------------------------------------------


async def test_a_body_ended_by_close_hands_no_empty_piece_to_the_sink(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    # Downstream an empty piece is framed as a chunked last-chunk: the
    # client's stream would end there, and what follows would corrupt it.
    sink = Recorder()
    headed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        # The head, the event and the close each in a read of its own.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        await writer.drain()
        await headed.wait()
        writer.write(b"data: 1\n\n")
        await writer.drain()
        await wait_for(lambda: sink.pieces)
        writer.close()

    raw = await raw_server(answer)
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    headed.set()
    await resp.pipe(sink, never_drained)
    resp.release()
    assert sink.pieces == [b"data: 1\n\n"]


# 9. Garbage -----------------------------------------------------------------------


async def test_garbage_is_counted_as_an_invalid_response(raw_server: StartRaw, make_client: MakeClient) -> None:
    raw = await raw_server(fixed(b"SSH-2.0-OpenSSH\r\n\r\n"))
    client = make_client()
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    assert info.value.answered
    assert client.protocol_errors.counts == {"invalid_response": 1}


@pytest.mark.parametrize("delivery", ["one-read", "split-across-reads", "after-an-interim-head"])
@pytest.mark.parametrize(
    "line",
    [
        b"HTTP/1.1 200 O\x00K",
        b"HTTP/1.1 200 a\x01b",
        b"HTTP/1.1 200 a\x7fb",
        b"HTTP/1.1 600 Beyond",
        b"HTTP/1.1 999 Beyond",
        b"HTTP/2.0 200 OK",
        b"HTTP/0.9 200 OK",
    ],
    ids=["nul-in-reason", "control-in-reason", "del-in-reason", "600", "999", "http-2.0", "http-0.9"],
)
async def test_a_status_line_llhttp_lets_through_is_an_invalid_response(
    raw_server: StartRaw, make_client: MakeClient, line: bytes, delivery: str
) -> None:
    """A version but 1.0 or 1.1, a status past 599, a control byte in the reason: never passed on."""
    rest = b"\r\nContent-Length: 5\r\n\r\nhello"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if delivery == "split-across-reads":
            writer.write(line[:4])
            await writer.drain()
            await wait_for(lambda: any(c.reads for c in client._all))
            writer.write(line[4:] + rest)
        elif delivery == "after-an-interim-head":
            writer.write(b"HTTP/1.1 103 Early Hints\r\n\r\n" + line + rest)
        else:
            writer.write(line + rest)
        await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    with pytest.raises(ConnectionBroken) as info:
        await client.request(raw.origin, HEAD, b"{}")
    assert info.value.before_head
    assert info.value.answered
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"invalid_response": 1}


@pytest.mark.parametrize(
    ("line", "status", "reason"),
    [
        (b"HTTP/1.0 200 OK", 200, b"OK"),
        (b"HTTP/1.1 201 Created", 201, b"Created"),
        (b"HTTP/1.1 200", 200, b""),
        (b"HTTP/1.1 599 Tab\tand space", 599, b"Tab\tand space"),
        (b"HTTP/1.1 200 Caf\xe9", 200, b"Caf\xe9"),
    ],
    ids=["http-1.0", "created", "no-reason", "tab", "obs-text"],
)
async def test_a_valid_status_line_passes_as_sent(
    raw_server: StartRaw, make_client: MakeClient, line: bytes, status: int, reason: bytes
) -> None:
    raw = await raw_server(fixed(line + b"\r\nContent-Length: 5\r\n\r\nhello"))
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    assert (resp.status, resp.reason_bytes) == (status, reason)
    assert await resp.read() == b"hello"
    resp.release()
    assert client.protocol_errors.counts == {}


async def test_garbage_in_the_body_is_counted_and_breaks_the_answer(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    raw = await raw_server(fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"))
    client = make_client()
    resp = await client.request(raw.origin, HEAD, b"{}")
    with pytest.raises(ConnectionBroken) as info:
        await asyncio.wait_for(resp.read(), 5)
    assert not info.value.before_head
    resp.release()
    assert client.open_connections == 0
    assert client.protocol_errors.counts == {"invalid_response": 1}


# 10. The connection's state -------------------------------------------------------------


async def test_a_connection_shows_its_origin_and_state(raw_server: StartRaw, make_client: MakeClient) -> None:
    shown = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await shown.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    raw = await raw_server(answer)
    client = make_client()
    resp: Response = await client.request(raw.origin, HEAD, b"{}")
    connection = resp._connection
    assert repr(connection) == f"<Connection {raw.origin.key} body>"
    shown.set()
    assert await resp.read() == b"hello"
    assert repr(connection) == f"<Connection {raw.origin.key} done>"
    resp.release()
    assert repr(connection) == f"<Connection {raw.origin.key} idle>"
    assert client.open_connections == 1
    await client.close()
    assert repr(connection) == f"<Connection {raw.origin.key} closed>"
    assert client.open_connections == 0


# 11. The keep-alive sweep ---------------------------------------------------------------


async def test_every_connection_idle_past_the_keepalive_is_closed(
    raw_server: StartRaw, make_client: MakeClient
) -> None:
    """Bursts of connections against a replica without an idle timeout of its own: none outlives the keep-alive."""
    raw = await raw_server(fixed(OK))
    client = make_client(keepalive_seconds=0.2)
    for burst in range(1, 4):
        responses = await asyncio.gather(*(client.request(raw.origin, HEAD, b"{}") for _ in range(20)))
        for resp in responses:
            assert await resp.read() == b"hello"
            resp.release()
        assert client.open_connections == 20
        # Closed by the client (the replica reads its EOF), every one of them.
        await wait_for(lambda: client.open_connections == 0, timeout=3.0)
        await wait_for(lambda: raw.eofs == 20 * burst, timeout=3.0)  # noqa: B023
    assert raw.connections == 60
