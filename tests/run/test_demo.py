"""`router demo` as a newcomer meets it: what it prints works, pasted into a new shell."""

from __future__ import annotations

import asyncio
import io
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from router.core.config.settings import Config

ROOT = Path(__file__).resolve().parents[2]
# A new terminal: the system's PATH, no venv activated.
NEW_SHELL = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}


@dataclass
class Demo:
    client: str
    admin: str
    printed: str


@pytest.fixture
async def demo() -> AsyncIterator[Demo]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "demo",
        *("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"),
        "--token-delay",
        "0",
        "--log-level",
        "warning",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    printed: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not printed or printed[-1].strip() != "Ctrl-C stops it.":
            line = await asyncio.wait_for(process.stdout.readline(), timeout=max(0.1, deadline - time.monotonic()))
            assert line, "the demo ended early:\n" + "".join(printed)
            printed.append(line.decode())
        # Port 0 for both: the printout names the ports taken.
        text = "".join(printed)
        client, admin = (
            re.search(rf"^  {name} +(http://[^/\s]+)/", text, re.MULTILINE) for name in ("clients", "admin")
        )
        assert client is not None and admin is not None, text
        yield Demo(client.group(1), admin.group(1), text)
    finally:
        process.terminate()
        try:
            await asyncio.wait_for(process.communicate(), timeout=30)
        except TimeoutError:
            # Whatever happened to its SIGTERM, it does not outlive the test.
            process.kill()
            await process.communicate()


async def shell(command: str) -> tuple[int, str]:
    child = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command,
        cwd=ROOT,
        env=NEW_SHELL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=30)
    assert child.returncode is not None
    return child.returncode, out.decode()


def commands(printed: str, word: str) -> list[str]:
    """The printed commands that contain `word`, continuation lines joined as a shell would."""
    found = []
    lines = iter(printed.splitlines())
    for line in lines:
        command = line.strip()
        while command.endswith("\\"):
            command = command + "\n" + next(lines)
        if word in command and not command.startswith(("curl", "(")) and "Try," not in command:
            found.append(command.split("     #")[0])
    return found


async def test_the_printed_commands_work_in_a_new_shell(demo: Demo) -> None:
    ctl = commands(demo.printed, " ctl ")
    assert [c.split(" ctl ")[1].split()[0] for c in ctl] == ["replicas", "usage", "status", "idle", "drain"]
    for command in ctl[:4]:
        status, out = await shell(command)
        assert status == 0, f"{command}\n{out}"
    [snippet] = commands(demo.printed, "import openai")
    status, out = await shell(snippet)
    assert status == 0, f"{snippet}\n{out}"
    assert "ChatCompletion(" in out and "chatcmpl-llama-" in out


async def test_the_printout_names_every_alias_and_the_fallback_and_draining_shows_it(demo: Demo) -> None:
    assert "llama-3.1-8b (3 replicas; aliases: llama, default; falls back to qwen2.5-7b)" in demo.printed
    assert "qwen2.5-7b (2 replicas; alias: qwen)" in demo.printed
    [drain] = commands(demo.printed, " ctl drain ")
    status, out = await shell(drain)
    assert status == 0, out
    async with aiohttp.ClientSession() as session:
        for model in ("llama", "default", "llama-3.1-8b"):
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(demo.client + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200
                assert re.match(r"chatcmpl-qwen-\d", (await resp.json())["id"])


async def test_the_fake_replicas_take_every_body_the_router_lets_through(demo: Demo) -> None:
    limit = Config().max_body_bytes
    envelope = b'{"model": "llama", "messages": [{"role": "user", "content": "%s"}]}'
    largest = envelope % (b"a" * (limit - len(envelope % b"")))
    assert len(largest) == limit
    url, headers = demo.client + "/v1/chat/completions", {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=io.BytesIO(largest), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        async with session.post(url, data=io.BytesIO(largest + b" "), headers=headers) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"
