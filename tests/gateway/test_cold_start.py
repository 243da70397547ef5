"""Scale from zero: a request for a cold model is held, the demand signalled, and served once a replica answers.

Through the real server, with the official `openai` SDK as the client: a
model declared with `cold_start_seconds` and no replica (scaled to zero), a
replica pushed that still refuses connections or answers 503 while it loads,
a wake receiver that is slow or down, a burst, a shutdown. Where the clock
decides (a probe's pause, the deadline, the wake cooldown) the router runs
on a fake clock (tests/support/clock.py) that the test moves; the rules
themselves are tested without sockets in tests/core/test_coldstart.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from router.core.pool.waiters import PROBE_CAP_SECONDS
from router.run.app import RouterServer
from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, samples
from tests.support.clients import scrape as scrape_now
from tests.support.clock import FakeClock
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for
from tests.support.wire import Exchange, StartRaw

COLD = {"m": {"cold_start_seconds": 10}}


def sdk(server: RouterServer, timeout: float = 30) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


async def ask(server: RouterServer, **extra: Any) -> Any:
    """A chat completion through the SDK, raw, so that its headers can be read."""
    async with sdk(server) as client:
        return await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
        )


async def push(server: RouterServer, replicas: list[dict[str, Any]]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.put(server.admin_url + "/api/v1/endpoints", json={"replicas": replicas}) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def usage(server: RouterServer) -> dict[str, Any]:
    # The snapshot the admin API answers is the last tick's: take one now.
    assert server.ticker is not None
    server.ticker.tick()
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/api/v1/usage") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


async def scrape(server: RouterServer) -> str:
    """/metrics as of now: the usage figures are the last tick's, so take one first."""
    assert server.ticker is not None
    server.ticker.tick()
    return await scrape_now(server)


def held(server: RouterServer, model: str = "m") -> int:
    return server.pool.cold_start.held(model)


async def refused_tries(server: RouterServer, clock: FakeClock, count: int) -> None:
    """Let `count` tries of the held request be refused, moving the clock over each pause between them.

    A refused try puts the request back in line (held again) with the timer
    of the next probe set, due within the cap; it ends that way, the next
    probe waiting for the clock.
    """

    def refused() -> bool:
        due = clock.next_call()
        return held(server) == 1 and due is not None and due <= clock.now() + PROBE_CAP_SECONDS

    for done in range(count):
        if done:
            due = clock.next_call()
            assert due is not None
            clock.advance(due - clock.now())
        await wait_for(refused)


async def test_a_request_for_a_model_scaled_to_zero_is_held_and_served_when_a_replica_is_pushed(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([], models=COLD)
    waiting = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    demand = (await usage(server))["demand"]["m"]
    assert demand["held"] == 1 and demand["oldest_held_since"] is not None
    await push(server, [replica_entry("r0", fake)])
    acknowledged = time.perf_counter()
    raw = await waiting
    # Served within 250 ms of the push being acknowledged.
    assert time.perf_counter() - acknowledged < 0.25
    assert raw.parse().choices[0].message.content == "tok0 tok1 "
    assert float(raw.headers["x-router-held-seconds"]) > 0
    assert len(fake.seen) == 1 and held(server) == 0
    text = await scrape(server)
    assert samples(text, "router_hold_outcomes_total")[(("model", "m"), ("outcome", "served"))] == 1
    assert samples(text, "router_held_requests")[(("model", "m"),)] == 0
    assert samples(text, "router_held_seconds_count")[(("model", "m"),)] == 1


async def test_held_while_the_pushed_replica_refuses_connections_then_served_as_it_listens(
    start_router: StartRouter,
) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    clock = FakeClock()
    server = await start_router([{"id": "r0", "model": "m", "url": url}], models=COLD, clock=clock)
    fake = FakeReplica(models=("m",), name="loading")
    try:
        waiting = asyncio.create_task(ask(server))
        await wait_for(lambda: held(server) == 1)
        # Several refused tries meanwhile.
        await refused_tries(server, clock, 4)
        assert not waiting.done()
        await fake.start(sock=sock)  # the engine starts to answer
        listening = time.perf_counter()
        clock.advance(PROBE_CAP_SECONDS)  # the next try comes within the cap of the pauses
        raw = await waiting
        assert time.perf_counter() - listening < 0.25
        assert raw.parse().choices[0].message.content == "tok0 tok1 "
    finally:
        await fake.stop()


async def test_held_while_the_replica_answers_503_loading_then_served(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    loading = await start_fake("m", behaviour=Behaviour(fail_status=503, fail_body=b'{"message": "Loading model"}'))
    clock = FakeClock()
    server = await start_router([replica_entry("r0", loading)], models=COLD, clock=clock)
    waiting = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    await refused_tries(server, clock, 3)
    tries = len(loading.seen)
    assert tries >= 2  # tried again while it loads, not once
    loading.behaviour.fail_status = None
    clock.advance(PROBE_CAP_SECONDS)
    raw = await waiting
    assert raw.parse().choices[0].message.content == "tok0 tok1 "


async def test_one_more_than_max_held_gets_a_fast_503_model_cold_with_retry_after(
    start_router: StartRouter,
) -> None:
    server = await start_router([], models={"m": {"cold_start_seconds": 10, "max_held": 3}})
    waiting = [asyncio.create_task(ask(server)) for _ in range(3)]
    await wait_for(lambda: held(server) == 3)
    async with aiohttp.ClientSession() as session:
        began = time.perf_counter()
        async with session.post(server.client_url + "/v1/chat/completions", json=CHAT) as resp:
            body = await resp.json()
            assert resp.status == 503
            assert time.perf_counter() - began < 1.0
            assert int(resp.headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "model_cold" and "starting" in body["error"]["message"]
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_max_held_counts_a_held_request_while_it_probes_a_loading_replica(
    start_router: StartRouter, start_raw: StartRaw
) -> None:
    """The bound holds at every instant: a request that arrives while the held one tries a replica sees it."""
    probing = asyncio.Event()
    answer = asyncio.Event()

    async def loading(exchange: Exchange) -> None:
        # An engine still loading: 503 at once to the first try (which holds the request);
        # the probes that follow it takes, and answers 503 once the test says so.
        if exchange.index > 1:
            probing.set()
            await asyncio.wait_for(answer.wait(), timeout=30)
        await exchange.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 7\r\n\r\nloading")

    replica = await start_raw(loading)
    server = await start_router(
        [{"id": "r0", "model": "m", "url": replica.url}],
        models={"m": {"cold_start_seconds": 30, "max_held": 1}},
    )
    first = asyncio.create_task(ask(server))
    try:
        await asyncio.wait_for(probing.wait(), timeout=10)
        assert held(server) == 1
        async with (
            aiohttp.ClientSession() as session,
            session.post(server.client_url + "/v1/chat/completions", json=CHAT) as resp,
        ):
            body = await resp.json()
            assert resp.status == 503, body
        assert body["error"]["code"] == "model_cold" and "1 request already waits" in body["error"]["message"]
        answer.set()
        # Its probe refused, the first request is still held (and still the only one).
        await wait_for(lambda: len(replica.requests) >= 3)
        assert held(server) == 1
    finally:
        answer.set()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    await wait_for(lambda: held(server) == 0)


async def test_the_deadline_gives_503_after_cold_start_seconds_not_before(start_router: StartRouter) -> None:
    clock = FakeClock(0.0)  # from 0, so that 0.8 s later reads as 0.8 exactly
    server = await start_router([], models={"m": {"cold_start_seconds": 0.8}}, clock=clock)
    began = clock.now()
    asking = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    clock.advance(0.79)
    assert held(server) == 1  # not a moment before the deadline
    clock.advance(0.01)
    with pytest.raises(openai.APIStatusError) as raised:
        await asking
    assert 0.8 <= clock.now() - began < 3.0
    assert raised.value.status_code == 503
    assert raised.value.response.headers["Retry-After"]
    assert "model_cold" in raised.value.response.text
    text = await scrape(server)
    assert samples(text, "router_hold_outcomes_total")[(("model", "m"), ("outcome", "timeout"))] == 1


async def test_a_client_that_leaves_while_held_leaves_the_queue_and_reaches_no_replica(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([], models=COLD)
    waiting = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await wait_for(lambda: held(server) == 0)
    assert (await usage(server))["demand"].get("m", {}).get("held", 0) == 0
    await push(server, [replica_entry("r0", fake)])
    # Real time: that nothing reaches the replica is no event to wait for; a request sent
    # after the push would be one, but would change what the replica saw.
    await asyncio.sleep(0.3)
    assert fake.seen == []
    text = await scrape(server)
    assert samples(text, "router_hold_outcomes_total")[(("model", "m"), ("outcome", "client_gone"))] == 1


async def test_a_burst_is_served_in_arrival_order(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([], models=COLD, max_in_flight_per_replica=1)
    tasks = []
    for i in range(8):
        body = {**CHAT, "messages": [{"role": "user", "content": f"request {i}"}]}
        tasks.append(asyncio.create_task(_post(server, body)))
        await wait_for(lambda n=i + 1: held(server) == n)
    await push(server, [replica_entry("r0", fake)])
    assert list(await asyncio.gather(*tasks)) == [200] * 8
    order = [orjson.loads(seen.body)["messages"][0]["content"] for seen in fake.seen]
    assert order == [f"request {i}" for i in range(8)]


async def _post(server: RouterServer, body: dict[str, Any]) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.client_url + "/v1/chat/completions", json=body) as resp,
    ):
        await resp.read()
        return resp.status


async def test_a_held_stream_is_served_as_a_stream(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=3))
    server = await start_router([], models=COLD)

    async def stream() -> list[str]:
        async with sdk(server) as client:
            chunks = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            return [c.choices[0].delta.content or "" async for c in chunks if c.choices]

    waiting = asyncio.create_task(stream())
    await wait_for(lambda: held(server) == 1)
    await push(server, [replica_entry("r0", fake)])
    assert "".join(await waiting) == "tok0 tok1 tok2 "


@pytest.fixture
async def wake_receiver() -> AsyncIterator[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    switches: dict[str, Any] = {"silent": False, "status": 200, "auth": []}
    # A silent receiver answers nothing until the test is over (then, to no one).
    over = asyncio.Event()

    async def wake(request: web.Request) -> web.Response:
        calls.append(await request.json())
        switches["auth"].append(request.headers.get("Authorization"))
        if switches["silent"]:
            await over.wait()
        return web.Response(status=switches["status"])

    app = web.Application()
    app.router.add_post("/wake", wake)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}/wake", calls, switches
    over.set()
    await runner.cleanup()


async def test_500_held_requests_make_one_wake_call_per_cooldown(
    start_router: StartRouter, wake_receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, calls, switches = wake_receiver
    clock = FakeClock()
    server = await start_router(
        [],
        models={"m": {"cold_start_seconds": 30, "max_held": 1000}},
        wake_url=url,
        wake_cooldown_seconds=0.6,
        admin_token="admin-secret",
        clock=clock,
    )
    tasks = [asyncio.create_task(_post(server, CHAT)) for _ in range(500)]
    try:
        await wait_for(lambda: held(server) == 500, timeout=20)
        await wait_for(lambda: len(calls) == 1)
        assert calls[0]["model"] == "m" and calls[0]["router"] == "test"
        assert calls[0]["held"] >= 1 and calls[0]["since"] is not None
        assert switches["auth"][0] == "Bearer admin-secret"
        clock.advance(0.4)
        assert len(calls) == 1  # within the cooldown: still one
        # Still held past the cooldown: one more call, not 500.
        clock.advance(0.2)
        await wait_for(lambda: len(calls) == 2, timeout=3)
        assert calls[1]["held"] == 500
        text = await scrape(server)
        assert samples(text, "router_wake_calls_total")[(("model", "m"), ("result", "ok"))] == 2
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_wake_receiver_down_or_slow_changes_nothing_on_the_data_path(
    start_fake: StartFake,
    start_router: StartRouter,
    wake_receiver: tuple[str, list[dict[str, Any]], dict[str, Any]],
) -> None:
    url, _, switches = wake_receiver
    switches["silent"] = True  # slower than the call's timeout
    fake = await start_fake("m")
    slow = await start_router([], models=COLD, wake_url=url, wake_cooldown_seconds=0.2)
    down = await start_router([], models=COLD, wake_url="http://127.0.0.1:9", wake_cooldown_seconds=0.2)
    for server in (slow, down):
        waiting = asyncio.create_task(ask(server))
        await wait_for(lambda s=server: held(s) == 1)
        await push(server, [replica_entry("r0", fake)])
        began = time.perf_counter()
        await waiting
        assert time.perf_counter() - began < 0.25

    # Failures are counted (and logged once a minute), nothing more.
    async def counted() -> bool:
        found = samples(await scrape(down), "router_wake_calls_total")
        return bool(found.get((("model", "m"), ("result", "unreachable"))))

    await until(counted)


async def test_a_model_declared_with_no_replica_is_held_after_a_restart_not_404(start_router: StartRouter) -> None:
    clock = FakeClock()
    server = await start_router([], models={"m": {"cold_start_seconds": 0.3}}, clock=clock)
    asking = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    clock.advance(0.3)
    with pytest.raises(openai.APIStatusError) as raised:
        await asking
    # Known (declared), not unknown: a 503 after the hold, never a 404.
    assert raised.value.status_code == 503


async def test_a_model_that_had_replicas_is_known_after_they_all_left(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    await push(server, [])
    with pytest.raises(openai.APIStatusError) as raised:
        await ask(server)
    assert raised.value.status_code == 503  # scaled to zero: unavailable, not unknown


async def test_held_models_are_never_idle_candidates_and_status_shows_them(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    import contextlib
    import io

    from router.tools import ctl

    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], models=COLD, tick_seconds=0.05)
    server.pool.set_draining("r0", True)  # drained: a request for m is held
    waiting = asyncio.create_task(ask(server))
    await wait_for(lambda: held(server) == 1)
    await usage(server)

    def run(*args: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert ctl.main(list(args)) == 0
        return out.getvalue()

    idle = orjson.loads(
        await asyncio.to_thread(run, "idle", "--server", server.admin_url, "--idle-for", "0s", "--json")
    )
    assert idle["complete"] and idle["candidates"] == []
    status = await asyncio.to_thread(run, "status", "--server", server.admin_url)
    assert "held, waiting for a replica" in status
    section = status.split("held, waiting for a replica", 1)[1]
    line = next(line for line in section.splitlines() if line.startswith("m "))
    assert line.split()[1:3] == ["1", "1"]  # one replica (drained), one held
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_sigterm_answers_held_requests_at_once(serve: Serve) -> None:
    serve.write([], extra='shutdown_delay_seconds = 0\n[models."m"]\ncold_start_seconds = 60\n')
    await serve.start()
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(serve.client_url + "/v1/chat/completions", json=CHAT))

        async def held_now() -> int:
            async with session.get(serve.admin_url + "/api/v1/usage") as resp:
                doc = await resp.json()
                return int(doc.get("demand", {}).get("m", {}).get("held", 0))

        async def one_held() -> bool:
            return await held_now() >= 1

        await until(one_held, timeout=10)
        assert serve.process is not None
        began = time.perf_counter()
        os.kill(serve.process.pid, signal.SIGTERM)
        resp = await request
        assert resp.status == 503
        assert time.perf_counter() - began < 2.0
        assert (await resp.json())["error"]["code"] == "model_cold"
        resp.release()
    assert serve.process.wait(timeout=15) == 0


async def test_the_example_wake_receiver_starts_a_replica_and_the_held_request_is_served(
    start_router: StartRouter,
) -> None:
    """deploy/scale-from-zero/wake_receiver.py, docs/scale-from-zero.md's example, end to end."""
    import sys

    from tests.support.processes import held_port
    from tests.support.receiver import wake_receiver

    # The router names the receiver (wake_url) and the receiver the router (--router-admin): the
    # receiver first, on port 0, told the router's admin port, which the test holds until the router takes it.
    with held_port() as admin:
        admin_listen = f"127.0.0.1:{admin.getsockname()[1]}"
        async with wake_receiver(
            *("--listen", "127.0.0.1:0", "--router-admin", f"http://{admin_listen}"),
            *("--model", f"m={sys.executable} -m router.tools.fake --port {{port}} --model m"),
        ) as receiver:
            server = await start_router(
                [], models={"m": {"cold_start_seconds": 30}}, wake_url=receiver.url, admin_listen=admin_listen
            )
            raw = await ask(server)
            assert raw.parse().choices[0].message.content == "tok0 tok1 "
            assert float(raw.headers["x-router-held-seconds"]) > 0
            assert [c.model for c in server.pool.configs()] == ["m"]
            # Stopped with SIGINT, as in a terminal: the engine it started goes with it.
            assert await receiver.stop(signal.SIGINT) == 0
