"""Engines whose sleep API misbehaves at the socket: resets, endless bodies, silences, 503s that only look asleep.

Each is a raw replica written for its test (tests/support/wire.py) behind a
real router; the router must answer clearly, keep its bounds, and never
take a replica for asleep on a 503 that does not say so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from router.run.app import RouterServer
from tests.conftest import StartRouter
from tests.control.test_operations import admin, states
from tests.support.clients import CHAT, post
from tests.support.waiting import until_cancelled, wait_for
from tests.support.wire import Exchange, StartRaw

STATE = "/api/v1/replicas/r0/state"


def vllm(url: str) -> dict[str, Any]:
    return {"id": "r0", "model": "m", "url": url, "engine": "vllm"}


async def test_a_sleep_call_reset_mid_answer_is_a_502_and_the_replica_stays_ready(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def script(exchange: Exchange) -> None:
        await exchange.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        exchange.writer.transport.abort()

    raw = await start_raw(script)
    server = await start_router([vllm(raw.url)])
    status, answer = await admin(server, "POST", STATE, {"state": "asleep"})
    assert (status, answer["error"]["code"]) == (502, "engine_call_failed")
    assert (await states(server))["r0"] == "ready"


async def test_a_huge_refusal_is_quoted_in_a_bounded_message(start_raw: StartRaw, start_router: StartRouter) -> None:
    huge = b"x" * (8 * 1024 * 1024)

    async def script(exchange: Exchange) -> None:
        await exchange.write(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % len(huge) + huge)

    raw = await start_raw(script)
    server = await start_router([vllm(raw.url)])
    status, answer = await admin(server, "POST", STATE, {"state": "asleep"})
    assert status == 502
    message = answer["error"]["message"]
    assert "HTTP 500" in message
    assert len(message) < 600


async def test_a_silent_is_sleeping_ends_the_wake_at_wake_timeout_and_ejects(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    async def script(exchange: Exchange) -> None:
        if exchange.head.startswith(b"POST /sleep"):
            await exchange.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        else:
            await until_cancelled()

    raw = await start_raw(script)
    server = await start_router([vllm(raw.url)], wake_timeout_seconds=0.3, models={"m": {"cold_start_seconds": 1}})
    assert (await admin(server, "POST", STATE, {"state": "asleep"}))[0] == 200
    code, _, body = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert code == 503
    assert orjson.loads(body)["error"]["code"] == "model_cold"
    # Not known to be awake: asleep still, its failed wake counted as an ejection.
    assert (await states(server))["r0"] == "asleep"
    replica = server.pool.get("r0")
    assert replica is not None and replica.ejections == 1


async def test_a_503_whose_body_only_mentions_sleeping_is_not_asleep(
    start_raw: StartRaw, start_router: StartRouter
) -> None:
    bodies = [
        b"the engine is sleeping",  # not JSON
        b'{"error": {"message": "overloaded"}, "note": "sleeping"}',  # the word outside the error's message
        b'{"error": "x"' + b" sleeping" * 1000,  # broken JSON
    ]

    async def script(exchange: Exchange) -> None:
        body = bodies[(exchange.index - 1) % len(bodies)]
        await exchange.write(b"HTTP/1.1 503 Busy\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    raw = await start_raw(script)
    server: RouterServer = await start_router([vllm(raw.url)])
    for _ in bodies:
        code, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert code == 503
    replica = server.pool.get("r0")
    assert replica is not None
    assert replica.asleep is None
    assert replica.errors == {"status": 3}
    assert not any(request.startswith(b"POST /wake_up") for request in raw.requests)


async def test_a_sleep_and_a_wake_at_once_are_one_each(start_raw: StartRaw, start_router: StartRouter) -> None:
    gate = asyncio.Event()

    async def script(exchange: Exchange) -> None:
        if exchange.head.startswith(b"POST /sleep"):
            await gate.wait()
        await exchange.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    raw = await start_raw(script)
    server = await start_router([vllm(raw.url)])
    first = asyncio.ensure_future(admin(server, "POST", STATE, {"state": "asleep"}))
    await until_head(raw, b"POST /sleep")
    status, answer = await admin(server, "POST", STATE, {"state": "asleep"})
    assert (status, answer["error"]["code"]) == (409, "cannot_sleep")
    gate.set()
    assert (await first)[0] == 200
    assert sum(r.startswith(b"POST /sleep") for r in raw.requests) == 1


async def until_head(raw: Any, prefix: bytes) -> None:
    await wait_for(lambda: any(r.startswith(prefix) for r in raw.requests))
