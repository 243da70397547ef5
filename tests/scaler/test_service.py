"""`router scaler` in front of two real `router serve` processes, called by a real gRPC client as KEDA calls it.

The routers run on fake replicas with a 0.1 s tick; the scaler polls them
every 0.1 s (or only when a test starts a round, where the order of events
must be exact). Times are compared with the routers' own clocks (their
`started_at`), never against a wall-clock budget, but for the one promise
that is a time: a held request turns StreamIsActive true within 1 s.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc import aio

from router.scaler.externalscaler_pb2 import GetMetricsRequest, ScaledObjectRef
from router.scaler.externalscaler_pb2_grpc import ExternalScalerStub
from router.scaler.main import STOP_GRACE_SECONDS
from router.scaler.view import metric_name
from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.clients import samples
from tests.support.raw_server import StartRaw
from tests.support.scaler import (
    Keda,
    Routers,
    StartScaler,
    Stream,
    is_active,
    metric,
    never_answer,
    ref,
    scaler_listening,
    until,
)

ROOT = Path(__file__).resolve().parents[2]
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
COLD = '[models."cold"]\ncold_start_seconds = 30\n'


async def chat(client_url: str, model: str, *, stream: bool = False) -> tuple[int, dict[str, str], bytes]:
    """A chat completion through a router, read to its end."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(client_url + "/v1/chat/completions", json={**CHAT, "model": model, "stream": stream}) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


async def scaler_metrics(http_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(http_url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def healthz(http_url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(http_url + "/healthz") as resp:
        assert resp.status == 200
        doc: dict[str, Any] = await resp.json()
        return doc


async def test_a_quiet_fleet_turns_inactive_once_every_router_watched_it_idle_after(
    routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m")
    routers.write([{"id": "r0", "model": "m", "url": fake.url}])
    await routers.start()
    scaler = await start_scaler(routers.admins)
    stub = keda(scaler)
    stream = Stream(stub, ref("m", idleAfter="3"))
    turned = await stream.wait_for(False)
    # Just started, the routers prove nothing quiet yet: active first.
    assert stream.values[0][1] is True
    started = max([(await routers.usage(i))["started_at"] for i in (0, 1)])
    assert turned >= started + 3
    assert not await is_active(stub, ref("m", idleAfter="3"))
    assert await is_active(stub, ref("m", idleAfter="3600"))
    await stream.close()


@pytest.mark.parametrize("through", [0, 1], ids=["router-a", "router-b"])
async def test_a_long_stream_through_either_router_keeps_the_model_active_for_its_whole_length(
    through: int, routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=40, token_delay=0.1))
    routers.write([{"id": "r0", "model": "m", "url": fake.url}])
    await routers.start()
    scaler = await start_scaler(routers.admins)
    stream = Stream(keda(scaler), ref("m", idleAfter="1"))
    await stream.wait_for(False)
    began = time.time()
    request = asyncio.create_task(chat(routers.all[through].client_url, "m", stream=True))
    await stream.wait_for(True)
    status, _, body = await request
    ended = time.time()
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert ended - began > 3.5
    turned = await stream.wait_for(False)
    # From the first True to the stream's end and a tick after it, nothing else was said.
    during = [value for at, value in stream.values if began <= at < ended]
    assert during and all(during), stream.values
    assert turned >= ended - 0.2 + 1.0
    await stream.close()


async def test_a_held_request_turns_stream_is_active_true_within_a_second(
    routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m")
    # Rounds only when a test or a wake call starts one: only the wake call can be quick here.
    scaler = await start_scaler(routers.admins, poll_seconds=3600)
    routers.write([{"id": "r0", "model": "m", "url": fake.url}], f'wake_url = "{scaler.http_url}/wake"\n{COLD}')
    await routers.start()
    assert scaler.poller is not None
    assert (await scaler.poller.round()).complete
    stream = Stream(keda(scaler), ref("cold", idleAfter="600"))
    await stream.wait_for(False)
    asked = time.time()
    request = asyncio.create_task(chat(routers.all[1].client_url, "cold"))
    flipped = await stream.wait_for(True, timeout=10)
    print(f"StreamIsActive turned true {flipped - asked:.3f} s after the request was sent")
    assert flipped - asked < 1.0
    calls = samples(await scaler_metrics(scaler.http_url), "router_scaler_wake_calls_total")
    assert calls[(("result", "ok"),)] >= 1
    # Then the replica arrives (KEDA's part, and the endpoint push) and the held request is served.
    cold = await start_fake("cold")
    async with (
        aiohttp.ClientSession() as session,
        session.put(
            routers.all[1].admin_url + "/api/v1/endpoints",
            json={
                "replicas": [
                    {"id": "r0", "model": "m", "url": fake.url},
                    {"id": "c0", "model": "cold", "url": cold.url},
                ]
            },
        ) as resp,
    ):
        assert resp.status == 200
    status, headers, _ = await request
    assert status == 200 and "X-Router-Held-Seconds" in headers
    # Served and in the routers' map now: still active, for its quiet time is short.
    await scaler.poller.round()
    assert stream.last is True
    await stream.close()


async def test_a_stopped_router_makes_the_model_active_until_it_is_back_and_watched_idle_after(
    routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m")
    routers.write([{"id": "r0", "model": "m", "url": fake.url}])
    await routers.start()
    scaler = await start_scaler(routers.admins)
    stream = Stream(keda(scaler), ref("m", idleAfter="1"))
    await stream.wait_for(False)
    routers.stop(1)
    await stream.wait_for(True)
    b = routers.admins[1]
    health = await healthz(scaler.http_url)
    (seen,) = [r for r in health["routers"] if r["server"] == b]
    assert seen["ok"] is False and seen["failures"] >= 1 and b in (seen["last_error"] or "")
    text = await scaler_metrics(scaler.http_url)
    assert samples(text, "router_scaler_poll_failures_total")[(("server", b),)] >= 1
    assert samples(text, "router_scaler_router_up")[(("server", b),)] == 0
    assert samples(text, "router_scaler_incomplete_polls_total")[()] >= 1
    # The merge age grows while a router is missing.
    first_age = samples(text, "router_scaler_last_complete_merge_age_seconds")[()]
    # Real time: the age is the scaler's wall clock's.
    await asyncio.sleep(0.5)
    later = samples(await scaler_metrics(scaler.http_url), "router_scaler_last_complete_merge_age_seconds")[()]
    assert later > first_age
    # Still active while it is missing, whatever idleAfter: real time, for idleAfter (1 s below)
    # passes on the scaler's wall clock.
    await asyncio.sleep(1.5)
    assert await is_active(keda(scaler), ref("m", idleAfter="1"))
    assert stream.values[-1][1] is True
    await routers.all[1].start()
    back = await stream.wait_for(False)
    assert back >= (await routers.usage(1))["started_at"] + 1
    assert samples(await scaler_metrics(scaler.http_url), "router_scaler_router_up")[(("server", b),)] == 1
    await stream.close()


async def test_a_restarted_router_keeps_the_model_active_until_its_new_watch_passes_idle_after(
    routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m")
    routers.write([{"id": "r0", "model": "m", "url": fake.url}])
    await routers.start()
    # Rounds only when the test starts one, so that none sees the router down.
    scaler = await start_scaler(routers.admins, poll_seconds=3600)
    assert scaler.poller is not None
    stub = keda(scaler)
    query = ref("m", idleAfter="2")

    async def quiet() -> bool:
        assert scaler.poller is not None
        assert (await scaler.poller.round()).complete
        return not await is_active(stub, query)

    await until(quiet)
    await routers.restart(1)
    view = await scaler.poller.round()
    assert view.complete
    assert await is_active(stub, query)
    restarted = (await routers.usage(1))["started_at"]
    turned = await until(quiet)
    assert turned >= restarted + 2


async def test_the_metric_is_in_flight_plus_held_summed_over_both_routers(
    routers: Routers, start_fake: StartFake, start_scaler: StartScaler, keda: Keda
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=400, token_delay=0.05))
    routers.write([{"id": "r0", "model": "m", "url": fake.url}], COLD)
    await routers.start()
    scaler = await start_scaler(routers.admins)
    stub = keda(scaler)
    a, b = (r.client_url for r in routers.all)
    requests = [
        *(asyncio.create_task(chat(a, "m", stream=True)) for _ in range(2)),
        asyncio.create_task(chat(b, "m", stream=True)),
        asyncio.create_task(chat(a, "cold")),
        *(asyncio.create_task(chat(b, "cold")) for _ in range(2)),
    ]

    async def figures() -> bool:
        if scaler.board.view is None:
            return False
        return (await metric(stub, ref("m")), await metric(stub, ref("cold"))) == (3.0, 3.0)

    await until(figures)
    # The replica's own count agrees: three requests reached it.
    assert fake.active == 3
    assert await metric(stub, ref("absent")) == 0.0
    spec = await stub.GetMetricSpec(ref("m", targetInFlight="2.5"), timeout=5)
    (only,) = spec.metricSpecs
    assert (only.metricName, only.targetSizeFloat, only.targetSize) == (metric_name("m"), 2.5, 3)
    # KEDA asks by the name it holds; the answer carries it back.
    answer = await stub.GetMetrics(GetMetricsRequest(scaledObjectRef=ref("m"), metricName="s0-x"), timeout=5)
    assert [v.metricName for v in answer.metricValues] == ["s0-x"]
    assert [v.metricValue for v in answer.metricValues] == [3]
    for request in requests:
        request.cancel()
    await asyncio.gather(*requests, return_exceptions=True)


BAD_METADATA = [
    pytest.param({}, "scalerMetadata.model", id="no-model"),
    pytest.param({"model": "  "}, "scalerMetadata.model", id="blank-model"),
    pytest.param({"model": "m", "idleAfter": "soon"}, "scalerMetadata.idleAfter", id="idle-after-not-a-number"),
    pytest.param({"model": "m", "idleAfter": "-5"}, "scalerMetadata.idleAfter", id="idle-after-negative"),
    pytest.param({"model": "m", "idleAfter": "inf"}, "scalerMetadata.idleAfter", id="idle-after-infinite"),
    pytest.param({"model": "m", "targetInFlight": "0"}, "scalerMetadata.targetInFlight", id="target-zero"),
    pytest.param({"model": "m", "targetInFlight": "many"}, "scalerMetadata.targetInFlight", id="target-not-a-number"),
    pytest.param({"model": "m", "idleafter": "30"}, "scalerMetadata.idleafter", id="key-in-the-wrong-case"),
]


@pytest.mark.parametrize(("metadata", "key"), BAD_METADATA)
async def test_bad_metadata_is_invalid_argument_naming_the_key_on_every_method(
    metadata: dict[str, str], key: str, start_scaler: StartScaler, keda: Keda, refused_url: Any
) -> None:
    scaler = await start_scaler([refused_url().removeprefix("http://")])
    stub = keda(scaler)
    request = ScaledObjectRef(name="so", namespace="ns", scalerMetadata=metadata)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "IsActive": lambda: stub.IsActive(request, timeout=5),
        "GetMetricSpec": lambda: stub.GetMetricSpec(request, timeout=5),
        "GetMetrics": lambda: stub.GetMetrics(GetMetricsRequest(scaledObjectRef=request), timeout=5),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert key in (caught.value.details() or ""), (name, caught.value.details())
        assert "ns/so" in (caught.value.details() or "")
    for stream in (stub.StreamIsActive(request, timeout=5), stub.StreamMetricSpec(request, timeout=5)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stream:
                pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert key in (caught.value.details() or "")


async def test_keda_s_own_keys_in_the_metadata_pass(start_scaler: StartScaler, keda: Keda, refused_url: Any) -> None:
    scaler = await start_scaler([refused_url().removeprefix("http://")])
    request = ref("m", scalerAddress="router-scaler:9091", idleAfter="60", targetInFlight="4")
    # No round can complete (the router refuses): active, never an error.
    assert await is_active(keda(scaler), request)


async def test_before_any_round_is_active_and_the_metric_is_unavailable_not_zero(
    start_scaler: StartScaler, keda: Keda, raw_server: StartRaw
) -> None:
    # A router that never answers: the first round cannot finish within the test.
    silent = await raw_server(never_answer)
    scaler = await start_scaler([silent.address], timeout_seconds=30)
    stub = keda(scaler)
    assert await is_active(stub, ref("m"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await metric(stub, ref("m"))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no poll round has finished" in (caught.value.details() or "")
    assert "router_scaler_last_complete_merge_age_seconds" not in await scaler_metrics(scaler.http_url)
    assert (await healthz(scaler.http_url))["last_complete_merge_age_seconds"] is None
    await scaler.stop()


async def test_stream_metric_spec_sends_the_spec_and_stays_open(
    start_scaler: StartScaler, keda: Keda, refused_url: Any
) -> None:
    scaler = await start_scaler([refused_url().removeprefix("http://")])
    call = keda(scaler).StreamMetricSpec(ref("llama-3.1-8b", targetInFlight="4"))
    answers = aiter(call)
    first = await asyncio.wait_for(anext(answers), 5)
    (spec,) = first.metricSpecs
    assert (spec.metricName, spec.targetSizeFloat) == (metric_name("llama-3.1-8b"), 4.0)
    # Nothing more, and not ended, until the scaler stops; then it ends cleanly.
    more = asyncio.ensure_future(anext(answers))
    # Real time: that nothing comes is no event; a while of nothing is what can be seen.
    await asyncio.sleep(0.3)
    assert not more.done()
    await scaler.stop()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(more, 5)
    assert await call.code() == grpc.StatusCode.OK


async def test_streams_that_clients_leave_end_on_the_scaler_and_leave_no_task_behind(
    start_scaler: StartScaler, keda: Keda, refused_url: Any
) -> None:
    scaler = await start_scaler([refused_url().removeprefix("http://")])
    baseline = len(asyncio.all_tasks())
    stub = keda(scaler)
    streams = [Stream(stub, ref(f"m{i % 5}", idleAfter="60")) for i in range(50)]
    for stream in streams:
        await stream.wait_for(True)
    assert scaler.board.streams == 50
    for stream in streams:
        await stream.close()

    async def all_ended() -> bool:
        return scaler.board.streams == 0 and len(asyncio.all_tasks()) <= baseline

    await until(all_ended)


async def test_sigterm_ends_the_command_promptly_with_streams_open(refused_url: Any) -> None:
    argv = ["--server", refused_url().removeprefix("http://"), "--listen", "127.0.0.1:0"]
    argv += ["--http-listen", "127.0.0.1:0", "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "scaler", *argv, cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    # Port 0 for both: the one line it says at --log-level warning names them.
    grpc_address, _ = await scaler_listening(proc.stderr)
    channel = aio.insecure_channel(grpc_address)
    try:
        stub = ExternalScalerStub(channel)
        await channel.channel_ready()
        stream = Stream(stub, ref("m"))
        spec = stub.StreamMetricSpec(ref("m"))
        await stream.wait_for(True, timeout=20)
        await anext(aiter(spec))
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        # Streams end at once; the grace is for unary calls in flight.
        assert time.monotonic() - began < STOP_GRACE_SECONDS + 5
        await stream.close()
    finally:
        await channel.close(None)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_metric_names_are_valid_and_distinct_per_model() -> None:
    models = ["m", "llama-3.1-8b", "Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", "qwen2.5:7b", "模型", "x" * 300]
    names = [metric_name(model) for model in models]
    assert len(set(names)) == len(models)
    for name in names:
        assert name.startswith("router-requests")
        assert len(name) <= 80
        assert all(ch.islower() or ch.isdigit() or ch == "-" for ch in name), name
    assert metric_name("m") == "router-requests-m"
