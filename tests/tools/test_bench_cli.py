"""`router bench` as a user runs it: what went wrong is said, JSON is JSON, -d alone runs that long."""

from __future__ import annotations

import asyncio
import sys

import orjson

from router.tools.bench import DEFAULT_REQUESTS, DEFAULT_SECONDS, limits, run_load
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry


async def bench(*args: str) -> tuple[int, str]:
    # A child process, awaited without blocking the loop that serves the in-process router.
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "bench", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=40)
    assert child.returncode is not None
    return child.returncode, out.decode()


async def test_errors_are_counted_by_kind_with_status_code_and_message(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    status, out = await bench("--url", server.client_url, "--model", "nope", "-n", "5", "-c", "2")
    assert status == 1, out
    assert "0 requests in" in out and "5 errors" in out
    assert "latency p50 -, p90 -, p99 -" in out
    lines = out.splitlines()
    counted = lines[lines.index("errors:") + 1 :]
    assert len(counted) == 1, out
    count, kind = counted[0].split(None, 1)
    assert count == "5"
    assert kind.startswith("404 model_not_found: ") and "nope" in kind


async def test_a_refused_connection_is_an_error_kind_too(refused_url: RefusedUrl) -> None:
    status, out = await bench("--url", refused_url(), "-n", "3", "-c", "1")
    assert status == 1, out
    counted = out.splitlines()[out.splitlines().index("errors:") + 1 :]
    assert len(counted) == 1 and counted[0].split(None, 1)[0] == "3", out
    assert "Connect" in counted[0], out


async def test_json_has_null_not_nan_and_the_kinds(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    status, out = await bench("--url", server.client_url, "--model", "nope", "-n", "3", "--json")
    assert status == 1
    assert "NaN" not in out
    doc = orjson.loads(out)  # orjson refuses NaN and Infinity, as JSON does
    assert doc["requests"] == 0 and doc["errors"] == 3
    assert doc["latency_p50_ms"] is None and doc["latency_p99_ms"] is None
    [(kind, count)] = doc["errors_by_kind"].items()
    assert count == 3 and kind.startswith("404 model_not_found")
    status, out = await bench("--url", server.client_url, "--model", "m", "-n", "20", "--json")
    doc = orjson.loads(out)
    assert status == 0 and doc["requests"] == 20 and doc["errors_by_kind"] == {}
    assert isinstance(doc["latency_p50_ms"], float)


def test_duration_alone_has_no_count_limit_and_count_alone_no_time_limit() -> None:
    assert limits(None, 3.0) == (None, 3.0)
    assert limits(50, None) == (50, None)
    assert limits(50, 3.0) == (50, 3.0)
    assert limits(None, None) == (DEFAULT_REQUESTS, DEFAULT_SECONDS)


async def test_duration_alone_runs_for_that_long(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    result = await run_load(server.client_url, model="m", concurrency=2, requests=None, duration=0.5, stream=False)
    assert result.errors == 0 and result.requests > 0
    assert result.seconds >= 0.5
    status, out = await bench("--url", server.client_url, "--model", "m", "-d", "0.5", "-c", "2", "--json")
    doc = orjson.loads(out)
    assert status == 0 and doc["seconds"] >= 0.5 and doc["requests"] > 0


async def test_bad_limits_are_refused_by_name() -> None:
    status, out = await bench("-d", "0")
    assert status == 2 and "--duration must be a number of seconds above 0" in out
    status, out = await bench("-n", "0")
    assert status == 2 and "--requests must be at least 1" in out


async def test_the_clients_url_with_v1_as_the_demo_prints_it_works_as_well_as_without(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    for url in (server.client_url + "/v1", server.client_url + "/v1/", server.client_url):
        status, out = await bench("--url", url, "--model", "m", "-n", "4", "-c", "2", "--json")
        assert status == 0, out
        assert orjson.loads(out)["requests"] == 4
    assert {seen.path for seen in fake.seen} == {"/v1/chat/completions"}
