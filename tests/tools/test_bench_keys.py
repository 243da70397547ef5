"""`router bench` against a router with api_keys: a key, headers, and a mix of tenants and priority classes."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import orjson
import pytest

from router.tools.bench import parse_mix
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import access_log_lines
from tests.support.waiting import wait_for

KEYS = {
    "alpha": {"key": "sk-alpha-0001", "tenant": "alpha"},
    "beta": {"key": "sk-beta-0002", "tenant": "beta", "priority": "batch"},
}


async def bench(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    child = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "router", "bench", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=40)
    assert child.returncode is not None
    return child.returncode, out.decode()


async def test_a_key_from_the_command_line_or_the_environment_and_headers_reach_the_router(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake = await start_fake("m")
    log = tmp_path / "access.log"
    server = await start_router([replica_entry("r0", fake)], api_keys=KEYS, access_log=str(log))
    url = server.client_url
    status, out = await bench("--url", url, "--model", "m", "-n", "3", env={"OPENAI_API_KEY": ""})
    assert status == 1 and "401" in out
    status, out = await bench("--url", url, "--model", "m", "-n", "3", "--api-key", "sk-alpha-0001")
    assert status == 0, out
    status, out = await bench(
        *("--url", url, "--model", "m", "-n", "3", "--header", "X-Priority: batch"),
        env={"OPENAI_API_KEY": "sk-alpha-0001"},
    )
    assert status == 0, out
    # Each line is written once its answer is over, a moment after the client has it.
    await wait_for(lambda: len(access_log_lines(log)) == 9)
    lines = [line for line in access_log_lines(log) if line["status"] == 200]
    assert [line["tenant"] for line in lines] == ["alpha"] * 6
    assert sum(1 for seen in fake.seen if seen.headers.get("X-Priority") == "batch") == 3
    # The key is never printed.
    assert "sk-alpha" not in out


async def test_a_mix_of_tenants_and_priorities_is_drawn_by_weight_and_reported_apart(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake = await start_fake("m")
    log = tmp_path / "access.log"
    server = await start_router([replica_entry("r0", fake)], api_keys=KEYS, access_log=str(log))
    status, out = await bench(
        *("--url", server.client_url, "--model", "m", "-n", "200", "-c", "4", "--json"),
        *("--key", "sk-alpha-0001=3", "--key", "sk-beta-0002", "--priority", "interactive", "--priority", "batch=1"),
    )
    assert status == 0, out
    doc = orjson.loads(out)
    groups = doc["groups"]
    assert set(groups) == {
        "key ...0001, priority interactive",
        "key ...0001, priority batch",
        "key ...0002, priority interactive",
        "key ...0002, priority batch",
    }
    assert sum(group["requests"] for group in groups.values()) == 200
    alpha = sum(g["requests"] for name, g in groups.items() if "0001" in name)
    # Three to one, drawn: well inside 100 to 190 of 200.
    assert 100 < alpha < 190
    await wait_for(lambda: len(access_log_lines(log)) == 200)
    tenants = [line["tenant"] for line in access_log_lines(log)]
    assert tenants.count("alpha") == alpha and tenants.count("beta") == 200 - alpha


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--header", "no colon"), "--header 'no colon': give 'NAME: VALUE'"),
        (("--header", "Bad Name: x"), "give 'NAME: VALUE'"),
        (("--key", "sk-a=0"), "--key 'sk-a=0': give NAME or NAME=WEIGHT"),
        (("--priority", "batch=-1"), "--priority 'batch=-1'"),
    ],
)
async def test_a_malformed_header_key_or_priority_is_refused_by_name(args: tuple[str, str], message: str) -> None:
    status, out = await bench(*args)
    assert status == 2 and message in out, out


def test_a_base64_key_ending_in_equals_signs_is_a_key() -> None:
    mix = parse_mix(None, [], ["c2stYWxwaGE=", "c2stYmV0YQ==:x", "sk-b=2"], [])
    assert mix.keys == (("c2stYWxwaGE=", 1.0), ("c2stYmV0YQ==:x", 1.0), ("sk-b", 2.0))
