"""What the router costs by the size of its fleet: CPU time at 4 to 10,000 replicas, no traffic.

    .venv/bin/python bench/scale.py [--baseline REF] [--sizes 4,40,400,4000,10000] [--rounds 7]

The promise is that the router costs what its traffic costs, not what its
fleet's size costs. Each figure is CPU time of the router process alone
(never wall time: this machine is shared), with health checks off and no
client traffic, over replicas spread across 10 models:

- acquire: one acquire()+release() pair;
- tick: one usage tick over a quiet fleet (half of it stamped), push off and
  on (the push's send counted too; the receiver is another process), and one
  after every replica took a request since the last tick;
- scrape: one GET /metrics, and the size of its answer;
- put: one PUT /api/v1/endpoints with 1 replica of N changed;
- ctl: the router's CPU for one `router ctl idle` and one `router ctl status`;
- workers: the supervisor of `--workers 2` per usage tick;
- ring: one session-routed model of N replicas: its start-up, then one
  replica added, removed, ejected and readmitted (each on the event loop);
- quiet: a fleet of N replicas that do not answer (scaled to zero: every
  connection refused), every feature at its default: the router's CPU per
  second once its start-up reads are done (the model cards' among them).
- engines: a fleet of N busy vLLM replicas (a request to every model each
  second), their engines' load read at the default `engine_metrics_seconds`:
  the router's CPU per second. Each replica's /metrics is a page the size
  of a real vLLM engine's (its gauges, then 60 KB of histograms), served by
  one page server on loopback (each replica a path of its own).

Every figure runs in a fresh child process (`--child`), from the working tree
or, with `--baseline REF`, also from REF's tree, and is the median of
`--rounds` repetitions (CPU time still moves by 10-20% on a shared machine).
Routers run as `router serve` processes, measured from /proc/PID/task/*/schedstat
(nanoseconds, every thread); in-process figures use time.process_time().
A child that passes `--limit` seconds is reported as over it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = (4, 40, 400, 4000, 10000)
RING_SIZES = (4, 40, 400, 800, 4000, 10000)
TARGETS = ("acquire", "tick", "scrape", "put", "ctl", "workers", "ring", "quiet", "engines")
MODELS = 10

RECEIVER = """
import sys
from aiohttp import web

async def take(request):
    await request.read()
    return web.Response(status=204)

app = web.Application(client_max_size=1 << 30)
app.router.add_post("/usage", take)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replica(i: int, port_base: int = 20000) -> dict[str, Any]:
    return {
        "id": f"model-{i % MODELS}-replica-{i}",
        "model": f"model-{i % MODELS}",
        "url": f"http://10.{i // 62500}.{(i // 250) % 250}.{i % 250}:{port_base + i % 1000}",
        "labels": {"node": f"gpu-{i}", "gpu_class": "h100", "gpus": 1},
    }


def toml_config(path: Path, n: int, *, extra: str = "", routing: str = "") -> tuple[int, int]:
    """A config of `n` replicas over 10 models; returns (client port, admin port)."""
    port, admin = free_port(), free_port()
    lines = [f'listen = "127.0.0.1:{port}"', f'admin_listen = "127.0.0.1:{admin}"', extra]
    for i in range(n):
        r = replica(i)
        labels = ", ".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in r["labels"].items())
        lines += ["[[replicas]]", f'id = "{r["id"]}"', f'model = "{r["model"]}"', f'url = "{r["url"]}"']
        lines.append(f"labels = {{ {labels} }}")
    if routing:
        for m in range(min(n, MODELS)):
            lines += [f'[models."model-{m}"]', f'routing = "{routing}"']
    path.write_text("\n".join(lines) + "\n")
    return port, admin


def process_cpu(pid: int) -> float:
    """Seconds of CPU of every live thread of `pid`, in nanoseconds' resolution."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def get(url: str, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            get(url, timeout=2)
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the router exited with {process.returncode}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextmanager
def router_process(config: Path, admin: int, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "router", "serve", "--config", str(config), "--log-level", "warning", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{admin}/readyz", process)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_of(pid: int, action: Callable[[], object], rounds: int) -> list[float]:
    """The router's CPU seconds for each of `rounds` runs of `action` (run by this process).

    Less what the router spends in the same time doing nothing (its timers):
    the median of as many idle windows, measured alongside.
    """
    figures, idle = [], []
    for _ in range(rounds):
        before = process_cpu(pid)
        began = time.monotonic()
        action()
        # What the router still does for the call (a write finishing) lands within this.
        time.sleep(0.05)
        figures.append(process_cpu(pid) - before)
        window = time.monotonic() - began
        before = process_cpu(pid)
        time.sleep(window)
        idle.append(process_cpu(pid) - before)
    floor = statistics.median(idle)
    return [max(0.0, f - floor) for f in figures]


# The measures, each run in a child process ---------------------------------------


def measure_acquire(n: int, rounds: int) -> dict[str, float]:
    from router.core.config.settings import ReplicaConfig
    from router.core.pool.pool import Pool

    pool = Pool([ReplicaConfig(r["id"], r["model"], r["url"]) for r in map(replica, range(n))])
    for _ in range(max(1, n // MODELS // 2)):
        pool.acquire("model-0")
    acquire, release = pool.acquire, pool.release
    pairs = 50_000
    figures = []
    for _ in range(rounds):
        began = time.process_time()
        for _ in range(pairs):
            got = acquire("model-0")
            assert got is not None
            release(got)
        figures.append((time.process_time() - began) / pairs)
    return {"acquire_release_us": statistics.median(figures) * 1e6}


async def _tick(n: int, rounds: int, push: bool) -> dict[str, float]:
    from router.core.config.settings import load_config
    from router.run.app import RouterServer

    with tempfile.TemporaryDirectory() as tmp:
        receiver: subprocess.Popen[bytes] | None = None
        extra = "tick_seconds = 3600"
        if push:
            port = free_port()
            receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
            extra += f'\nusage_push_url = "http://127.0.0.1:{port}/usage"'
            await asyncio.to_thread(_wait_port, port)
        _, _ = toml_config(Path(tmp) / "r.toml", n, extra=extra)
        server = RouterServer(load_config(str(Path(tmp) / "r.toml")))
        await server.start()
        try:
            # As `router serve` does after start-up, where it does.
            from router.run.app import freeze_start_up  # type: ignore[attr-defined,unused-ignore]

            freeze_start_up()
        except ImportError:
            pass
        try:
            pool, ticker = server.pool, server.ticker
            assert ticker is not None
            for i, r in enumerate(list(pool)):
                if i % 2 == 0:
                    got = pool.acquire_this(r.id)
                    assert got is not None
                    pool.count_response(got, 200)
                    pool.release(got)
            sink = server.push

            async def one_tick() -> float:
                done = (sink.pushes + sink.failures) if sink is not None else 0
                began = time.process_time()
                ticker.tick()
                while sink is not None and sink.pushes + sink.failures == done:
                    await asyncio.sleep(0.001)
                return time.process_time() - began

            for _ in range(3):
                await one_tick()
            quiet = [await one_tick() for _ in range(rounds)]
            busy = []
            replicas = list(pool)
            for _ in range(rounds):
                for r in replicas:
                    got = pool.acquire_this(r.id)
                    assert got is not None
                    pool.release(got)
                busy.append(await one_tick())
            if sink is not None and sink.failures:
                raise RuntimeError("the usage push failed")
        finally:
            await server.stop()
            if receiver is not None:
                receiver.terminate()
                receiver.wait()
    return {"quiet_ms": statistics.median(quiet) * 1e3, "busy_ms": statistics.median(busy) * 1e3}


def _wait_port(port: int) -> None:
    import socket

    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def measure_tick(n: int, rounds: int) -> dict[str, float]:
    import uvloop

    off = uvloop.run(_tick(n, rounds, push=False))
    on = uvloop.run(_tick(n, rounds, push=True))
    return {
        "tick_push_off_ms": off["quiet_ms"],
        "tick_push_on_ms": on["quiet_ms"],
        "tick_all_touched_ms": off["busy_ms"],
    }


def measure_router(n: int, rounds: int) -> dict[str, float]:
    """/metrics, PUT /api/v1/endpoints, ctl idle and ctl status against one `router serve`."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "r.toml"
        _, admin = toml_config(config, n, extra="tick_seconds = 3600")
        base = f"http://127.0.0.1:{admin}"
        with router_process(config, admin) as process:
            pid = process.pid
            get(base + "/metrics")
            size = len(get(base + "/metrics"))
            scrape = cpu_of(pid, lambda: get(base + "/metrics"), rounds)
            bodies = []
            for variant in (0, 1):
                replicas = [replica(i) for i in range(n)]
                # One replica of N changed: its URL, a removal plus an addition.
                replicas[n // 2] = {**replicas[n // 2], "url": f"http://10.250.0.{variant}:9999"}
                bodies.append(json.dumps({"replicas": replicas}).encode())
            turn = [0]

            def put() -> None:
                body = bodies[turn[0] % 2]
                turn[0] += 1
                request = urllib.request.Request(base + "/api/v1/endpoints", data=body, method="PUT")
                request.add_header("Content-Type", "application/json")
                with urllib.request.urlopen(request, timeout=120) as resp:
                    answer = json.loads(resp.read())
                assert len(answer["changed"]) == 1 or turn[0] == 1, answer

            put()
            puts = cpu_of(pid, put, rounds)

            def ctl(*args: str) -> Callable[[], None]:
                def run() -> None:
                    subprocess.run(
                        [sys.executable, "-m", "router", "ctl", *args, "--server", f"127.0.0.1:{admin}", "--json"],
                        stdout=subprocess.DEVNULL,
                        check=False,
                        timeout=300,
                    )

                return run

            idle = cpu_of(pid, ctl("idle"), rounds)
            status = cpu_of(pid, ctl("status"), rounds)
            usage = cpu_of(pid, lambda: get(base + "/api/v1/usage"), rounds)
    return {
        "scrape_ms": statistics.median(scrape) * 1e3,
        "scrape_kb": size / 1024,
        "put_one_changed_ms": statistics.median(puts) * 1e3,
        "ctl_idle_ms": statistics.median(idle) * 1e3,
        "ctl_status_ms": statistics.median(status) * 1e3,
        "usage_poll_ms": statistics.median(usage) * 1e3,
    }


def measure_workers(n: int, rounds: int) -> dict[str, float]:
    tick = 1.0
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "r.toml"
        _, admin = toml_config(config, n, extra=f"tick_seconds = {tick}")
        with router_process(config, admin, "--workers", "2") as process:
            time.sleep(3 * tick)
            figures = []
            for _ in range(rounds):
                before = process_cpu(process.pid)
                time.sleep(4 * tick)
                figures.append((process_cpu(process.pid) - before) / 4)
    return {"supervisor_tick_ms": statistics.median(figures) * 1e3}


def measure_ring(n: int, rounds: int) -> dict[str, float]:
    from router.core.config.settings import ReplicaConfig
    from router.core.pool.picking import Routing
    from router.core.pool.pool import Pool

    configs = [ReplicaConfig(f"s-{i}", "m", f"http://10.0.{i // 250}.{i % 250}:8000") for i in range(n)]
    began = time.process_time()
    pool = Pool(configs, routing={"m": Routing("session")})
    start = time.process_time() - began
    extra = ReplicaConfig("s-extra", "m", "http://10.9.9.9:8000")
    added, removed, ejected, readmitted = [], [], [], []
    for _ in range(rounds):
        began = time.process_time()
        pool.set_replicas([*configs, extra])
        added.append(time.process_time() - began)
        began = time.process_time()
        pool.set_replicas(configs)
        removed.append(time.process_time() - began)
        victim = pool.get(configs[0].id)
        assert victim is not None
        began = time.process_time()
        pool.ejections.eject(victim, 10.0)
        ejected.append(time.process_time() - began)
        began = time.process_time()
        pool.ejections.readmit(victim)
        readmitted.append(time.process_time() - began)
    return {
        "ring_start_s": start,
        "ring_add_ms": statistics.median(added) * 1e3,
        "ring_remove_ms": statistics.median(removed) * 1e3,
        "ring_eject_ms": statistics.median(ejected) * 1e3,
        "ring_readmit_ms": statistics.median(readmitted) * 1e3,
    }


def refused_config(path: Path, n: int) -> int:
    """`n` replicas on loopback addresses where nothing listens, nothing else set; returns the admin port."""
    port, admin = free_port(), free_port()
    lines = [f'listen = "127.0.0.1:{port}"', f'admin_listen = "127.0.0.1:{admin}"']
    for i in range(n):
        # Port 9 (discard) on 127.1/16: refused at once, as a node with no engine refuses.
        lines += ["[[replicas]]", f'id = "model-{i % MODELS}-replica-{i}"', f'model = "model-{i % MODELS}"']
        lines.append(f'url = "http://127.1.{i // 250}.{i % 250 + 1}:9"')
    path.write_text("\n".join(lines) + "\n")
    return admin


def measure_quiet(n: int, rounds: int) -> dict[str, float]:
    """The router's CPU per second of a quiet fleet that does not answer, once start-up has settled."""
    window = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "r.toml"
        admin = refused_config(config, n)
        with router_process(config, admin) as process:
            pid = process.pid
            # Settled: three windows in a row under 50 ms of CPU a second (start-up reads each card once).
            # (A router that never settles is measured after 90 s all the same.)
            calm, deadline = 0, time.monotonic() + 90
            while calm < 3 and time.monotonic() < deadline:
                before = process_cpu(pid)
                time.sleep(window)
                calm = calm + 1 if (process_cpu(pid) - before) / window < 0.05 else 0
            # Windows of 10 s: work done every 10 s (a retry, two ticks) falls in each whole.
            figures = []
            for _ in range(min(rounds, 3)):
                before = process_cpu(pid)
                time.sleep(10.0)
                figures.append((process_cpu(pid) - before) / 10.0)
    return {"quiet_fleet_ms_per_s": statistics.median(figures) * 1e3}


# One server for every replica's engine: a vLLM /metrics page of a real one's size (the gauges
# the router reads come first in vLLM's page, then histograms), /v1/models saying vLLM, and
# chat answers. Each replica is a path prefix of its own: /rN/metrics.
PAGES = """
import sys
from aiohttp import web

gauges = (
    '# HELP vllm:num_requests_running Number of requests in model execution batches.\\n'
    '# TYPE vllm:num_requests_running gauge\\n'
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\\n'
    '# TYPE vllm:num_requests_waiting gauge\\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42\\n'
)
bucket = 'vllm:time_to_first_token_seconds_bucket{engine="0",le="%s",model_name="m"} 12.0\\n'
page = (gauges + "".join(bucket % i for i in range(800))).encode()
answer = b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[]}'

served = [0]

async def metrics(request):
    served[0] += 1
    return web.Response(body=page, content_type="text/plain")

async def count(request):
    return web.Response(text=str(served[0]))

async def models(request):
    return web.json_response({"object": "list", "data": [{"id": request.match_info["model"], "owned_by": "vllm"}]})

async def chat(request):
    await request.read()
    return web.Response(body=answer, content_type="application/json")

app = web.Application()
app.router.add_get("/{model}/{replica}/metrics", metrics)
app.router.add_get("/count", count)
app.router.add_get("/{model}/{replica}/v1/models", models)
app.router.add_post("/{model}/{replica}/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def measure_engines(n: int, rounds: int) -> dict[str, float]:
    """The router's CPU per second reading the engines of N busy replicas at the default interval."""
    with tempfile.TemporaryDirectory() as tmp:
        pages_port, port, admin = free_port(), free_port(), free_port()
        pages = subprocess.Popen([sys.executable, "-c", PAGES, str(pages_port)])
        config = Path(tmp) / "r.toml"
        lines = [f'listen = "127.0.0.1:{port}"', f'admin_listen = "127.0.0.1:{admin}"']
        for i in range(n):
            model = f"model-{i % MODELS}"
            lines += ["[[replicas]]", f'id = "{model}-replica-{i}"', f'model = "{model}"', 'engine = "vllm"']
            lines.append(f'url = "http://127.0.0.1:{pages_port}/{model}/r{i}"')
        config.write_text("\n".join(lines) + "\n")
        try:
            _wait_port(pages_port)
            with router_process(config, admin) as process:
                stop = time.monotonic() + 600

                def traffic() -> None:
                    # Every model busy: a request to each every second, as long as the measure runs.
                    body = b'{"model": "%s", "messages": []}'
                    while time.monotonic() < stop:
                        for m in range(MODELS):
                            request = urllib.request.Request(
                                f"http://127.0.0.1:{port}/v1/chat/completions",
                                data=body % f"model-{m}".encode(),
                                headers={"Content-Type": "application/json"},
                            )
                            with contextlib.suppress(OSError):
                                urllib.request.urlopen(request, timeout=10).read()
                        time.sleep(1.0)

                sender = threading.Thread(target=traffic, daemon=True)
                sender.start()
                time.sleep(5.0)  # start-up: the cards' reads, the first rounds of readings
                figures, rates = [], []
                counter = f"http://127.0.0.1:{pages_port}/count"
                for _ in range(min(rounds, 3)):
                    before, served = process_cpu(process.pid), int(get(counter))
                    time.sleep(10.0)
                    figures.append((process_cpu(process.pid) - before) / 10.0)
                    rates.append((int(get(counter)) - served) / 10.0)
                stop = 0.0
                reads = orjson_get(f"http://127.0.0.1:{admin}/api/v1/replicas")
                read = sum(1 for row in reads if row.get("engine_load") is not None)
        finally:
            pages.terminate()
            pages.wait(timeout=30)
    return {
        "engines_ms_per_s": statistics.median(figures) * 1e3,
        "engines_reads_per_s": statistics.median(rates),
        "engines_read": read,
    }


def orjson_get(url: str) -> list[dict[str, Any]]:
    doc: list[dict[str, Any]] = json.loads(get(url))
    return doc


MEASURES: dict[str, Callable[[int, int], dict[str, float]]] = {
    "acquire": measure_acquire,
    "tick": measure_tick,
    "scrape": measure_router,
    "put": measure_router,
    "ctl": measure_router,
    "workers": measure_workers,
    "ring": measure_ring,
    "quiet": measure_quiet,
    "engines": measure_engines,
}


# The parent: children per tree, target and size, then the table -------------------


def run_child(tree: Path, target: str, n: int, rounds: int, limit: float) -> dict[str, float] | str:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", target, "--size", str(n)]
    command += ["--rounds", str(rounds)]
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        return f"> {limit:g} s"
    if done.returncode != 0:
        return "failed: " + done.stderr.decode(errors="replace").strip().splitlines()[-1:][0]
    result: dict[str, float] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def checkout(ref: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "router"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


ROWS = (
    ("acquire_release_us", "acquire()+release() per pair", "{:.2f} us"),
    ("tick_push_off_ms", "a quiet tick, push off", "{:.2f} ms"),
    ("tick_push_on_ms", "a quiet tick, push on", "{:.2f} ms"),
    ("tick_all_touched_ms", "a tick after every replica took a request", "{:.2f} ms"),
    ("scrape_ms", "one /metrics scrape", "{:.1f} ms"),
    ("scrape_kb", "... its size", "{:,.0f} KB"),
    ("put_one_changed_ms", "PUT /api/v1/endpoints, 1 replica of N changed", "{:.1f} ms"),
    ("supervisor_tick_ms", "--workers 2: the supervisor per tick", "{:.1f} ms"),
    ("ctl_idle_ms", "router ctl idle: router CPU", "{:.1f} ms"),
    ("ctl_status_ms", "router ctl status: router CPU", "{:.1f} ms"),
    ("usage_poll_ms", "GET /api/v1/usage", "{:.2f} ms"),
    ("ring_start_s", "session ring of N replicas: start-up", "{:.3f} s"),
    ("ring_add_ms", "... one replica added", "{:.2f} ms"),
    ("ring_remove_ms", "... one replica removed", "{:.2f} ms"),
    ("ring_eject_ms", "... one replica ejected", "{:.2f} ms"),
    ("ring_readmit_ms", "... one replica readmitted", "{:.2f} ms"),
    ("quiet_fleet_ms_per_s", "a fleet that does not answer, defaults: CPU a second", "{:.2f} ms"),
    ("engines_ms_per_s", "busy vLLM replicas, their load read: CPU a second", "{:.1f} ms"),
    ("engines_reads_per_s", "... pages read a second", "{:,.0f}"),
    ("engines_read", "... replicas with a reading", "{:,.0f}"),
)


# The figures each child reports, so that one that fails or passes --limit marks its own rows.
KEYS = {
    "acquire": ("acquire_release_us",),
    "tick": ("tick_push_off_ms", "tick_push_on_ms", "tick_all_touched_ms"),
    "scrape": ("scrape_ms", "scrape_kb", "put_one_changed_ms", "ctl_idle_ms", "ctl_status_ms", "usage_poll_ms"),
    "workers": ("supervisor_tick_ms",),
    "ring": ("ring_start_s", "ring_add_ms", "ring_remove_ms", "ring_eject_ms", "ring_readmit_ms"),
    "quiet": ("quiet_fleet_ms_per_s",),
    "engines": ("engines_ms_per_s", "engines_reads_per_s", "engines_read"),
}

Figures = dict[str, float | str]


def table(results: dict[str, dict[int, Figures]], sizes: Sequence[int]) -> str:
    """One markdown table: a row per figure, a column per size, `before -> after` with a baseline."""
    lines = ["| | " + " | ".join(f"{n:,}" for n in sizes) + " |", "| --- |" + " --- |" * len(sizes)]
    for key, label, fmt in ROWS:
        cells = []
        for n in sizes:
            shown = []
            for per_size in results.values():
                got = per_size.get(n, {}).get(key)
                if got is not None:
                    shown.append(got if isinstance(got, str) else fmt.format(got))
            cells.append(" -> ".join(shown))
        if any(cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REF", help="also measure this commit, shown as REF -> working tree")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"some of {','.join(TARGETS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--limit", type=float, default=600.0, help="seconds a child may take")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(MEASURES[args.child](args.size, args.rounds)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    targets = [t for t in args.targets.split(",") if t]
    trees: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="router-scale-") as tmp:
        if args.baseline:
            trees[args.baseline] = checkout(args.baseline, Path(tmp) / args.baseline)
        trees["working tree"] = ROOT
        results: dict[str, dict[int, Figures]] = {name: {} for name in trees}
        # One child per router measure, whatever the targets among scrape, put and ctl.
        children = list(dict.fromkeys("scrape" if t in ("put", "ctl") else t for t in targets))
        for target in children:
            for n in RING_SIZES if target == "ring" else sizes:
                if target == "ring" and n not in sizes and n != 800:
                    continue
                for name, tree in trees.items():
                    got = run_child(tree, target, n, args.rounds, args.limit)
                    print(f"{name} {target} {n}: {got}", file=sys.stderr)
                    figures = results[name].setdefault(n, {})
                    figures.update(dict.fromkeys(KEYS[target], got) if isinstance(got, str) else got)
    shown = sorted({n for per_tree in results.values() for n in per_tree})
    if args.json:
        print(json.dumps({name: {str(n): v for n, v in per.items()} for name, per in results.items()}))
    else:
        print(table(results, shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
