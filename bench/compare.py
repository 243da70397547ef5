"""router against the floor proxy and the peers, side by side, in one run.

    .venv/bin/python bench/compare.py                 (after bench/peers, for the peers)

Starts one fast fake replica (several processes on one port, so that it is
never the bottleneck) serving three models: `fast` (tokens back to back),
`slow` (tokens 20-50 ms apart, like an engine) and `sleepy` (a token every
few seconds). Then, in rounds, each workload is run against each path in
turn, interleaved, so that a busy spell of this shared machine hits every
path alike:

- short: non-streaming chat, 64 connections (wrk);
- stream: 64-token SSE streams, 32 connections (wrk);
- latency: short requests on one connection (wrk);
- slow: hundreds of concurrent paced streams (router bench: time to first
  byte, chunks).

Paths: straight to the replica; bench/floor.py (a bare aiohttp proxy);
router with one worker, with `--workers auto`, and with 4,000 replicas
configured; and each peer that bench/peers installed (nginx, vllm-router,
sglang-router, LiteLLM). Per path and workload: requests/s, chunks/s,
p50/p99 latency, time to first byte, the proxy's CPU ms per request (its
whole process tree, from /proc) and its peak RSS.

`--hold N` then holds N concurrent streams that send a token every few
seconds through router --workers auto and reports its RSS and errors.

The peers run inside a network namespace with only a loopback device (when
this runs as root with `unshare`), so that nothing can reach out. Results:
bench/results/compare.{md,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".cache" / "peers"
RESULTS = Path(__file__).resolve().parent / "results"
KEY = "sk-bench"  # LiteLLM refuses to start without a master key; the others ignore it
WORKLOADS = ("short", "stream", "latency", "slow")
RUST = ("vllm-router", "sglang-router")


def free_port() -> int:
    """A port free a moment ago, for a program that must be told its port (a peer, the floor, nginx).

    Bound, closed and named, it may be taken before the program binds it: what
    can bind port 0 and say where it listens (`router serve`, a one-process
    `router fake`) does, through `serve` and `fake`.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `router serve`'s line once both its ports listen, at info whatever --log-level says (router/run/app.py).
LISTENING = re.compile(r"router listening on (http://\S+) \(clients[^)]*\) and (http://\S+) \(admin\)")
# `router fake`'s first line, once it listens.
FAKE_LISTENING = re.compile(r"^fake replica of .* at (http://\S+)")


def said(process: subprocess.Popen[bytes], pattern: re.Pattern[str], log: Path | None = None) -> re.Match[str]:
    """The first line of the process's output that matches `pattern`; the rest goes on to `log` (or nowhere),
    drained by a thread so that a full pipe never stops the process."""
    assert process.stdout is not None
    out = log.open("ab") if log is not None else None
    for line in process.stdout:
        if out is not None:
            out.write(line)
        match = pattern.search(line.decode(errors="replace"))
        if match is not None:
            break
    else:
        if out is not None:
            out.close()
        raise RuntimeError(f"exited with {process.wait()} before saying where it listens")
    stream = process.stdout

    def drain() -> None:
        for rest in stream:
            if out is not None:
                out.write(rest)
        if out is not None:
            out.close()

    threading.Thread(target=drain, daemon=True).start()
    return match


def serve(
    config: Path, *extra: str, log: Path | None = None, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str, str]:
    """`router serve` on its config's ports (port 0: any), ready: its process, client URL and admin URL, as it says."""
    process = subprocess.Popen(
        [sys.executable, "-m", "router", "serve", "--config", str(config), "--log-level", "warning", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
    )
    match = said(process, LISTENING, log)
    wait_http(match.group(2) + "/readyz", process=process)
    return process, match.group(1), match.group(2)


def fake(*args: str, log: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """One `router fake` process on port 0 with `args`, listening: it and its URL, as it says it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "router.tools.fake", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return process, said(process, FAKE_LISTENING, log).group(1)


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(parents.get(current, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def rss_mb(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


class PeakRss:
    """Samples the RSS of a process tree while a workload runs."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.pid is not None and not self._stop.wait(0.2):
            self.peak = max(self.peak, rss_mb(tree(self.pid)))

    def __enter__(self) -> PeakRss:
        if self.pid is not None:
            self.peak = rss_mb(tree(self.pid))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_http(url: str, timeout: float = 60.0, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    while True:
        try:
            with urllib.request.urlopen(request, timeout=2):
                return
        except OSError:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{url}: the process exited with {process.returncode}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# Paths -----------------------------------------------------------------------------


@dataclass
class Path_:
    """One way from the load generator to the fake replica."""

    name: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    # What a human should know about how it was run.
    note: str = ""
    cwd: Path | None = None
    # A `router serve` on port 0: its address is what it says once it listens.
    says: bool = False

    def start(self, log: Path) -> None:
        if not self.command:
            return
        if self.says:
            self.process = subprocess.Popen(
                self.command,
                env={**os.environ, **self.env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
            )
            self.url = said(self.process, LISTENING, log).group(1)
            self.port = int(self.url.rsplit(":", 1)[1])
        else:
            with log.open("ab") as out:
                self.process = subprocess.Popen(
                    self.command, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd
                )
        wait_http(self.url + "/v1/models", process=self.process)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in tree(self.process.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            self.process.wait()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


def router_config(tmp: Path, name: str, fake: str, replicas: int, *, told: bool = False) -> Path:
    """The benchmark's router config: on port 0, or `told` its ports (a router of an older commit,
    which says where it listens only at info, and is run at warning)."""
    port, admin = (free_port(), free_port()) if told else (0, 0)
    lines = [f'listen = "127.0.0.1:{port}"', f'admin_listen = "127.0.0.1:{admin}"', "tick_seconds = 1"]
    for model, count in (("fast", replicas), ("slow", 4), ("sleepy", 4)):
        # Every entry points at the same fake: the router still spreads over them.
        for i in range(count):
            lines += ["[[replicas]]", f'id = "{model}-{i}"', f'model = "{model}"', f'url = "{fake}"']
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def checkout(ref: str, into: Path) -> Path:
    """The tree of `ref` (a commit of this repository) as plain files, for the baseline path."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "router"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def compiled_tree() -> Path | None:
    """The working tree built compiled by scripts/compiled, or None (said why) where it cannot be."""
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compiled"), "build"], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        print(f"the compiled build is left out: {built.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return ROOT / ".cache" / "compiled"


def make_paths(tmp: Path, fake: str, wanted: Sequence[str], baselines: Sequence[str] = ()) -> list[Path_]:
    py = sys.executable
    paths: list[Path_] = []

    def add(name: str, command: list[str], port: int, **kw: Any) -> None:
        if name in wanted:
            paths.append(Path_(name, command, port=port, url=f"http://127.0.0.1:{port}", **kw))

    if "direct" in wanted:
        paths.append(Path_("direct", url=fake, note="straight to the fake replica"))
    port = free_port()
    add("floor", [py, str(ROOT / "bench" / "floor.py"), "--port", str(port), "--upstream", fake], port)
    for name, replicas, extra in (
        ("router", 4, []),
        ("router-workers", 4, ["--workers", "auto"]),
        ("router-4000", 4000, []),
    ):
        if name in wanted:
            config = router_config(tmp, name, fake, replicas)
            command = [py, "-m", "router", "serve", "--config", str(config), "--log-level", "warning", *extra]
            note = f"{replicas} replicas of the model" + (", --workers auto" if extra else "")
            paths.append(Path_(name, command, note=note, says=True))
    if "router-compiled" in wanted:
        # What `pip install` gives where a compiler is: the working tree with its
        # hot modules compiled (setup.py), in .cache/compiled, started from there.
        tree_ = compiled_tree()
        if tree_ is not None:
            config = router_config(tmp, "router-compiled", fake, 4)
            command = [py, "-m", "router", "serve", "--config", str(config), "--log-level", "warning"]
            note = "4 replicas, the compiled build"
            paths.append(Path_("router-compiled", command, note=note, cwd=tree_, says=True))
    for ref in baselines:
        # The same router at another commit, started from its own tree: `python -m`
        # puts the working directory first on sys.path, ahead of the editable install.
        name = f"router@{ref}"
        tree_ = checkout(ref, tmp / "baseline" / ref)
        config = router_config(tmp, name.replace("@", "-"), fake, 4, told=True)
        port = int(config.read_text().split('"127.0.0.1:', 1)[1].split('"', 1)[0])
        command = [py, "-m", "router", "serve", "--config", str(config), "--log-level", "warning"]
        paths.append(
            Path_(name, command, port=port, url=f"http://127.0.0.1:{port}", note=f"4 replicas, at {ref}", cwd=tree_)
        )
    if "nginx" in wanted and shutil.which("nginx"):
        port = free_port()
        conf = tmp / "nginx.conf"
        fake_host = fake.removeprefix("http://")
        conf.write_text(
            f"""worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 20000; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    upstream fake {{ server {fake_host}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
        )
        add("nginx", ["nginx", "-p", str(tmp), "-c", str(conf)], port, note="proxy_pass, keepalive 512, 1 worker")
    vllm = PEERS / "vllm-router" / "bin" / "vllm-router"
    if "vllm-router" in wanted and vllm.exists():
        port = free_port()
        add(
            "vllm-router",
            [
                *(str(vllm), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", fake),
                *("--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(free_port())),
            ],
            port,
            note="round_robin",
        )
    sglang = PEERS / "sglang-router" / "bin" / "python"
    if "sglang-router" in wanted and sglang.exists():
        port = free_port()
        add(
            "sglang-router",
            [
                *(str(sglang), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)),
                *("--worker-urls", fake, "--policy", "round_robin", "--log-level", "warn"),
                *("--prometheus-port", str(free_port()), "--tokenizer-path", str(tmp / "tokenizer.json")),
            ],
            port,
            note="round_robin",
        )
    litellm = PEERS / "litellm" / "bin" / "litellm"
    if "litellm" in wanted and litellm.exists():
        port = free_port()
        config = tmp / "litellm.yaml"
        models = "".join(
            f"  - model_name: {m}\n    litellm_params:\n      model: openai/{m}\n"
            f"      api_base: {fake}/v1\n      api_key: unused\n"
            for m in ("fast", "slow", "sleepy")
        )
        config.write_text(f"model_list:\n{models}general_settings:\n  master_key: {KEY}\n")
        add(
            "litellm",
            [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "2"],
            port,
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
            note="--num_workers 2",
        )
    return paths


# Load -------------------------------------------------------------------------------------


def wrk(url: str, *, connections: int, seconds: float, body: dict[str, Any], tmp: Path) -> dict[str, float]:
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {KEY}"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("JSON {\\"requests\\": %d, \\"bytes\\": %d, \\"seconds\\": %f, \\"p50_us\\": %d, '
        '\\"p99_us\\": %d, \\"errors\\": %d}\\n", summary.requests, summary.bytes, summary.duration / 1e6, '
        "latency:percentile(50), latency:percentile(99), summary.errors.status + summary.errors.connect + "
        "summary.errors.read + summary.errors.write + summary.errors.timeout))\nend\n"
    )
    command = ["wrk", "-t", "1", "-c", str(connections), "-d", f"{max(1, round(seconds))}s", "--timeout", "30s"]
    out = subprocess.run(
        [*command, "-s", str(script), "--latency", url + "/v1/chat/completions"],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    doc = json.loads(next(x for x in out.splitlines() if x.startswith("JSON "))[5:])
    return {
        "requests": doc["requests"],
        "seconds": doc["seconds"],
        "p50_ms": doc["p50_us"] / 1000,
        "p99_ms": doc["p99_us"] / 1000,
        "errors": doc["errors"],
    }


def paced_load(url: str, *, connections: int, seconds: float, tokens: int) -> dict[str, float]:
    command = [sys.executable, "-m", "router", "bench", "--url", url, "--model", "slow", "--stream", "--json"]
    command += ["-c", str(connections), "-n", "100000000", "-d", str(seconds), "--max-tokens", str(tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=seconds + 120)
    doc = json.loads(done.stdout.strip().splitlines()[-1])

    def figure(key: str) -> float:
        # router bench says null when nothing succeeded; the tables here take NaN as "no figure".
        value = doc[key]
        return float("nan") if value is None else float(value)

    return {
        "requests": doc["requests"],
        "seconds": doc["seconds"],
        "p50_ms": figure("latency_p50_ms"),
        "p99_ms": figure("latency_p99_ms"),
        "ttfb_p50_ms": figure("ttfb_p50_ms"),
        "ttfb_p99_ms": figure("ttfb_p99_ms"),
        "chunks": doc["chunks"],
        "errors": doc["errors"],
    }


def measure(path: Path_, workload: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    pids = tree(path.pid) if path.pid else []
    before = cpu_seconds(pids)
    with PeakRss(path.pid) as peak:
        if workload == "short":
            body = {"model": "fast", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
            figures = wrk(path.url, connections=64, seconds=args.seconds, body=body, tmp=tmp)
        elif workload == "stream":
            body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}
            figures = wrk(path.url, connections=32, seconds=args.seconds, body=body, tmp=tmp)
            # Every stream is 64 token events plus role, finish and [DONE].
            figures["chunks"] = figures["requests"] * 67
        elif workload == "latency":
            body = {"model": "fast", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
            figures = wrk(path.url, connections=1, seconds=args.seconds, body=body, tmp=tmp)
        else:
            figures = paced_load(path.url, connections=args.slow_streams, seconds=args.seconds * 2, tokens=32)
    if pids:
        # Children that appeared meanwhile (workers, restarts) count too.
        pids = sorted(set(pids) | set(tree(path.pid or 0)))
        figures["cpu_ms_per_request"] = (cpu_seconds(pids) - before) * 1000 / max(1, figures["requests"])
        figures["peak_rss_mb"] = peak.peak
    figures["rps"] = figures["requests"] / figures["seconds"]
    if "chunks" in figures:
        figures["chunks_per_second"] = figures["chunks"] / figures["seconds"]
    return figures


# HeldRequests many streams ------------------------------------------------------------------------


async def hold_streams(url: str, count: int, tokens: int, ramp_seconds: float) -> dict[str, float]:
    """`count` concurrent streams of the sleepy model, each on its own connection."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "sleepy", "stream": True, "max_tokens": tokens, "messages": []}).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    opened = 0
    done = 0
    open_now = 0
    peak_open = 0
    errors: list[str] = []

    async def one(delay: float) -> None:
        nonlocal opened, done, open_now, peak_open
        await asyncio.sleep(delay)
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            errors.append(f"connect: {exc}")
            return
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(head.split(b"\r\n", 1)[0].decode())
                return
            opened += 1
            open_now += 1
            peak_open = max(peak_open, open_now)
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                piece = await reader.read(65536)
                if not piece:
                    errors.append("closed before the end")
                    return
                data = data[-16:] + piece
            done += 1
            open_now -= 1
        except (OSError, asyncio.IncompleteReadError) as exc:
            errors.append(repr(exc))
        finally:
            writer.close()

    began = time.perf_counter()
    await asyncio.gather(*(one(ramp_seconds * i / count) for i in range(count)))
    return {
        "streams": count,
        "completed": done,
        "opened": opened,
        "peak_open": peak_open,
        "errors": len(errors),
        "first_errors": errors[:3],  # type: ignore[dict-item]
        "seconds": time.perf_counter() - began,
    }


def hold(path: Path_, count: int) -> dict[str, Any]:
    assert path.pid is not None
    with PeakRss(path.pid) as peak:
        ramp = min(20.0, count / 500)
        # Long enough that every stream is still open when the last one opens, then 10 s more.
        tokens = int((ramp + 10) / 3) + 1
        result = asyncio.run(hold_streams(path.url, count, tokens=tokens, ramp_seconds=ramp))
    return {**result, "peak_rss_mb": peak.peak, "path": path.name}


# Report --------------------------------------------------------------------------------------------


def median(rows: list[dict[str, float]], key: str) -> float:
    values = sorted(r[key] for r in rows if key in r)
    return values[len(values) // 2] if values else float("nan")


def summarize(results: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    keys = ("rps", "chunks_per_second", "p50_ms", "p99_ms", "ttfb_p50_ms", "cpu_ms_per_request", "peak_rss_mb")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for workload, by_path in results.items():
        summary[workload] = {}
        for name, rows in by_path.items():
            figures = {key: median(rows, key) for key in keys if any(key in r for r in rows)}
            figures["errors"] = sum(r["errors"] for r in rows)
            summary[workload][name] = figures
    return summary


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def budget(summary: dict[str, dict[str, dict[str, float]]], held: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """The issue's budget, line by line: (what, measured, verdict)."""
    lines: list[tuple[str, str, str]] = []

    def fig(workload: str, path: str, key: str) -> float | None:
        return summary.get(workload, {}).get(path, {}).get(key)

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("met" if ok else "SHORT")

    best_rust = {}
    for workload in ("short", "stream"):
        rust = [(fig(workload, r, "rps") or 0.0, r) for r in RUST if fig(workload, r, "rps")]
        best_rust[workload] = max(rust) if rust else None
    for router in ("router", "router-workers"):
        best = best_rust["stream"]
        rps = fig("stream", router, "rps")
        if best and rps:
            lines.append(
                (f"{router}: streams req/s >= 1.2x {best[1]}", ratio(rps, best[0]), verdict(rps >= 1.2 * best[0]))
            )
    cpu = fig("stream", "router", "cpu_ms_per_request")
    if cpu is not None:
        lines.append(("router: CPU per 64-chunk stream <= 0.75 ms", f"{cpu:.3f} ms", verdict(cpu <= 0.75)))
    rust_cpu = [c for r in RUST if (c := fig("short", r, "cpu_ms_per_request")) is not None]
    cpu = fig("short", "router", "cpu_ms_per_request")
    if cpu is not None and rust_cpu:
        lines.append(
            (
                "router: CPU per short request <= the better Rust router's",
                f"{cpu:.3f} vs {min(rust_cpu):.3f} ms",
                verdict(cpu <= min(rust_cpu)),
            )
        )
    # What pip install gives where a compiler is: CPU per short request at most 0.75x
    # vllm-router's (issue 29).
    compiled, vllm = (
        fig("short", "router-compiled", "cpu_ms_per_request"),
        fig("short", "vllm-router", "cpu_ms_per_request"),
    )
    if compiled is not None and vllm:
        lines.append(
            (
                "router-compiled: CPU per short request <= 0.75x vllm-router's",
                f"{compiled:.4f} vs {vllm:.4f} ms: {compiled / vllm:.2f}x",
                verdict(compiled <= 0.75 * vllm),
            )
        )
    rps, floor = fig("short", "router", "rps"), fig("short", "floor", "rps")
    if rps and floor:
        lines.append(("router: short req/s >= 1.0x the floor proxy", ratio(rps, floor), verdict(rps >= floor)))
    direct = fig("latency", "direct", "p50_ms")
    for router in ("router", "router-workers"):
        p50 = fig("latency", router, "p50_ms")
        if direct is not None and p50 is not None:
            added = (p50 - direct) * 1000
            lines.append((f"{router}: added p50 at 1 connection <= +300 us", f"+{added:.0f} us", verdict(added <= 300)))
    for workload in WORKLOADS:
        if workload == "latency":
            # At one connection the figure that matters is the latency added.
            ours, theirs, base = (fig(workload, p, "p50_ms") for p in ("router-workers", "litellm", "direct"))
            if ours is not None and theirs is not None and base is not None and ours > base:
                added, theirs_added = ours - base, theirs - base
                lines.append(
                    (
                        ">= 50x LiteLLM, latency (added p50, less is better)",
                        f"+{added * 1000:.0f} vs +{theirs_added * 1000:.0f} us: {theirs_added / added:.0f}x",
                        verdict(theirs_added >= 50 * added),
                    )
                )
            continue
        ours, theirs = fig(workload, "router-workers", "rps"), fig(workload, "litellm", "rps")
        if ours and theirs:
            lines.append((f">= 50x LiteLLM, {workload}", ratio(ours, theirs), verdict(ours >= 50 * theirs)))
        elif ours and theirs == 0:
            errors = summary[workload]["litellm"].get("errors", 0)
            lines.append((f">= 50x LiteLLM, {workload}", f"LiteLLM completed none ({errors:.0f} errors)", "met"))
    for path in sorted({p for w in summary.values() for p in w if p.startswith("router@")}):
        for workload in ("short", "stream"):
            now, before = fig(workload, "router", "cpu_ms_per_request"), fig(workload, path, "cpu_ms_per_request")
            if now and before:
                lines.append(
                    (
                        f"router: CPU per {workload} request against {path} (the issue's budget)",
                        f"{now:.4f} vs {before:.4f} ms: {now / before:.3f}x",
                        "-",
                    )
                )
    for workload in ("short", "stream"):
        few, many = fig(workload, "router", "rps"), fig(workload, "router-4000", "rps")
        if few and many:
            lines.append(
                (
                    f"router: {workload} req/s with 4,000 replicas within 5% of 4",
                    ratio(many, few),
                    verdict(many >= 0.95 * few),
                )
            )
    if held is not None:
        ok = (
            held["errors"] == 0
            and held["completed"] == held["streams"]
            and held["peak_open"] == held["streams"]
            and held["peak_rss_mb"] < 1024
        )
        lines.append(
            (
                f"{held['streams']:,} open streams, RSS < 1 GB, no errors ({held['path']})",
                f"{held['peak_rss_mb']:.0f} MB, {held['peak_open']:,} open at once, {held['errors']} errors, "
                f"{held['completed']:,} completed",
                verdict(ok),
            )
        )
    return lines


def report(
    summary: dict[str, dict[str, dict[str, float]]],
    paths: list[Path_],
    held: dict[str, Any] | None,
    args: argparse.Namespace,
    command: str,
) -> str:
    names = [p.name for p in paths]
    notes = {p.name: p.note for p in paths}
    out = [
        "# router against the floor proxy and the peers",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; command: `{command}`. Medians of {args.rounds} interleaved rounds; "
        "CPU is the proxy's whole process tree; one machine runs the load generator, the proxy and the fake "
        "replica, so compare ratios within this run.",
        "",
        "Paths: " + "; ".join(f"**{n}** ({notes[n]})" if notes[n] else f"**{n}**" for n in names) + ".",
        "",
    ]
    titles = {
        "short": "Short non-streaming chat, 64 connections (wrk)",
        "stream": "64-token SSE streams, 32 connections (wrk)",
        "latency": "One connection, short requests (wrk)",
        "slow": f"{args.slow_streams} concurrent streams, tokens 20-50 ms apart (router bench)",
    }
    for workload in WORKLOADS:
        rows = summary.get(workload)
        if not rows:
            continue
        floor = rows.get("floor", {}).get("rps")
        out += [f"## {titles[workload]}", ""]
        out += [
            "| path | req/s | vs floor | chunks/s | p50 ms | p99 ms | TTFB p50 ms | CPU ms/req | peak RSS MB "
            "| errors |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in names:
            f = rows.get(name)
            if f is None:
                continue
            out.append(
                f"| {name} | {fmt(f.get('rps'))} | {ratio(f.get('rps'), floor)} | {fmt(f.get('chunks_per_second'))} "
                f"| {fmt(f.get('p50_ms'), 2)} | {fmt(f.get('p99_ms'), 2)} | {fmt(f.get('ttfb_p50_ms'), 2)} "
                f"| {fmt(f.get('cpu_ms_per_request'), 3)} | {fmt(f.get('peak_rss_mb'))} | {fmt(f.get('errors'))} |"
            )
        ours = rows.get("router", {}).get("rps")
        peers = [n for n in names if n not in ("direct", "floor", "router", "router-workers", "router-4000")]
        if ours and peers:
            out += [
                "",
                "router (1 worker) / peer, req/s: "
                + ", ".join(f"{n} {ratio(ours, rows.get(n, {}).get('rps'))}" for n in peers),
            ]
        out.append("")
    if held is not None:
        out += [
            "## Open streams held",
            "",
            f"{held['streams']:,} streams of a token every 3 s through {held['path']}, opened over "
            f"{min(20.0, held['streams'] / 500):g} s: {held['peak_open']:,} open at once, "
            f"{held['completed']:,} completed, {held['errors']} errors "
            f"(first: {held['first_errors'] or 'none'}), peak RSS {held['peak_rss_mb']:.0f} MB, "
            f"{held['seconds']:.1f} s in all.",
            "",
        ]
    lines = budget(summary, held)
    if lines:
        out += ["## The budget", "", "| budget | measured | |", "| --- | --- | --- |"]
        out += [f"| {what} | {measured} | {verdict} |" for what, measured, verdict in lines]
        out.append("")
    return "\n".join(out)


def chart(summary: dict[str, dict[str, dict[str, float]]], names: list[str], target: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("short", "rps", "short requests/s"),
        ("stream", "rps", "64-token streams/s"),
        ("stream", "cpu_ms_per_request", "CPU ms per stream"),
        ("latency", "p50_ms", "p50 ms at 1 connection"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2))
    for ax, (workload, key, title) in zip(axes, panels, strict=True):
        rows = summary.get(workload, {})
        shown = [n for n in names if key in rows.get(n, {}) and not math.isnan(rows[n][key])]
        values = [rows[n][key] for n in shown]
        colors = ["#d62728" if n.startswith("router") else "#7f7f7f" for n in shown]
        ax.barh(shown, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(title)
        ax.set_xscale("log" if values and max(values) / max(min(values), 1e-9) > 50 else "linear")
    fig.suptitle("router (red) against the floor proxy and the peers: same run, same machine")
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    return True


# Main ---------------------------------------------------------------------------------------------


def in_namespace(argv: list[str]) -> int | None:
    """Run this script again inside a loopback-only network namespace, if we can."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return None
    inner = " ".join(["ip link set lo up && exec", sys.executable, *(json.dumps(a) for a in argv), "--inside"])
    return subprocess.call(["unshare", "--net", "sh", "-c", inner])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement (slow streams: twice this)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--paths",
        default="direct,floor,router,router-compiled,router-workers,router-4000,nginx,vllm-router,sglang-router,litellm",
        help="comma-separated; peers that bench/peers did not install are left out",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--slow-streams", type=int, default=300, help="concurrent paced streams")
    parser.add_argument("--hold", type=int, default=10000, help="open streams to hold at the end (0: skip)")
    parser.add_argument("--fake-processes", type=int, default=2)
    parser.add_argument("--no-netns", action="store_true", help="do not enter a loopback-only network namespace")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--baseline",
        metavar="REF",
        action="append",
        default=[],
        help="also run the router at this git commit (path router@REF; may be repeated), for before/after in one run",
    )
    args = parser.parse_args()
    if not args.inside and not args.no_netns:
        code = in_namespace([str(Path(__file__).resolve()), *sys.argv[1:]])
        if code is not None:
            return code
    if not shutil.which("wrk"):
        parser.error("wrk is not installed: run bench/peers debian (or apt-get install wrk)")
    command = "python bench/compare.py " + " ".join(a for a in sys.argv[1:] if a != "--inside")
    wanted = [p for p in args.paths.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))} (known: {', '.join(WORKLOADS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="router-compare-") as tmpdir:
        tmp = Path(tmpdir)
        # A one-word tokenizer, so that SGLang's router loads a local file instead of a hub's.
        (tmp / "tokenizer.json").write_text(
            json.dumps(
                {
                    "version": "1.0",
                    "truncation": None,
                    "padding": None,
                    "added_tokens": [],
                    "normalizer": None,
                    "pre_tokenizer": {"type": "Whitespace"},
                    "post_processor": None,
                    "decoder": None,
                    "model": {"type": "WordLevel", "vocab": {"hello": 0, "[UNK]": 1}, "unk_token": "[UNK]"},
                }
            )
        )
        fake_port = free_port()
        fake_url = f"http://127.0.0.1:{fake_port}"
        log = tmp / "processes.log"
        fake = subprocess.Popen(
            [
                *(
                    sys.executable,
                    "-m",
                    "router.tools.fake",
                    "--port",
                    str(fake_port),
                    "--model",
                    "fast",
                    "--tokens",
                    "64",
                ),
                *("--paced", "slow=0.02:0.05", "--paced", "sleepy=3:3", "--processes", str(args.fake_processes)),
                *("--tokenizer-path", str(tmp / "tokenizer.json")),
            ],
            stdout=subprocess.DEVNULL,
            # Peers' probes (an HTTP/2 preface among them) make it log 400s.
            stderr=log.open("ab"),
        )
        paths = make_paths(tmp, fake_url, wanted, args.baseline)
        results: dict[str, dict[str, list[dict[str, float]]]] = {w: {} for w in workloads}
        held: dict[str, Any] | None = None
        started: list[Path_] = []
        try:
            wait_http(fake_url + "/v1/models", process=fake)
            for path in paths:
                try:
                    path.start(log)
                    started.append(path)
                except (RuntimeError, OSError) as exc:
                    print(f"{path.name}: did not start ({exc}); left out. See the log below.", file=sys.stderr)
                    print(log.read_text()[-3000:], file=sys.stderr)
            for round_ in range(args.rounds):
                for workload in workloads:
                    for path in started:
                        figures = measure(path, workload, args, tmp)
                        results[workload].setdefault(path.name, []).append(figures)
                        print(
                            f"round {round_ + 1} {workload:8} {path.name:15} {figures['rps']:10.1f} req/s "
                            f"cpu {figures.get('cpu_ms_per_request', float('nan')):.3f} ms "
                            f"errors {figures['errors']:.0f}",
                            file=sys.stderr,
                            flush=True,
                        )
            if args.hold:
                target = next((p for p in started if p.name == "router-workers"), None)
                if target is not None:
                    held = hold(target, args.hold)
                    print(f"hold: {held}", file=sys.stderr)
        finally:
            for path in started:
                path.stop()
            fake.terminate()
            fake.wait(timeout=20)
        summary = summarize(results)
        text = report(summary, started, held, args, command)
        if chart(summary, [p.name for p in started], args.out / "compare.png"):
            text += "\n![router against the peers](compare.png)\n"
        (args.out / "compare.md").write_text(text)
        (args.out / "compare.json").write_text(json.dumps({"summary": summary, "held": held}, indent=1))
        print(text)
        print(f"written to {args.out}/compare.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
