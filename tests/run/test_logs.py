"""The request id in log lines (router/run/logs.py), against the client port's server alone."""

from __future__ import annotations

import asyncio
import logging

import pytest

from router.http.messages import Reply, Request
from router.http.writer import Writer
from router.run.logs import RequestIdFilter
from tests.support.http_harness import StartServer
from tests.support.wire import Wire

log = logging.getLogger("router.test")


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.INFO, logger="router")
    return caplog


def lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


async def test_a_line_a_handler_writes_names_its_request(
    start_server: StartServer, logs: pytest.LogCaptureFixture
) -> None:
    async def handler(request: Request, writer: Writer) -> None:
        log.warning("handled")
        writer.answer(Reply(200, b"ok", []))

    harness = await start_server(handler)
    async with await Wire.open(harness.address) as wire:
        wire.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-Id: mine\r\n\r\n")
        assert (await wire.answer()).status == 200
    assert lines(logs, "router.test") == ["[req mine] handled"]


async def test_a_line_a_callback_writes_names_no_request_even_one_that_scheduled_it(
    start_server: StartServer, logs: pytest.LogCaptureFixture
) -> None:
    """A timer set while a request runs carries the request's context, not the request: its lines are no one's."""
    called = asyncio.Event()

    def later() -> None:
        log.warning("from a timer")
        called.set()

    async def handler(request: Request, writer: Writer) -> None:
        asyncio.get_running_loop().call_soon(later)
        writer.answer(Reply(200, b"ok", []))

    harness = await start_server(handler)
    async with await Wire.open(harness.address) as wire:
        wire.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-Id: mine\r\n\r\n")
        assert (await wire.answer()).status == 200
        await asyncio.wait_for(called.wait(), 5)
    assert lines(logs, "router.test") == ["from a timer"]


async def test_a_refusal_read_after_a_request_ended_is_not_put_on_that_request(
    start_server: StartServer, logs: pytest.LogCaptureFixture
) -> None:
    """Bytes read behind a queued request are parsed when the one ahead ends, in its task:
    the refusal they earn is logged as no request's, not as the one that just ended."""

    async def handler(request: Request, writer: Writer) -> None:
        if request.path == "/slow":
            # Real time: long enough for the bytes behind it to be read and queued meanwhile.
            await asyncio.sleep(0.1)
        writer.answer(Reply(200, b"ok", []))

    harness = await start_server(handler)
    first = b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Request-Id: first\r\n\r\n"
    second_head = b"POST /next HTTP/1.1\r\nHost: x\r\nX-Request-Id: second\r\nContent-Length: %d\r\n\r\n"
    # The second request ends where the server's first 4 KiB slice of the read ends: the
    # bytes after it wait, unparsed, until the first request's task starts the second.
    size = 4096 - len(first) - len(second_head % 1000)
    second = second_head % size + b"x" * size
    assert len(first + second) == 4096
    async with await Wire.open(harness.address) as wire:
        wire.send(first + second + b"NOT HTTP AT ALL\r\n\r\n")
        for _ in range(2):
            assert (await wire.answer()).status == 200
        assert (await wire.answer()).status == 400
    refusals = lines(logs, "router.http.server")
    assert len(refusals) == 1 and refusals[0].startswith("invalid_http: ")
