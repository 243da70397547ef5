"""`router serve --workers 2` as real processes: one admin view over two workers.

Streams are opened on separate connections, so that the kernel's
SO_REUSEPORT hash spreads them over both workers; with 16 of them the chance
that one worker gets all is 1 in 32,768, and each test checks that both did.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.run.workers import usable_cores, worker_count
from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import StartFake
from tests.support.clients import CHAT
from tests.support.processes import Serve
from tests.support.waiting import until, wait_for

STREAMS = 16

pytestmark = pytest.mark.slow


async def get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        if resp.content_type == "application/json":
            return await resp.json()
        return await resp.text()


async def metrics(session: aiohttp.ClientSession, serve: Serve) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    families: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    text = await get(session, serve.admin_url + "/metrics")
    for family in text_string_to_metric_families(text):
        assert family.name not in families, f"{family.name} appears twice"
        families[family.name] = {(("sample", s.name), *sorted(s.labels.items())): s.value for s in family.samples}
    return families


def per_worker(families: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> dict[str, float]:
    return {dict(key)["worker"]: value for key, value in families[name].items()}


class Streams:
    """Slow streams, each on its own connection, read until told to stop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sessions: list[aiohttp.ClientSession] = []
        self.responses: list[aiohttp.ClientResponse] = []

    async def open(self, count: int) -> None:
        for _ in range(count):
            session = aiohttp.ClientSession()
            self.sessions.append(session)
            resp = await session.post(self.url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True}))
            assert resp.status == 200
            await resp.content.readany()
            self.responses.append(resp)

    async def close(self) -> None:
        for resp in self.responses:
            resp.close()
        for session in self.sessions:
            await session.close()


async def replicas(session: aiohttp.ClientSession, serve: Serve) -> dict[str, dict[str, Any]]:
    rows = await get(session, serve.admin_url + "/api/v1/replicas")
    return {row["id"]: row for row in rows}


async def test_the_admin_view_is_one_router_over_both_workers(
    serve: Serve, start_fake: StartFake, receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, received, _ = receiver
    slow = await start_fake("m", behaviour=Behaviour(tokens=1000, token_delay=0.05))
    serve.write([{"id": "r0", "model": "m", "url": slow.url}], f'usage_push_url = "{url}"')
    await serve.start("--workers", "2")
    streams = Streams(serve.client_url)
    async with aiohttp.ClientSession() as session:
        try:
            await streams.open(STREAMS)
            rows = await replicas(session, serve)
            # In flight is summed over the workers...
            assert rows["r0"]["in_flight"] == STREAMS
            assert rows["r0"]["requests"] == STREAMS
            families = await metrics(session, serve)
            split = per_worker(families, "router_worker_in_flight_requests")
            # ...and both workers hold some of them.
            assert sorted(split) == ["0", "1"]
            assert all(value > 0 for value in split.values()), split
            assert sum(split.values()) == STREAMS
            assert families["router_workers"][(("sample", "router_workers"),)] == 2
        finally:
            await streams.close()
        await wait_for(lambda: slow.active == 0)
        # Short requests: the data-path histograms are summed into one series.
        for _ in range(10):
            async with (
                aiohttp.ClientSession() as one,
                one.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
            ):
                assert resp.status == 200
        families = await metrics(session, serve)
        first_bytes = families["router_time_to_first_byte_seconds"][
            (("sample", "router_time_to_first_byte_seconds_count"), ("model", "m"))
        ]
        assert first_bytes == STREAMS + 10
        # Streams the client left have no duration: only the 10 that ended.
        durations = families["router_request_duration_seconds"][
            (("sample", "router_request_duration_seconds_count"), ("model", "m"))
        ]
        assert durations == 10

        # The usage map moves once a tick (0.1 s here).
        async def used() -> bool:
            return "r0" in (await get(session, serve.admin_url + "/api/v1/usage"))["last_used"]

        await until(used)
        usage = await get(session, serve.admin_url + "/api/v1/usage")
        assert set(usage["last_used"]) == {"r0"}
        assert set(usage["watching_since"]) == {"r0"}
        families = await metrics(session, serve)
        assert len(families["router_replica_last_used_timestamp_seconds"]) == 1
    # The supervisor pushes the combined map, not one push per worker.
    await wait_for(lambda: any("r0" in doc.get("last_used", {}) for doc in received), timeout=5)
    assert len({doc["router"] for doc in received}) == 1


async def test_a_push_reaches_every_worker_before_it_is_answered(serve: Serve, start_fake: StartFake) -> None:
    kept = await start_fake("m", name="kept")
    removed = await start_fake("m", name="removed")
    both = [{"id": "kept", "model": "m", "url": kept.url}, {"id": "removed", "model": "m", "url": removed.url}]
    serve.write(both)
    await serve.start("--workers", "2")
    async with aiohttp.ClientSession() as session:
        body = {"replicas": [dict(both[0], labels={})]}
        async with session.put(serve.admin_url + "/api/v1/endpoints", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["removed"] == ["removed"]
        seen_before = len(removed.seen)
        # New connections, so that both workers take some of these.
        for _ in range(40):
            async with (
                aiohttp.ClientSession() as one,
                one.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
            ):
                assert resp.status == 200
        assert len(removed.seen) == seen_before
        assert len(kept.seen) == 40
        endpoints = await get(session, serve.admin_url + "/api/v1/endpoints")
        assert [r["id"] for r in endpoints["replicas"]] == ["kept"]
        # A body that is wrong is refused once, by the supervisor, naming the problem.
        async with session.put(serve.admin_url + "/api/v1/endpoints", json={"replicas": [{"id": 1}]}) as resp:
            assert resp.status == 400
            assert "replicas[0]" in (await resp.json())["error"]["message"]


async def test_drained_only_when_no_worker_has_the_replica_in_flight(serve: Serve, start_fake: StartFake) -> None:
    slow = await start_fake("m", behaviour=Behaviour(tokens=1000, token_delay=0.05))
    serve.write([{"id": "r0", "model": "m", "url": slow.url}])
    await serve.start("--workers", "2")
    streams = Streams(serve.client_url)
    async with aiohttp.ClientSession() as session:
        try:
            await streams.open(STREAMS)
            async with session.post(serve.admin_url + "/api/v1/replicas/r0/state", json={"state": "draining"}) as resp:
                assert resp.status == 200
                answer = await resp.json()
            assert answer == {"id": "r0", "state": "draining", "in_flight": STREAMS}
            split = per_worker(await metrics(session, serve), "router_worker_in_flight_requests")
            assert all(value > 0 for value in split.values()), split
            # No new request reaches it, from either worker.
            async with (
                aiohttp.ClientSession() as one,
                one.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
            ):
                assert resp.status == 503
            # Ending the streams one by one: draining while any worker has one.
            for resp in streams.responses[:-1]:
                resp.close()
            await wait_for(lambda: slow.active == 1)
            assert (await replicas(session, serve))["r0"]["state"] == "draining"
        finally:
            await streams.close()
        await wait_for(lambda: slow.active == 0)
        rows = await replicas(session, serve)
        assert (rows["r0"]["state"], rows["r0"]["in_flight"]) == ("drained", 0)


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


async def test_a_worker_that_dies_is_restarted_and_nothing_goes_backwards(serve: Serve, start_fake: StartFake) -> None:
    fake: FakeReplica = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start("--workers", "2")
    assert serve.process is not None
    pids = children(serve.process.pid)
    assert len(pids) == 2
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            async with (
                aiohttp.ClientSession() as one,
                one.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
            ):
                assert resp.status == 200
        before = (await replicas(session, serve))["r0"]
        assert before["requests"] == 20
        first_bytes = ("sample", "router_time_to_first_byte_seconds_count"), ("model", "m")
        counted = (await metrics(session, serve))["router_time_to_first_byte_seconds"][first_bytes]
        assert counted == 20
        os.kill(pids[0], signal.SIGKILL)

        # Scrapes while it dies and restarts answer, and their counters never go down.
        async def restarted() -> bool:
            families = await metrics(session, serve)
            assert families["router_time_to_first_byte_seconds"][first_bytes] == 20
            return sum(per_worker(families, "router_worker_restarts").values()) == 1 and (
                families["router_workers"][(("sample", "router_workers"),)] == 2
            )

        await until(restarted, timeout=10, what="the worker was not restarted")
        after = (await replicas(session, serve))["r0"]
        # The dead worker's totals stay; its stamps too; the watch restarts.
        assert after["requests"] == 20
        assert after["last_used"] >= before["last_used"]
        assert after["watching_since"] > before["watching_since"]
        async with session.get(serve.admin_url + "/readyz") as resp:
            assert resp.status == 200
    assert len(children(serve.process.pid)) == 2
    serve.signal(signal.SIGTERM)
    assert serve.process.wait(timeout=30) == 0
    assert "exited with status -9; restarting it" in serve.output()


async def test_sigterm_lets_every_worker_finish_its_streams(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=20, token_delay=0.05))
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], "shutdown_delay_seconds = 0")
    await serve.start("--workers", "2")

    async def one_stream() -> bytes:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                serve.client_url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True})
            ) as resp,
        ):
            return await resp.read()

    tasks = [asyncio.ensure_future(one_stream()) for _ in range(8)]
    await wait_for(lambda: fake.active == 8)
    serve.signal(signal.SIGTERM)
    bodies = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert serve.process is not None
    assert serve.process.wait(timeout=30) == 0


async def test_workers_refuse_a_port_that_something_else_listens_on(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        serve.ports = (port, 0)
        serve.write([{"id": "r0", "model": "m", "url": fake.url}])
        done = subprocess.run(
            [sys.executable, "-m", "router", "serve", "--config", str(serve.path), "--workers", "2"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        taken.close()
    assert done.returncode == 2
    assert f"listen: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_a_bad_worker_count_is_refused_by_name(tmp_path: Path, value: str) -> None:
    config = tmp_path / "router.toml"
    config.write_text('listen = "127.0.0.1:0"\n')
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(config), "--workers", value],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "--workers" in done.stderr
    assert "whole number >= 1 or 'auto'" in done.stderr


def test_auto_is_one_worker_per_usable_core(tmp_path: Path) -> None:
    # No quota: every core this process may run on.
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert worker_count("auto", tmp_path) == len(os.sched_getaffinity(0))
    # A quota of one CPU: one worker, however many cores the machine has.
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert worker_count("auto", tmp_path) == 1
    assert worker_count("3", tmp_path) == 3


async def test_sighup_reloads_every_worker_and_sigterm_pushes_the_last_map(
    serve: Serve, start_fake: StartFake, receiver: tuple[str, list[dict[str, Any]], dict[str, Any]]
) -> None:
    url, received, _ = receiver
    first = await start_fake("m", name="first")
    second = await start_fake("m", name="second")
    push = f'usage_push_url = "{url}"\nshutdown_delay_seconds = 0'
    serve.write([{"id": "first", "model": "m", "url": first.url}], push)
    await serve.start("--workers", "2")
    serve.write([{"id": "second", "model": "m", "url": second.url}], push)
    serve.signal(signal.SIGHUP)
    async with aiohttp.ClientSession() as session:

        async def reloaded() -> bool:
            endpoints = await get(session, serve.admin_url + "/api/v1/endpoints")
            return [r["id"] for r in endpoints["replicas"]] == ["second"]

        await until(reloaded, what="the reload was not applied")
    # Both workers route to the new set only (new connections reach both).
    for _ in range(20):
        async with (
            aiohttp.ClientSession() as one,
            one.post(serve.client_url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp,
        ):
            assert resp.status == 200
    assert (len(first.seen), len(second.seen)) == (0, 20)
    received.clear()
    serve.signal(signal.SIGTERM)
    process = serve.process
    assert process is not None
    # Waited for without blocking the loop: the receiver answers in this loop.
    await wait_for(lambda: process.poll() is not None, timeout=30)
    assert process.returncode == 0
    # The last push holds what both workers did, stamps of their final word included.
    assert received, "no final push"
    assert "second" in received[-1]["last_used"]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 2),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_auto_respects_a_cgroup_cpu_quota(tmp_path: Path, files: dict[str, str], expected: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cores = len(os.sched_getaffinity(0))
    # None: no quota, so every core of the affinity.
    assert usable_cores(tmp_path) == (cores if expected is None else min(cores, expected))


def test_worker_metrics_merge_by_their_declared_mode() -> None:
    from router.run.worker_metrics import Mode, Report, merge, retire

    def report(value: float, gauge: float) -> Report:
        return Report(
            {
                "families": [
                    {"name": "c", "help": "a counter", "type": "counter", "samples": [["c_total", {"m": "x"}, value]]},
                    {"name": "g", "help": "a gauge", "type": "gauge", "samples": [["g", {}, gauge]]},
                    {"name": "l", "help": "a gauge", "type": "gauge", "samples": [["l", {}, gauge]]},
                ]
            }
        )

    modes: dict[str, Mode] = {"c": "sum", "g": "max", "l": "latest"}
    first, second, dead = report(3, 7), report(4, 5), report(10, 99)
    retired: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    retire(retired, dead)
    merged = merge([first, second], retired, modes)
    # A counter sums over the live workers and the dead one's last count: it never goes down.
    assert merged[("c", "c_total", (("m", "x"),))] == 17
    # Gauges are the live workers' only: the highest, and the last report's.
    assert merged[("g", "g", ())] == 7
    assert merged[("l", "l", ())] == 5


async def test_held_requests_are_merged_over_the_workers_and_each_holds_its_share(serve: Serve) -> None:
    serve.write([], '[models."m"]\ncold_start_seconds = 30\nmax_held = 4\n')
    await serve.start("--workers", "2")
    body = orjson.dumps({**CHAT, "model": "m"})
    url = serve.client_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def one() -> int:
            # A connection of its own each, so that the kernel spreads them over the workers.
            async with aiohttp.ClientSession() as own, own.post(url, data=body) as resp:
                await resp.read()
                return resp.status

        tasks = [asyncio.create_task(one()) for _ in range(6)]

        async def held() -> int:
            doc = await get(session, serve.admin_url + "/api/v1/usage")
            return int(doc.get("demand", {}).get("m", {}).get("held", 0))

        # Each worker holds its share (max_held 4 over 2 workers: 2), and refuses
        # the rest at once; the merged view sums what they hold.
        now = 0

        async def all_placed() -> bool:
            nonlocal now
            now = await held()
            return now + sum(t.done() for t in tasks) >= 6

        await until(all_placed, timeout=10)
        refused = [t.result() for t in tasks if t.done()]
        assert 2 <= now <= 4
        assert refused == [503] * (6 - now)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_tenants_queue_bound_is_split_over_the_workers_and_their_queues_merge_by_tenant(
    serve: Serve, start_fake: StartFake
) -> None:
    """Each worker queues its own connections: its share of the limits and of the tenant's bound; /metrics sums them."""
    fake = await start_fake("m", behaviour=Behaviour(stall=True))
    serve.write(
        [{"id": "r0", "model": "m", "url": fake.url}],
        'max_in_flight_per_replica = 2\nmax_queued_per_tenant = 4\n[api_keys.a]\nkey = "sk-a"\npriority = "batch"\n',
    )
    await serve.start("--workers", "2")
    url = serve.client_url + "/v1/chat/completions"
    count = 24

    async def one() -> int:
        # A connection of its own each, so that the kernel spreads them over the workers
        # (that one worker gets at most 2 of the 24 has a chance of 1 in 28,000).
        async with (
            aiohttp.ClientSession() as own,
            own.post(url, json=CHAT, headers={"Authorization": "Bearer sk-a"}) as resp,
        ):
            await resp.read()
            return resp.status

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    label = (("sample", "router_queued_requests"), ("model", "m"), ("priority", "batch"), ("tenant", "a"))
    async with aiohttp.ClientSession() as session:
        queued = 0

        async def all_placed() -> bool:
            nonlocal queued
            queued = int((await metrics(session, serve)).get("router_queued_requests", {}).get(label, 0))
            return len(fake.seen) + queued + sum(t.done() for t in tasks) == count

        await until(all_placed, timeout=15)
    # Each worker: one request in flight (its share of 2), two queued (its share of 4), the rest refused.
    in_flight = len(fake.seen)
    assert in_flight == 2 and queued == 4
    assert sorted(t.result() for t in tasks if t.done()) == [429] * (count - 6)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_unserved_names_are_bounded_over_both_workers_and_each_shown_count_is_whole(
    serve: Serve, start_fake: StartFake
) -> None:
    """150 names nobody serves, each asked twice, spread over two workers: 100 series of exactly 2, the rest other."""
    fake = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}])
    await serve.start("--workers", "2")
    url = serve.client_url + "/v1/chat/completions"

    async def ask(name: str) -> int:
        # A connection of its own each, so that the kernel spreads them over the workers.
        async with aiohttp.ClientSession() as own, own.post(url, data=orjson.dumps({**CHAT, "model": name})) as resp:
            await resp.read()
            return resp.status

    names = [f"ghost-{i}" for i in range(150)]
    for batch in range(0, 300, 50):
        statuses = await asyncio.gather(*(ask(names[i % 150]) for i in range(batch, batch + 50)))
        assert statuses == [404] * 50
    async with aiohttp.ClientSession() as session:

        async def unserved_now() -> dict[str, float]:
            families = await metrics(session, serve)
            return {
                dict(key)["model"]: value
                for key, value in families.get("router_unserved_requests", {}).items()
                if dict(key)["sample"] == "router_unserved_requests_total"
            }

        # The metrics are the last tick's (0.1 s here): wait for the one that has every request.
        unserved: dict[str, float] = {}

        async def all_counted() -> bool:
            nonlocal unserved
            unserved = await unserved_now()
            return sum(unserved.values()) >= 300

        await until(all_counted, timeout=10)
        workers = per_worker(await metrics(session, serve), "router_worker_in_flight_requests")
    assert len(workers) == 2
    other = unserved.pop("__other__")
    assert len(unserved) == 100
    assert set(unserved.values()) == {2.0}
    assert other == 300 - 200
