"""Requests/s and added latency: straight to a fake replica vs through the router.

One run starts a fast fake replica (several processes on one port, so that it
is never the bottleneck) and a `router serve` in front of it, then measures
both paths in turn, interleaved and repeated, with the same load generator:
wrk when it is installed (Debian's `wrk`), else `router bench`. The proxy's
CPU per request comes from /proc. Figures are ratios within one run: these
machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def wrk(url: str, *, connections: int, seconds: float, stream: bool, tmp: Path) -> dict[str, float]:
    body = json.dumps({**CHAT, "stream": stream})
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body)}\n"
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("JSON {\\"requests\\": %d, \\"seconds\\": %f, \\"p50_us\\": %d, '
        '\\"p99_us\\": %d, \\"errors\\": %d}\\n", summary.requests, summary.duration / 1e6, '
        "latency:percentile(50), latency:percentile(99), summary.errors.status + summary.errors.connect + "
        "summary.errors.read + summary.errors.write + summary.errors.timeout))\nend\n"
    )
    out = subprocess.run(
        [
            "wrk",
            "-t",
            "1",
            "-c",
            str(connections),
            "-d",
            f"{max(1, round(seconds))}s",
            "-s",
            str(script),
            "--latency",
            url + "/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 30,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("JSON "))
    doc = json.loads(line[5:])
    return {
        "rps": doc["requests"] / doc["seconds"],
        "requests": doc["requests"],
        "p50_ms": doc["p50_us"] / 1000,
        "p99_ms": doc["p99_us"] / 1000,
        "errors": doc["errors"],
    }


def router_bench(url: str, *, connections: int, seconds: float, stream: bool) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "router",
        "bench",
        "--url",
        url,
        "--model",
        "m",
        "-c",
        str(connections),
        "-n",
        "10000000",
        "-d",
        str(seconds),
        "--json",
    ]
    if stream:
        cmd.append("--stream")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=seconds + 30).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return {
        "rps": doc["requests_per_second"],
        "requests": doc["requests"],
        "p50_ms": doc["latency_p50_ms"],
        "p99_ms": doc["latency_p99_ms"],
        "errors": doc["errors"],
    }


def start_router(tmp: Path, replicas: int, fake_port: int) -> tuple[subprocess.Popen[bytes], str, str]:
    client_port, admin_port = free_port(), free_port()
    config = tmp / f"router-{replicas}.toml"
    lines = [f'listen = "127.0.0.1:{client_port}"', f'admin_listen = "127.0.0.1:{admin_port}"', "tick_seconds = 1"]
    # Every replica entry points at the same fake: the router still spreads over them.
    for i in range(replicas):
        lines += ["[[replicas]]", f'id = "r{i}"', 'model = "m"', f'url = "http://127.0.0.1:{fake_port}"']
    config.write_text("\n".join(lines) + "\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "router", "serve", "--config", str(config), "--log-level", "warning"]
    )
    return process, f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{admin_port}"


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument(
        "--replicas", default="4", help="replicas configured, comma-separated for one router each (e.g. 4,4000)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(x) for x in args.replicas.split(",")]
    use_wrk = shutil.which("wrk") is not None
    fake_port = free_port()
    direct = f"http://127.0.0.1:{fake_port}"
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        fake = subprocess.Popen(
            [sys.executable, "-m", "router.fake", "--port", str(fake_port), "--model", "m", "--processes", "2"],
            stdout=subprocess.DEVNULL,
        )
        routers = {n: start_router(tmp, n, fake_port) for n in counts}
        stop_polling = threading.Event()

        def poll_usage(admin: str) -> None:
            # A control plane polling the usage map all along, as in production.
            while not stop_polling.wait(0.5):
                with urllib.request.urlopen(admin + "/api/v1/usage", timeout=5) as resp:
                    resp.read()

        try:
            wait_http(direct + "/v1/models")
            for _, _, admin in routers.values():
                wait_http(admin + "/readyz", timeout=60)
            pollers = [threading.Thread(target=poll_usage, args=(a,), daemon=True) for _, _, a in routers.values()]
            for poller in pollers:
                poller.start()

            def load(name: str, url: str, connections: int, stream: bool, pid: int | None) -> None:
                before = cpu_seconds(pid) if pid else 0.0
                if use_wrk:
                    figures = wrk(url, connections=connections, seconds=args.seconds, stream=stream, tmp=tmp)
                else:
                    figures = router_bench(url, connections=connections, seconds=args.seconds, stream=stream)
                if pid and figures["requests"]:
                    figures["cpu_ms_per_request"] = (cpu_seconds(pid) - before) * 1000 / figures["requests"]
                results.setdefault(name, []).append(figures)

            for _ in range(args.rounds):
                for stream in (False, True):
                    kind = "stream" if stream else "short"
                    load(f"direct {kind}", direct, args.connections, stream, None)
                    for n, (process, client, _) in routers.items():
                        load(f"router{n} {kind}", client, args.connections, stream, process.pid)
                load("direct 1conn", direct, 1, False, None)
                for n, (process, client, _) in routers.items():
                    load(f"router{n} 1conn", client, 1, False, process.pid)
            stop_polling.set()
            for poller in pollers:
                poller.join()
        finally:
            for process, _, _ in routers.values():
                process.terminate()
            fake.terminate()
            for process, _, _ in routers.values():
                process.wait(timeout=40)
            fake.wait(timeout=10)

    def median(name: str, key: str) -> float:
        values = sorted(r.get(key, float("nan")) for r in results[name])
        return values[len(values) // 2]

    summary: dict[str, Any] = {"generator": "wrk" if use_wrk else "router bench", "replicas": counts}
    summary["p50_direct_ms"] = median("direct 1conn", "p50_ms")
    for kind in ("short", "stream"):
        summary[f"{kind}_direct_rps"] = median(f"direct {kind}", "rps")
    for n in counts:
        for kind in ("short", "stream"):
            rps = median(f"router{n} {kind}", "rps")
            summary[f"{kind}_router{n}_rps"] = rps
            summary[f"{kind}_router{n}_ratio"] = rps / summary[f"{kind}_direct_rps"]
            summary[f"{kind}_router{n}_cpu_ms"] = median(f"router{n} {kind}", "cpu_ms_per_request")
        summary[f"p50_router{n}_ms"] = median(f"router{n} 1conn", "p50_ms")
        summary[f"added_p50_router{n}_us"] = (summary[f"p50_router{n}_ms"] - summary["p50_direct_ms"]) * 1000
    summary["errors"] = sum(r["errors"] for rows in results.values() for r in rows)
    if args.json:
        print(json.dumps(summary))
        return summary
    print(
        f"load generator: {summary['generator']}, {args.connections} connections, {args.rounds} rounds of "
        f"{args.seconds:g} s, medians; errors {summary['errors']}"
    )
    print("| path | short req/s | stream req/s (16 chunks) | CPU ms/request short, stream | p50 at 1 conn |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| straight to the replica | {summary['short_direct_rps']:.0f} | {summary['stream_direct_rps']:.0f} | - "
        f"| {summary['p50_direct_ms'] * 1000:.0f} us |"
    )
    for n in counts:
        print(
            f"| router, {n} replicas | {summary[f'short_router{n}_rps']:.0f} "
            f"({summary[f'short_router{n}_ratio']:.2f}x) | {summary[f'stream_router{n}_rps']:.0f} "
            f"({summary[f'stream_router{n}_ratio']:.2f}x) | {summary[f'short_router{n}_cpu_ms']:.3f}, "
            f"{summary[f'stream_router{n}_cpu_ms']:.3f} | {summary[f'p50_router{n}_ms'] * 1000:.0f} us "
            f"(+{summary[f'added_p50_router{n}_us']:.0f} us) |"
        )
    return summary


if __name__ == "__main__":
    main()
