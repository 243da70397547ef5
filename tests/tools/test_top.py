"""`router ctl top`: frames from the admin API's documents, and the real thing under tmux against a loaded router."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.run.app import RouterServer
from router.tools.fake import Behaviour
from router.tools.top import SORT_KEYS, Frame, Row, build_frame, render, sort_rows
from tests.conftest import RefusedUrl, StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, post
from tests.support.programs import program
from tests.support.waiting import until, wait_for

NOW = 1_800_000_000.0


def replica(rid: str, model: str = "m", **fields: Any) -> dict[str, Any]:
    row = {
        "id": rid,
        "model": model,
        "state": "ready",
        "in_flight": 0,
        "requests": 0,
        "errors": 0,
        "last_used": None,
        "quiet_for_seconds": None,
    }
    return row | fields


def status(models: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    doc = {
        "router": "router-a",
        "generated_at": NOW,
        "watching_since": NOW - 3600,
        "models": models or [],
        "held": [],
        "unserved": {},
    }
    return doc | fields


def model(name: str, **fields: Any) -> dict[str, Any]:
    return {"model": name, "ready": 1, "total": 1, "in_flight": 0, "queued": 0} | fields


def test_the_first_frame_has_no_rates_and_the_next_has_them_from_the_difference() -> None:
    """Unknown is '-', never 0.0: a rate needs two reads."""
    first = build_frame([replica("r0", requests=10, errors=1)], status([model("m")]), previous=None, elapsed=None)
    assert first.replicas[0].requests_per_second is None
    assert first.totals()["requests_per_second"] is None
    text = "\n".join(render(first))
    assert "req/s -  err/s -" in text
    before = {"r0": replica("r0", requests=10, errors=1)}
    later = build_frame([replica("r0", requests=30, errors=5)], status([model("m")]), previous=before, elapsed=2.0)
    (row,) = later.replicas
    assert (row.requests_per_second, row.errors_per_second) == (10.0, 2.0)
    assert later.models[0].requests_per_second == 10.0
    assert "req/s 10.0  err/s 2.0" in "\n".join(render(later))


def test_the_engines_columns_show_each_replicas_queue_kv_and_reading_age_only_where_read() -> None:
    load = {"waiting": 3.0, "running": 8.0, "kv_cache_usage": 0.42, "age_seconds": 0.3, "source": "metrics"}
    rows = [replica("r0", engine_load=load, saturated=True), replica("r1", engine_load=None)]
    text = "\n".join(render(build_frame(rows, status([model("m")]), previous=None, elapsed=None), width=120))
    header = next(line for line in text.splitlines() if line.startswith("ID"))
    assert header.split()[-3:] == ["QUEUE", "KV%", "READ"]
    r0 = next(line for line in text.splitlines() if line.startswith("r0"))
    assert r0.split()[-3:] == ["3", "42", "0.3s"] and "ready*" in r0
    r1 = next(line for line in text.splitlines() if line.startswith("r1"))
    assert r1.split()[-3:] == ["-", "-", "-"]
    assert "* saturated" in text
    # A fleet whose engines are not read keeps the columns it had.
    plain = "\n".join(render(build_frame([replica("r1")], status([model("m")]), previous=None, elapsed=None)))
    assert "KV%" not in plain


def test_a_counter_that_went_down_is_an_unknown_rate_not_a_negative_one() -> None:
    """A router restarted between reads: its counters start again, which says nothing of the rate."""
    before = {"r0": replica("r0", requests=500, errors=9)}
    frame = build_frame([replica("r0", requests=3, errors=0)], status([model("m")]), previous=before, elapsed=1.0)
    assert (frame.replicas[0].requests_per_second, frame.replicas[0].errors_per_second) == (None, None)


def test_unknown_quiet_time_and_last_use_show_a_dash_and_known_ones_a_duration() -> None:
    rows = [
        replica("never", quiet_for_seconds=None, last_used=None),
        replica("used", quiet_for_seconds=95.0, last_used=NOW - 95),
    ]
    lines = render(build_frame(rows, status([model("m", total=2)]), previous=None, elapsed=None))
    never = next(line for line in lines if line.startswith("never "))
    used = next(line for line in lines if line.startswith("used "))
    assert never.split()[-2:] == ["-", "-"]
    assert used.split()[-3:] == ["1m35s", "1m35s", "ago"]


def test_every_line_fits_80_columns_with_long_names_cut_visibly() -> None:
    long_model = "meta-llama/Llama-3.1-70B-Instruct-FP8-dynamic"
    rows = [
        replica(f"{long_model}-replica-{i}", long_model, requests=i, in_flight=i, quiet_for_seconds=7200.0 * i)
        for i in range(4)
    ]
    held = [{"model": "a-model-scaled-to-zero-for-the-night", "held": 3, "oldest_waited_seconds": 12.5}]
    frame = build_frame(rows, status([model(long_model, total=4)], held=held), previous=None, elapsed=None)
    for width in (80, 60):
        lines = render(frame, width=width)
        assert max(len(line) for line in lines) <= width
        assert any("~" in line for line in lines if line.startswith("meta-")), lines
    # Whatever is cut, the figures stay whole: the model's row first, then a row per replica.
    replica_lines = [line.split() for line in render(frame, width=80) if line.startswith("meta-llama")]
    assert [cells[2:4] for cells in replica_lines[1:]] == [["ready", str(i)] for i in range(4)]
    assert [cells[6] for cells in replica_lines[1:]] == ["0s", "2h00m", "4h00m", "6h00m"]


def test_sorting_puts_the_most_first_unknown_last_and_the_same_key_again_reverses() -> None:
    rows = (
        Row("a", "m", "ready", 1, 5.0, 0.0, 10.0, 1.0),
        Row("b", "m", "ready", 3, None, None, None, None),
        Row("c", "m", "ejected", 0, 9.0, 3.0, 400.0, 400.0),
    )
    assert [r.id for r in sort_rows(rows, "r")] == ["c", "a", "b"]
    assert [r.id for r in sort_rows(rows, "r", reverse=True)] == ["a", "c", "b"]
    assert [r.id for r in sort_rows(rows, "f")] == ["b", "a", "c"]
    assert [r.id for r in sort_rows(rows, "s")] == ["c", "a", "b"]
    assert [r.id for r in sort_rows(rows, "i", reverse=True)] == ["c", "b", "a"]
    frame = Frame("r", NOW, NOW - 60, rows, ())
    assert render(frame, sort="t")[-1].startswith("sort: quiet (most first)")
    assert set(SORT_KEYS) == set("imsfretl")


def test_models_held_with_no_replica_and_asked_for_in_vain_are_shown() -> None:
    held = [{"model": "cold", "replicas": 0, "held": 2, "oldest_waited_seconds": 4.2}]
    frame = build_frame([], status([], held=held, unserved={"ghost": 7}), previous=None, elapsed=None)
    lines = render(frame)
    cold = next(line for line in lines if line.startswith("cold "))
    # No replica, so no request reached one: 0 per second is known even in a first frame.
    assert cold.split() == ["cold", "0/0", "0", "0", "2", "4s", "0.0"]
    assert "asked for, no replica: ghost (7)" in lines
    assert "held 2" in lines[2]


async def ctl_top(*args: str, timeout: float = 30) -> tuple[int, str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "ctl", "top", *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(child.communicate(), timeout=timeout)
    assert child.returncode is not None
    return child.returncode, out.decode()


@contextlib.asynccontextmanager
async def load(server: RouterServer, model: str = "m", every: float = 0.02) -> AsyncIterator[None]:
    """Requests one after another until the block ends (bounded: at most 2,000)."""
    stop = asyncio.Event()

    async def run() -> None:
        for _ in range(2000):
            if stop.is_set():
                return
            await post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": model}))
            # Real time: a steady rate of requests, which top shows as a rate.
            await asyncio.sleep(every)

    task = asyncio.create_task(run())
    try:
        yield
    finally:
        stop.set()
        await task


async def test_once_prints_one_frame_with_rates_and_json_for_scripts(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    busy, quiet = await start_fake("m"), await start_fake("n")
    server = await start_router([replica_entry("busy", busy), replica_entry("quiet", quiet)], tick_seconds=0.1)
    async with load(server):
        code, text = await ctl_top("--once", "--server", server.admin_url, "--interval", "0.5")
        json_code, out = await ctl_top("--once", "--json", "--server", server.admin_url, "--interval", "0.5")
    assert code == 0 and json_code == 0
    assert "\x1b" not in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("busy ", "quiet "))}
    assert float(rows["busy"][4]) > 0 and float(rows["quiet"][4]) == 0
    doc = orjson.loads(out)
    by_id = {r["id"]: r for r in doc["replicas"]}
    assert by_id["busy"]["requests_per_second"] > 0 and by_id["quiet"]["requests_per_second"] == 0
    assert by_id["quiet"]["last_used_seconds_ago"] is None
    assert doc["totals"]["states"] == {"ready": 2}
    assert text.splitlines()[1] == "replicas 2: 2 ready"


async def test_without_a_terminal_it_prints_plain_frames_each_interval(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], tick_seconds=0.1)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "ctl",
        "top",
        "--server",
        server.admin_url,
        "--interval",
        "0.2",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    seen = b""
    try:
        async with asyncio.timeout(20):
            while seen.count(b"router test ") < 3:
                seen += await child.stdout.read(4096)
    finally:
        child.kill()
        await child.wait()
    frames = seen.decode().split("router test ")[1:3]
    assert all("r0 " in frame and "\x1b" not in frame for frame in frames)
    # The first frame cannot know a rate; the second can.
    assert "req/s -" in frames[0] and "req/s 0.0" in frames[1]


class Tmux:
    """A tmux server of its own (its own socket), one 80x24 window running a command."""

    def __init__(self) -> None:
        self.tmux = program("tmux")
        self.socket = f"router-top-{uuid.uuid4().hex[:8]}"

    async def run(self, *args: str) -> tuple[int, str]:
        # In a thread, not with the loop's subprocess: uvloop's child inherits a
        # pipe of its own (libuv's, at a high fd), which the tmux server that
        # `new-session` forks keeps open, and communicate() would wait for it.
        done = await asyncio.to_thread(
            subprocess.run,
            [self.tmux, "-L", self.socket, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TERM": "xterm"},
            timeout=10,
            check=False,
        )
        return done.returncode, done.stdout.decode()

    async def screen(self) -> str:
        code, out = await self.run("capture-pane", "-p", "-t", "top")
        assert code == 0, out
        return out

    async def until(self, pattern: str, timeout: float = 15.0) -> str:
        """The screen once `pattern` (a regex) is on it."""
        text = ""

        async def shown() -> bool:
            # Polled: a tmux screen changes without telling anyone.
            nonlocal text
            text = await self.screen()
            return re.search(pattern, text, re.MULTILINE) is not None

        try:
            await until(shown, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{pattern!r} never showed:\n{text}") from exc
        return text


@pytest.fixture
async def tmux() -> AsyncIterator[Tmux]:
    server = Tmux()
    yield server
    await server.run("kill-server")


@pytest.mark.timeout(90)
async def test_top_under_tmux_shows_the_fleet_live_sorts_on_keys_and_quits_on_q(
    tmux: Tmux, start_fake: StartFake, start_router: StartRouter, refused_url: RefusedUrl, tmp_path: Path
) -> None:
    """In a real terminal of 80 columns: load, an ejected replica and a held request show, keys sort, q quits."""
    busy = await start_fake("chat", behaviour=Behaviour(tokens=4, token_delay=0.01))
    idle = await start_fake("chat")
    server = await start_router(
        [
            replica_entry("chat-busy", busy),
            replica_entry("chat-idle", idle),
            {"id": "chat-dead", "model": "chat", "url": refused_url(), "labels": {}},
        ],
        models={"chat": {}, "cold": {"cold_start_seconds": 60}},
        ejection_failures=1,
        ejection_base_seconds=300,
        tick_seconds=0.1,
    )
    # Keep chat-idle out of the load, so that one replica is busy and one quiet.
    server.pool.set_draining("chat-idle", True)
    held = asyncio.create_task(
        post(server.client_url + "/v1/chat/completions", orjson.dumps({**CHAT, "model": "cold"}))
    )
    await wait_for(lambda: server.pool.cold_start.held("cold") == 1)
    # The shell writes top's exit status down: tmux's own record of it
    # (pane_dead_status) is sometimes missing once the pane is dead.
    status = tmp_path / "top.status"
    top = f"{sys.executable} -m router ctl top --server {server.admin_url}"
    command = f"{top}; echo $? > {status}"
    code, out = await tmux.run("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", command)
    assert code == 0, out
    async with load(server, "chat"):
        screen = await tmux.until(r"^chat-busy .* [1-9][0-9.]* ")
        assert re.search(r"^router test ", screen, re.MULTILINE)
        assert re.search(r"^chat-dead +chat +ejected ", screen, re.MULTILINE), screen
        assert re.search(r"^chat-idle +chat +drain", screen, re.MULTILINE), screen
        assert re.search(r"^cold +0/0 +0 +0 +1 ", screen, re.MULTILINE), screen
        assert "held 1" in screen
        assert re.search(r"^replicas 3: 1 ready, 1 ejected, 1 drain", screen, re.MULTILINE), screen
        assert max(len(line) for line in screen.splitlines()) <= 80
        await tmux.run("send-keys", "-t", "top", "r")
        screen = await tmux.until(r"^sort: req/s \(most first\)")
        rows = [line.split()[0] for line in screen.splitlines() if line.startswith("chat-")]
        assert rows[0] == "chat-busy", screen
        await tmux.run("send-keys", "-t", "top", "r")
        screen = await tmux.until(r"^sort: req/s \(reversed\)")
        rows = [line.split()[0] for line in screen.splitlines() if line.startswith("chat-")]
        assert rows[-1] == "chat-busy", screen
        await tmux.run("send-keys", "-t", "top", "i")
        await tmux.until(r"^sort: id \(A-Z\)")
    await tmux.run("send-keys", "-t", "top", "q")
    await wait_for(lambda: status.exists() and status.read_text().endswith("\n"), timeout=10)
    assert status.read_text() == "0\n"
    held.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await held
