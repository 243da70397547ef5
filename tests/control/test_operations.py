"""Operating the fleet through the admin API: pushes, the drain fence, ejection, status, auth."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import aiohttp
import orjson
import pytest

from router.control.fleet import Fleet
from router.core.config.settings import ReplicaConfig
from router.run.app import RouterServer
from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, get_json, post, run_ctl, samples, scrape
from tests.support.clock import FakeClock
from tests.support.waiting import tick, wait_for


async def admin(
    server: RouterServer, method: str, path: str, body: Any = None, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    raw = body if isinstance(body, bytes) else None if body is None else orjson.dumps(body)
    data = None if raw is None else io.BytesIO(raw)
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, server.admin_url + path, data=data, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


async def states(server: RouterServer) -> dict[str, str]:
    return {r["id"]: r["state"] for r in await get_json(server.admin_url + "/api/v1/replicas")}


async def test_a_push_is_validated_whole_and_a_bad_one_changes_nothing(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("a", fake)])
    before = await get_json(server.admin_url + "/api/v1/endpoints")
    good = replica_entry("b", fake)
    for replicas, fragment in (
        ([good, good], "duplicate replica id"),
        ([good, {**good, "id": "c", "url": "http://user:pw@127.0.0.1:1"}], "credentials"),
        ([good, {**good, "id": "c", "url": "http://127.0.0.1:1/\r\nX-Evil: 1"}], "CR, LF"),
        ([good, {**good, "id": "c", "url": "file:///etc/passwd"}], "http://"),
        ([good, {**good, "id": "c", "url": "http://127.0.0.1:1/?next=http://evil"}], "query"),
        ([good, {**good, "id": "c", "colour": "red"}], "replicas[1].colour: unknown key"),
        ([{"id": "c", "url": fake.url}], "replicas[0].model: is required"),
    ):
        status, answer = await admin(server, "PUT", "/api/v1/endpoints", {"replicas": replicas})
        assert status == 400, replicas
        assert fragment in answer["error"]["message"]
    for body, fragment in (
        (b"{", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"replicas": [], "extra": 1}', "extra: unknown field"),
        (b"{}", "replicas: is required"),
    ):
        status, answer = await admin(server, "PUT", "/api/v1/endpoints", body)
        assert status == 400
        assert fragment in answer["error"]["message"]
    assert await get_json(server.admin_url + "/api/v1/endpoints") == before


async def test_a_push_is_idempotent_and_answers_the_diff(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    other = await start_fake("m")
    server = await start_router([replica_entry("a", fake), replica_entry("b", fake)])
    desired = {"replicas": [replica_entry("b", other), replica_entry("c", fake, gpus=2)]}
    status, diff = await admin(server, "PUT", "/api/v1/endpoints", desired)
    assert status == 200
    assert diff == {"added": ["c"], "removed": ["a"], "changed": ["b"], "unchanged": 0}
    status, diff = await admin(server, "PUT", "/api/v1/endpoints", desired)
    assert diff == {"added": [], "removed": [], "changed": [], "unchanged": 2}
    current = await get_json(server.admin_url + "/api/v1/endpoints")
    assert current == {
        "replicas": [
            {"id": "b", "model": "m", "url": other.url, "labels": {}},
            {"id": "c", "model": "m", "url": fake.url, "labels": {"gpus": 2}},
        ]
    }


async def test_a_replica_removed_mid_stream_finishes_it_and_gets_nothing_new(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    leaving = await start_fake("m", behaviour=Behaviour(tokens=30, token_delay=0.02))
    staying = await start_fake("m")
    server = await start_router([replica_entry("leaving", leaving), replica_entry("staying", staying)])
    server.pool.set_draining("staying", True)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            server.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        await resp.content.readany()
        server.pool.set_draining("staying", False)
        _, diff = await admin(server, "PUT", "/api/v1/endpoints", {"replicas": [replica_entry("staying", staying)]})
        assert diff["removed"] == ["leaving"]
        assert (await states(server))["leaving"] == "draining"
        for _ in range(10):
            code, headers, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
            assert code == 200
            assert headers["X-Served-By"] == staying.name
        body = await resp.read()
        assert body.endswith(b"data: [DONE]\n\n")
        assert body.count(b"tok") == 30
    assert len(leaving.seen) == 1
    await wait_for(lambda: [r.id for r in server.pool] == ["staying"])
    assert "leaving" not in await states(server)


async def test_the_drain_fence_reads_draining_then_drained(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=20, token_delay=0.03))
    server = await start_router([replica_entry("r0", fake)])
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            server.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
        )
        await resp.content.readany()
        status, answer = await admin(server, "POST", "/api/v1/replicas/r0/state", {"state": "draining"})
        assert (status, answer["state"], answer["in_flight"]) == (200, "draining", 1)
        code, _, body = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert code == 503
        assert orjson.loads(body)["error"]["code"] == "no_replica_available"
        waited = asyncio.ensure_future(
            asyncio.to_thread(run_ctl, "drain", "r0", "--wait", "--server", server.admin_url)
        )
        await resp.read()
        code_and_out = await asyncio.wait_for(waited, 10)
    assert code_and_out[0] == 0
    assert "r0: drained" in code_and_out[1]
    assert (await states(server))["r0"] == "drained"
    assert len(fake.seen) == 1
    assert (await asyncio.to_thread(run_ctl, "undrain", "r0", "--server", server.admin_url))[0] == 0
    assert (await states(server))["r0"] == "ready"
    code, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert code == 200


async def test_state_calls_name_what_is_wrong(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    assert (await admin(server, "POST", "/api/v1/replicas/nope/state", {"state": "draining"}))[0] == 404
    bodies: list[Any] = [{"state": "stopped"}, {"state": "ready", "extra": 1}, [], b"{"]
    for body in bodies:
        status, answer = await admin(server, "POST", "/api/v1/replicas/r0/state", body)
        assert status == 400
        assert "state" in answer["error"]["message"] or "JSON" in answer["error"]["message"]


async def test_consecutive_failures_eject_and_the_replica_comes_back(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    failing = await start_fake("m", behaviour=Behaviour(fail_status=502, fail_body=b"bad gateway"))
    healthy = await start_fake("m")
    clock = FakeClock()
    server = await start_router(
        [replica_entry("bad", failing), replica_entry("good", healthy)],
        ejection_failures=3,
        ejection_base_seconds=0.4,
        tick_seconds=0.05,
        clock=clock,
    )
    sent = 0
    while (await states(server))["bad"] != "ejected":
        code, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert code == 200
        sent += 1
        assert sent < 200
    assert len(failing.seen) == 3
    # Each failed attempt counts in the replica's row (what `router ctl top` shows per second).
    rows = {r["id"]: r for r in await get_json(server.admin_url + "/api/v1/replicas")}
    assert (rows["bad"]["errors"], rows["good"]["errors"]) == (3, 0)
    for _ in range(5):
        await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert len(failing.seen) == 3
    failing.behaviour.fail_status = None
    clock.advance(0.4)  # the ejection's time is up
    sent = 0
    while not (len(failing.seen) > 3 and (await states(server))["bad"] == "ready"):
        await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        sent += 1
        assert sent < 200
    await tick(server)
    text = await scrape(server)
    key = (("model", "m"), ("replica", "bad"))
    assert samples(text, "router_replica_ejections_total")[key] == 1.0
    assert samples(text, "router_replica_recoveries_total")[key] == 1.0


async def test_a_500_caused_by_the_request_never_ejects(start_fake: StartFake, start_router: StartRouter) -> None:
    engine = await start_fake("m", behaviour=Behaviour(fail_status=500, fail_body=b'{"message": "unknown role"}'))
    other = await start_fake("m")
    server = await start_router([replica_entry("a", engine), replica_entry("b", other)], ejection_failures=2)
    for _ in range(12):
        await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
    assert await states(server) == {"a": "ready", "b": "ready"}


async def test_active_health_checks_eject_a_dead_replica_and_readmit_it_early(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    sick = await start_fake("m")
    fine = await start_fake("m")
    server = await start_router(
        [replica_entry("sick", sick), replica_entry("fine", fine)],
        health_check_interval_seconds=0.05,
        ejection_base_seconds=60,
    )
    sick.behaviour.fail_status = 503
    await wait_for(lambda: server.pool.get("sick") is not None and server.pool.get("sick").state.value == "ejected")  # type: ignore[union-attr]
    # Ejected by the checks alone, before any client met it: no client request reaches it now.
    assert sick.health_checks > 0 and sick.seen == []
    for _ in range(6):
        status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT))
        assert status == 200
    assert sick.seen == [] and len(fine.seen) == 6
    sick.behaviour.fail_status = None
    await wait_for(lambda: server.pool.get("sick").state.value == "ready")  # type: ignore[union-attr]


async def test_mutating_admin_calls_need_the_token_reads_do_not(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], admin_token="t0ken")
    for token in (None, "wrong"):
        status, answer = await admin(server, "POST", "/api/v1/replicas/r0/state", {"state": "draining"}, token)
        assert status == 401
        assert answer["error"]["code"] == "invalid_admin_token"
        status, _ = await admin(server, "PUT", "/api/v1/endpoints", {"replicas": []}, token)
        assert status == 401
    assert (await states(server))["r0"] == "ready"
    status, _ = await admin(server, "POST", "/api/v1/replicas/r0/state", {"state": "draining"}, "t0ken")
    assert status == 200
    assert (await get_json(server.admin_url + "/api/v1/usage"))["router"] == "test"
    code, _ = await asyncio.to_thread(run_ctl, "undrain", "r0", "--server", server.admin_url)
    assert code == 1
    code, _ = await asyncio.to_thread(run_ctl, "undrain", "r0", "--server", server.admin_url, "--token", "t0ken")
    assert code == 0


async def test_admin_bodies_are_bounded(start_router: StartRouter) -> None:
    server = await start_router()
    status, answer = await admin(server, "PUT", "/api/v1/endpoints", b"{" + b" " * (9 * 1024 * 1024) + b"}")
    assert status == 413
    assert answer["error"]["code"] == "request_too_large"


async def test_status_summarizes_models_gpus_and_demand(start_fake: StartFake, start_router: StartRouter) -> None:
    a = await start_fake("a")
    b = await start_fake("b")
    server = await start_router(
        [
            replica_entry("a0", a, gpu_class="h100", gpus=2),
            replica_entry("a1", a, gpu_class="h100", gpus=2),
            replica_entry("b0", b, gpu_class="l4", gpus=1),
        ],
        tick_seconds=0.05,
    )
    server.pool.set_draining("a1", True)
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "a"}))
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "b"}))
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "wanted"}))
    # Real time: idle_for is measured against the router's wall clock.
    await asyncio.sleep(0.3)
    status = await get_json(server.admin_url + "/api/v1/status?idle_for=0.2")
    models = {m["model"]: m for m in status["models"]}
    assert models["a"] | {"requests_per_second": 0} == {
        "model": "a",
        "ready": 1,
        "total": 2,
        "ejected": 0,
        "draining": 1,
        "in_flight": 0,
        "requests_per_second": 0,
        "queued": 0,
        # a1 was never used, but watched longer than the window: idle, like a0.
        "asked": "no",
        "asleep": 0,
    }
    assert models["a"]["requests_per_second"] > 0
    assert models["b"]["asked"] == "no"
    gpus = {g["gpu_class"]: g for g in status["gpus"]}
    assert (gpus["h100"]["idle"], gpus["h100"]["unknown"], gpus["h100"]["total"]) == (4, 0, 4)
    assert {u["id"] for u in status["unasked"]} == {"a0", "a1", "b0"}
    assert status["unserved"] == {"wanted": 1}
    busy = await get_json(server.admin_url + "/api/v1/status?idle_for=60")
    assert {m["model"]: m["asked"] for m in busy["models"]} == {"a": "yes", "b": "yes"}
    assert busy["unasked"] == []
    # Over a minute's window, a1 (never used, watched for less) cannot be called idle.
    gpus = {g["gpu_class"]: g for g in busy["gpus"]}
    assert (gpus["h100"]["busy"], gpus["h100"]["idle"], gpus["h100"]["unknown"]) == (2, 0, 2)
    assert gpus["h100"]["bar"] == "[" + "#" * 10 + "?" * 10 + "]"
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/api/v1/status?idle_for=x") as r:
        assert r.status == 400
    code, out = await asyncio.to_thread(run_ctl, "status", "--server", server.admin_url, "--idle-for", "60s")
    assert code == 0
    assert "MODEL" in out and "GPU-CLASS" in out and "wanted" in out


async def test_status_says_how_many_requests_wait_for_a_slot_per_model(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(token_delay=0.1))
    server = await start_router([replica_entry("r0", fake)], max_in_flight_per_replica=1, queue_timeout_seconds=30)
    url = server.client_url + "/v1/chat/completions"
    body = orjson.dumps({**CHAT, "max_tokens": 10, "stream": True})
    first = asyncio.create_task(post(url, body))
    await wait_for(lambda: server.pool.queues.waiting("m") == 0 and fake.active == 1)
    second = asyncio.create_task(post(url, body))
    await wait_for(lambda: server.pool.queues.waiting("m") == 1)
    status = await get_json(server.admin_url + "/api/v1/status")
    assert [(m["model"], m["queued"], m["in_flight"]) for m in status["models"]] == [("m", 1, 1)]
    assert (await first)[0] == 200 and (await second)[0] == 200
    status = await get_json(server.admin_url + "/api/v1/status")
    assert [(m["model"], m["queued"]) for m in status["models"]] == [("m", 0)]


@pytest.mark.parametrize("path", ["/api/v1/status", "/api/v1/replicas/r0/state", "/api/v1/endpoints"])
async def test_admin_routes_do_not_answer_on_the_client_port(start_router: StartRouter, path: str) -> None:
    server = await start_router()
    async with aiohttp.ClientSession() as session:
        for method in ("GET", "POST", "PUT"):
            async with session.request(method, server.client_url + path, json={"state": "draining"}) as resp:
                assert resp.status == 404


async def test_no_client_key_or_admin_token_reaches_any_log_line(
    start_fake: StartFake, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    failing = await start_fake("m", behaviour=Behaviour(fail_status=502))
    server = await start_router(
        [replica_entry("a", failing)], api_keys=["sk-client-secret"], admin_token="admin-secret", ejection_failures=1
    )
    for key in ("sk-client-secret", "sk-wrong-guess"):
        await post(
            server.client_url + "/v1/chat/completions",
            orjson.dumps(CHAT),
            {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
    for token in ("admin-secret", "admin-wrong-guess"):
        await admin(server, "PUT", "/api/v1/endpoints", {"replicas": [replica_entry("b", failing)]}, token)
    assert "endpoint push" in caplog.text
    for secret in ("sk-client-secret", "sk-wrong-guess", "admin-secret", "admin-wrong-guess"):
        assert secret not in caplog.text


class _WatchedSource:
    """A replica-set source that owns the set, as discovery will: it starts one replica, then adds another."""

    name = "a test watch"
    exclusive = True

    def __init__(self, first: dict[str, Any], second: dict[str, Any]) -> None:
        self.first = ReplicaConfig(first["id"], first["model"], first["url"])
        self.second = ReplicaConfig(second["id"], second["model"], second["url"])
        self.go = asyncio.Event()

    def initial(self) -> tuple[ReplicaConfig, ...]:
        return (self.first,)

    def ready(self) -> bool:
        return True

    def register(self, registry: Any) -> None:
        return

    async def run(self, fleet: Fleet) -> None:
        await self.go.wait()
        await fleet.set_replicas((self.first, self.second))

    async def reload(self, fleet: Fleet) -> bool:
        return True


async def test_a_source_that_owns_the_set_drives_the_pool_and_pushes_get_409(start_fake: StartFake) -> None:
    from prometheus_client import CollectorRegistry

    from router.core.config.settings import parse_config

    fake = await start_fake("m")
    source = _WatchedSource(replica_entry("a", fake), replica_entry("b", fake))
    config = parse_config({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"}, "<test>", environ={})
    server = RouterServer(config, registry=CollectorRegistry(), sources=[source])
    await server.start()
    try:
        assert sorted(await states(server)) == ["a"]
        source.go.set()
        await wait_for(lambda: server.pool.get("b") is not None)
        status, body = await admin(server, "PUT", "/api/v1/endpoints", {"replicas": []})
        assert status == 409
        assert body["error"]["code"] == "replica_set_owned" and "a test watch" in body["error"]["message"]
        assert sorted(await states(server)) == ["a", "b"]
        # Drains still work.
        status, _ = await admin(server, "POST", "/api/v1/replicas/a/state", {"state": "draining"})
        assert status == 200
    finally:
        await server.stop()


async def test_every_view_says_the_same_about_idle_at_several_ages(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """status, idle, replicas and /metrics: one rule (the proven quiet bound) on one fleet."""
    fakes = [await start_fake(f"m{i}") for i in range(3)]
    server = await start_router(
        [replica_entry(f"r{i}", fake, model=f"m{i}", gpus=1) for i, fake in enumerate(fakes)], tick_seconds=0.05
    )
    # r1 used now, r0 a moment before the views are read, r2 never: watched only.
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "m1"}))
    # Real time: the ages the views compare are the router's wall clock's.
    await asyncio.sleep(1.2)
    await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "m0"}))
    await asyncio.sleep(0.1)  # r0's age, on the same clock
    # Ages now: r0 ~0.1 s, r1 ~1.3 s, r2 watched ~1.3 s and never used.
    for window, idle, unknown in ((0.5, {"r1", "r2"}, 0), (3.0, set(), 1)):
        status = await get_json(server.admin_url + f"/api/v1/status?idle_for={window}")
        rows = await get_json(server.admin_url + "/api/v1/replicas")
        quiet = samples(await scrape(server), "router_replica_quiet_seconds")
        code, out = await asyncio.to_thread(
            run_ctl, "idle", "--server", server.admin_url, "--idle-for", f"{window}s", "--json"
        )
        assert code == 0
        merged = orjson.loads(out)
        # Snapshots are a tick old at most: what ctl idle proves holds as of the oldest one.
        assert 0 <= time.time() - merged["as_of"] < 5
        code, out = await asyncio.to_thread(
            run_ctl, "status", "--server", server.admin_url, "--idle-for", f"{window}s", "--json"
        )
        assert code == 0
        ctl_status = orjson.loads(out)
        assert {u["id"] for u in status["unasked"]} == idle, window
        assert {u["id"] for u in ctl_status["unasked"]} == idle, window
        assert {c["id"] for c in merged["candidates"]} == idle, window
        assert {r["id"] for r in rows if r["quiet_for_seconds"] >= window} == idle, window
        assert {dict(labels)["replica"] for labels, value in quiet.items() if value >= window} == idle, window
        # Not idle and not busy: r2 at 3 s, watched for less than the window.
        assert status["gpus"][0]["unknown"] == unknown, window
        assert merged["unknown"] == []
    # A replica never used shows no last use anywhere, and its proven quiet time.
    never = next(r for r in rows if r["id"] == "r2")
    assert never["last_used"] is None and never["idle_seconds"] < 0 and never["quiet_for_seconds"] > 1.0
    code, out = await asyncio.to_thread(run_ctl, "replicas", "--server", server.admin_url)
    r2_line = next(line for line in out.splitlines() if line.startswith("r2"))
    assert r2_line.split()[5] == "-" and r2_line.split()[6] != "-"


async def test_a_discovered_replica_s_id_with_its_namespace_is_drained_by_ctl(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    # Discovery names a replica NAMESPACE/POD: ctl quotes the slash, or the admin API's route
    # (one path segment per id) answered 404 to every drain, sleep and wake of such a replica.
    fake = await start_fake("m")
    server = await start_router([replica_entry("llm/pod-a", fake)])
    code, out = await asyncio.to_thread(run_ctl, "drain", "llm/pod-a", "--server", server.admin_url)
    assert code == 0, out
    assert (await states(server))["llm/pod-a"] in {"draining", "drained"}
    assert (await asyncio.to_thread(run_ctl, "undrain", "llm/pod-a", "--server", server.admin_url))[0] == 0
    assert (await states(server))["llm/pod-a"] == "ready"
