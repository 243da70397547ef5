"""The usage map through the real admin API, Prometheus parser and ctl."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.core.pool.pool import Pool
from router.core.usage.snapshots import Ticker, UsageSnapshot
from router.run.app import RouterServer
from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, get_json, post, run_ctl, samples, scrape
from tests.support.clock import FakeClock
from tests.support.waiting import tick, wait_for


async def two_replicas(start_fake: StartFake, start_router: StartRouter, **settings: Any) -> RouterServer:
    a = await start_fake("m", name="a")
    b = await start_fake("m", name="b")
    return await start_router([replica_entry("a", a), replica_entry("b", b)], **settings)


async def test_a_new_router_knows_nothing_and_says_so_everywhere(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    server = await two_replicas(start_fake, start_router)
    usage = await get_json(server.admin_url + "/api/v1/usage")
    assert usage["last_used"] == {}
    assert set(usage["watching_since"]) == {"a", "b"}
    assert usage["router"] == "test"
    assert usage["started_at"] <= usage["generated_at"]
    rows = await get_json(server.admin_url + "/api/v1/replicas")
    for row in rows:
        assert row["last_used"] is None
        assert row["idle_seconds"] < 0
    text = await scrape(server)
    assert samples(text, "router_replica_last_used_timestamp_seconds") == {}
    assert len(samples(text, "router_replica_watching_since_timestamp_seconds")) == 2
    code, out = await asyncio.to_thread(run_ctl, "replicas", "--server", server.admin_url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:1] == ["ID"]
    idle_column = lines[0].split().index("IDLE")
    assert [line.split()[idle_column] for line in lines[1:]] == ["-", "-"]
    assert all(r.quiet_seconds(time.time()) is None for r in server.ticker.snapshot().replicas)  # type: ignore[union-attr]


async def test_only_the_replica_that_served_is_stamped(start_fake: StartFake, start_router: StartRouter) -> None:
    server = await two_replicas(start_fake, start_router, tick_seconds=0.05)
    before = time.time()
    status, headers, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert status == 200
    served = headers["X-Served-By"]
    await tick(server)
    usage = await get_json(server.admin_url + "/api/v1/usage")
    assert list(usage["last_used"]) == [served]
    assert before <= usage["last_used"][served] <= time.time()
    rows = {r["id"]: r for r in await get_json(server.admin_url + "/api/v1/replicas")}
    assert rows[served]["idle_seconds"] >= 0
    assert rows[served]["requests"] == 1
    text = await scrape(server)
    stamped = samples(text, "router_replica_last_used_timestamp_seconds")
    assert list(stamped) == [(("model", "m"), ("replica", served))]
    assert samples(text, "router_requests_total") == {
        (("model", "m"), ("replica", served), ("status_class", "2xx")): 1.0
    }


async def test_models_listing_health_and_scrapes_do_not_stamp(start_fake: StartFake, start_router: StartRouter) -> None:
    server = await two_replicas(start_fake, start_router, tick_seconds=0.05)
    async with aiohttp.ClientSession() as session:
        for url in (
            server.client_url + "/v1/models",
            server.admin_url + "/healthz",
            server.admin_url + "/readyz",
            server.admin_url + "/metrics",
            server.admin_url + "/api/v1/replicas",
        ):
            async with session.get(url) as resp:
                assert resp.status == 200
    await post(server.client_url + "/v1/chat/completions", b"{not json")
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({"model": "nope"}))
    await tick(server)
    usage = await get_json(server.admin_url + "/api/v1/usage")
    assert usage["last_used"] == {}


async def test_a_long_stream_counts_as_use_while_it_runs(start_fake: StartFake, start_router: StartRouter) -> None:
    slow = await start_fake("m", behaviour=Behaviour(tokens=12, token_delay=0.05))
    server = await start_router([replica_entry("r0", slow)], tick_seconds=0.1)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            server.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        started = time.time()
        # Real time: a replica in flight is stamped at each tick, which the wall clock paces.
        await asyncio.sleep(0.45)
        usage = await get_json(server.admin_url + "/api/v1/usage")
        # The request began ~0.45 s ago, but a replica in flight is in use now.
        assert usage["last_used"]["r0"] >= started + 0.2
        assert usage["last_used"]["r0"] >= usage["generated_at"] - 1e-6
        await resp.read()
        resp.close()
    ended = time.time()
    await tick(server)
    usage = await get_json(server.admin_url + "/api/v1/usage")
    # Once the stream is over the stamp stays where the last tick in flight put it.
    assert ended - 0.15 <= usage["last_used"]["r0"] <= ended


async def test_the_usage_body_is_serialized_once_per_tick(start_fake: StartFake, start_router: StartRouter) -> None:
    server = await two_replicas(start_fake, start_router, tick_seconds=30)
    body = server.latest.usage_body
    assert body is not None
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.get(server.admin_url + "/api/v1/usage") as resp:
                assert await resp.read() == body
    assert server.latest.usage_body is body


async def test_removed_replicas_leave_the_map_and_added_ones_start_unknown(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    a = await start_fake("m", name="a")
    b = await start_fake("m", name="b")
    server = await start_router([replica_entry("a", a)], tick_seconds=0.05)
    await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    added_at = time.time()
    async with (
        aiohttp.ClientSession() as session,
        session.put(server.admin_url + "/api/v1/endpoints", json={"replicas": [replica_entry("b", b)]}) as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {"added": ["b"], "removed": ["a"], "changed": [], "unchanged": 0}
    await tick(server)
    usage = await get_json(server.admin_url + "/api/v1/usage")
    assert usage["last_used"] == {}
    assert list(usage["watching_since"]) == ["b"]
    assert usage["watching_since"]["b"] >= added_at - 0.01
    assert usage["watching_since"]["b"] > usage["started_at"]
    text = await scrape(server)
    assert {dict(k)["replica"] for k in samples(text, "router_replica_in_flight_requests")} == {"b"}


class Recording:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[UsageSnapshot] = []

    def publish(self, snapshot: UsageSnapshot) -> None:
        self.seen.append(snapshot)


class Broken:
    name = "broken"

    def publish(self, snapshot: UsageSnapshot) -> None:
        raise RuntimeError("exporter bug")


def test_a_failing_sink_is_counted_and_never_starves_the_others(caplog: pytest.LogCaptureFixture) -> None:
    first, last = Recording("first"), Recording("last")
    ticker = Ticker(Pool(), [first, Broken(), last], router="r", started_at=0.0, tick_seconds=1.0)
    for _ in range(3):
        ticker.tick()
    assert len(first.seen) == len(last.seen) == 3
    assert ticker.sink_failures == {"first": 0, "broken": 3, "last": 0}
    assert "usage sink broken failed" in caplog.text


def test_stamps_become_unix_seconds_at_the_tick() -> None:
    from router.core.config.settings import ReplicaConfig

    clock = FakeClock(100.0)
    pool = Pool([ReplicaConfig("r", "m", "http://127.0.0.1:1")], clock=clock)
    ticker = Ticker(
        pool,
        [],
        router="x",
        started_at=5000.0,
        tick_seconds=1.0,
        wall=lambda: 5000.0 + clock.now() - 100.0,
        mono=clock.now,
    )
    replica = pool.acquire("m")
    assert replica is not None
    clock.advance(3.0)
    pool.release(replica)
    clock.advance(7.0)
    (usage,) = ticker.tick().replicas
    assert usage.last_used == pytest.approx(5000.0)
    assert usage.quiet_seconds(5010.0) == pytest.approx(10.0)
    assert usage.watching_since == 5000.0


async def test_the_usage_document_is_pushed_each_tick(
    start_fake: StartFake, start_router: StartRouter, receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, received, _ = receiver
    server = await two_replicas(start_fake, start_router, tick_seconds=0.05, usage_push_url=url)
    await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    await wait_for(lambda: any(doc["last_used"] for doc in received))
    doc = received[-1]
    assert set(doc) == {
        "router",
        "started_at",
        "generated_at",
        "tick_seconds",
        "last_used",
        "watching_since",
        "model",
        "asleep",
        "demand",
    }
    assert set(doc["watching_since"]) == {"a", "b"}
    assert doc["model"] == {"a": "m", "b": "m"}
    assert doc["asleep"] == {}
    assert server.push is not None and server.push.failures == 0


async def test_a_slow_receiver_never_gets_pushes_stacked(
    start_fake: StartFake, start_router: StartRouter, receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, received, switches = receiver
    switches["delay"] = 0.03
    server = await two_replicas(start_fake, start_router, tick_seconds=0.05, usage_push_url=url)
    # The data path is not delayed by the push.
    for _ in range(5):
        status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
    await wait_for(lambda: len(received) >= 3)
    assert switches["most_active"] == 1
    assert len(received) >= 3
    generated = [doc["generated_at"] for doc in received]
    assert generated == sorted(generated)


async def test_push_failures_are_counted_not_raised(
    start_fake: StartFake, start_router: StartRouter, receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, _, switches = receiver
    switches["status"] = 500
    server = await two_replicas(start_fake, start_router, tick_seconds=0.05, usage_push_url=url)
    await wait_for(lambda: server.push is not None and server.push.failures >= 3)
    text = await scrape(server)
    (failures,) = samples(text, "router_usage_push_failures_total").values()
    assert failures >= 3
    status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert status == 200


async def test_metrics_cover_the_data_path_and_pass_promtool(start_fake: StartFake, start_router: StartRouter) -> None:
    good = await start_fake("m", name="good")
    bad = await start_fake("m", name="bad", behaviour=Behaviour(fail_status=503))
    server = await start_router(
        [
            replica_entry("good", good),
            replica_entry("bad", bad),
            {"id": "gone", "model": "x", "url": "http://127.0.0.1:1"},
        ],
        tick_seconds=0.05,
        models={"x": {"fallbacks": ["m"]}},
    )
    bad_replica = server.pool.get("bad")
    assert bad_replica is not None
    sent = 0
    # Ties are broken at random: send until the failing replica has been tried.
    while not bad_replica.errors or sent < 4:
        status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
        sent += 1
        assert sent < 200
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "x"}))
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "wanted"}))
    await tick(server)
    text = await scrape(server)
    assert samples(text, "router_unserved_requests_total") == {(("model", "wanted"),): 1.0}
    assert samples(text, "router_fallbacks_total") == {(("fallback", "m"), ("model", "x")): 1.0}
    assert sum(samples(text, "router_retries_total").values()) >= 1
    errors = samples(text, "router_upstream_errors_total")
    assert errors[(("model", "x"), ("reason", "connect"), ("replica", "gone"))] == 1.0
    assert errors[(("model", "m"), ("reason", "status"), ("replica", "bad"))] >= 1
    assert samples(text, "router_request_duration_seconds_count")[(("model", "m"),)] == sent
    assert samples(text, "router_time_to_first_byte_seconds_count")[(("model", "m"),)] >= sent
    states = samples(text, "router_replica_state")
    assert states[(("model", "m"), ("replica", "good"), ("state", "ready"))] == 1.0
    assert states[(("model", "m"), ("replica", "good"), ("state", "ejected"))] == 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert "request_id" not in sample.labels and "path" not in sample.labels
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def test_ctl_idle_merges_two_routers_one_of_which_restarted(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    a = await start_fake("m", name="a")
    b = await start_fake("m", name="b")
    replicas = [replica_entry("a", a), replica_entry("b", b)]
    old = await start_router(replicas, tick_seconds=0.05)
    await post(old.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    # Real time: --idle-for is measured against the router's wall clock.
    await asyncio.sleep(0.5)
    code, out = await asyncio.to_thread(run_ctl, "idle", "--server", old.admin_url, "--idle-for", "0.3", "--json")
    assert code == 0
    alone = orjson.loads(out)
    assert alone["complete"] is True
    assert {c["id"] for c in alone["candidates"]} == {"a", "b"}
    # A second router that has just (re)started: it has watched nothing for long.
    fresh = await start_router(replicas, tick_seconds=0.05)
    code, out = await asyncio.to_thread(
        run_ctl, "idle", "--server", old.admin_url, "--server", fresh.admin_url, "--idle-for", "0.3", "--json"
    )
    merged = orjson.loads(out)
    assert code == 0
    assert merged.pop("as_of") > 0
    assert merged == {"complete": True, "candidates": [], "unknown": []}
    code, out = await asyncio.to_thread(
        run_ctl, "idle", "--server", old.admin_url, "--server", "127.0.0.1:1", "--idle-for", "0.3", "--json"
    )
    assert code == 3
    broken = orjson.loads(out)
    assert broken["complete"] is False
    assert broken["candidates"] == []
    assert sorted(broken["unknown"]) == ["a", "b"]


async def old_or_new_router(asked: list[str], *, names_models: bool) -> web.AppRunner:
    """A router's admin API as ctl idle reads it: the usage map, naming the models or (a router from before) not."""
    usage = {
        "router": "r",
        "started_at": 1000.0,
        "generated_at": 5000.0,
        "tick_seconds": 5.0,
        "last_used": {"a": 1500.0},
        "watching_since": {"a": 1000.0, "b": 1000.0},
        "demand": {},
    }
    if names_models:
        usage["model"] = {"a": "llama", "b": "qwen"}
    replicas = [{"id": "a", "model": "llama"}, {"id": "b", "model": "qwen"}]

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response(usage if request.path == "/api/v1/usage" else replicas)

    app = web.Application()
    app.router.add_get("/api/v1/usage", answer)
    app.router.add_get("/api/v1/replicas", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.mark.parametrize("names_models", [True, False])
async def test_ctl_idle_reads_the_usage_map_alone_when_it_names_the_models(names_models: bool) -> None:
    asked: list[str] = []
    runner = await old_or_new_router(asked, names_models=names_models)
    try:
        port = runner.addresses[0][1]
        code, out = await asyncio.to_thread(
            run_ctl, "idle", "--server", f"127.0.0.1:{port}", "--idle-for", "1000", "--json"
        )
    finally:
        await runner.cleanup()
    assert code == 0
    candidates = orjson.loads(out)["candidates"]
    assert [(c["id"], c["model"]) for c in candidates] == [("a", "llama"), ("b", "qwen")]
    # No per-replica document from a router whose map names the models (10,000 replicas: megabytes).
    assert asked == (["/api/v1/usage"] if names_models else ["/api/v1/usage", "/api/v1/replicas"])


async def test_ctl_usage_prints_dashes_for_unknown(start_fake: StartFake, start_router: StartRouter) -> None:
    server = await two_replicas(start_fake, start_router, tick_seconds=0.05)
    await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    await tick(server)
    code, out = await asyncio.to_thread(run_ctl, "usage", "--server", server.admin_url)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert sorted(row[1] == "-" for row in rows) == [False, True]
    code, _ = await asyncio.to_thread(run_ctl, "usage", "--server", "127.0.0.1:1")
    assert code == 1
