"""Scale from zero, measured: how soon a held request goes, and what 10,000 held requests cost.

    .venv/bin/python bench/coldstart.py [--starts 20] [--held 10000] [--json]

1. Cold starts: a router (`router serve`) holds a request for a model whose
   one replica refuses connections (a socket bound, not listening: an engine
   still loading). After a pause the replica starts to listen; the time from
   its listen() to the held request's response head is one sample. Reported:
   p50 and p99 over `--starts` cold starts (target <= 250 ms).
2. Many held: `--held` requests held at once for a model with no replica.
   Reported: the router's RSS added while they wait (target < 100 MB), and
   the time from the push of a replica (a fake, two processes) until every
   one of them is answered. The router runs with max_in_flight = 8,000 so
   that client and replica connections stay under this machine's 20,000
   file descriptors: the rest drain through the pool's queue as slots free.

CPU per short request with holding configured on every model and nothing
held is bench/instructions.py's `--hold-configured`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import free_port, rss_mb, serve, tree, wait_http  # noqa: E402
from router.tools.fake import FakeReplica  # noqa: E402

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def start_router(tmp: Path, extra: str) -> tuple[subprocess.Popen[bytes], int, int]:
    """A `router serve` on port 0, ready: it, its client port and its admin port."""
    config = tmp / f"router-{len(list(tmp.glob('router-*.toml')))}.toml"
    config.write_text(f'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\ntick_seconds = 0.2\n{extra}\n')
    process, client, admin = serve(config)
    return process, int(client.rsplit(":", 1)[1]), int(admin.rsplit(":", 1)[1])


def push(admin: int, replicas: list[dict[str, str]]) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{admin}/api/v1/endpoints",
        data=json.dumps({"replicas": replicas}).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()


def held(admin: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/api/v1/usage", timeout=10) as resp:
        doc = json.loads(resp.read())
    return int(doc.get("demand", {}).get("m", {}).get("held", 0))


async def send(port: int) -> tuple[float, bytes]:
    """One chat request on its own connection: (time its head came, the status line)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        came = time.perf_counter()
        return came, head.split(b"\r\n", 1)[0]
    finally:
        writer.close()


async def cold_starts(tmp: Path, count: int) -> dict[str, float]:
    router, port, admin = start_router(tmp, '[models."m"]\ncold_start_seconds = 30')
    samples: list[float] = []
    try:
        for i in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))  # bound, not listening: refused, as a loading engine
            push(admin, [{"id": f"r{i}", "model": "m", "url": f"http://127.0.0.1:{sock.getsockname()[1]}"}])
            request = asyncio.create_task(send(port))
            await asyncio.sleep(0.4)  # held, and refused a few times meanwhile
            fake = FakeReplica(models=("m",), name=f"engine-{i}")
            await fake.start(sock=sock)
            listening = time.perf_counter()
            came, status = await request
            assert status.startswith(b"HTTP/1.1 200"), status
            samples.append((came - listening) * 1000)
            await fake.stop()
    finally:
        router.terminate()
        router.wait(timeout=30)
    samples.sort()
    return {
        "starts": count,
        "p50_ms": statistics.median(samples),
        "p99_ms": samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))],
        "max_ms": samples[-1],
    }


async def many_held(tmp: Path, count: int) -> dict[str, Any]:
    router, port, admin = start_router(
        tmp, f'max_in_flight = 8000\n[models."m"]\ncold_start_seconds = 300\nmax_held = {count * 2}'
    )
    # Told its port: its processes share it (--processes refuses port 0).
    fake_port = free_port()
    fake: subprocess.Popen[bytes] | None = None
    try:
        before = rss_mb(tree(router.pid))
        requests = [asyncio.create_task(send(port)) for _ in range(count)]
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(held, admin) < count:
            assert time.monotonic() < deadline, "not every request was held"
            await asyncio.sleep(0.2)
        holding = rss_mb(tree(router.pid))
        fake = subprocess.Popen(
            [sys.executable, "-m", "router.tools.fake", "--port", str(fake_port), "--model", "m", "--processes", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(f"http://127.0.0.1:{fake_port}/v1/models", process=fake)
        pushed = time.perf_counter()
        await asyncio.to_thread(push, admin, [{"id": "r0", "model": "m", "url": f"http://127.0.0.1:{fake_port}"}])
        answers = await asyncio.gather(*requests, return_exceptions=True)
        drained = time.perf_counter() - pushed
        ok = sum(1 for a in answers if not isinstance(a, BaseException) and a[1].startswith(b"HTTP/1.1 200"))
    finally:
        router.terminate()
        router.wait(timeout=60)
        if fake is not None:
            fake.terminate()
            fake.wait(timeout=30)
    return {
        "held": count,
        "rss_before_mb": round(before, 1),
        "rss_holding_mb": round(holding, 1),
        "rss_added_mb": round(holding - before, 1),
        "drain_seconds": round(drained, 2),
        "served": ok,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="router-coldstart-") as tmpdir:
        tmp = Path(tmpdir)
        starts = await cold_starts(tmp, args.starts)
        many = await many_held(tmp, args.held) if args.held else None
    return {"cold_starts": starts, "many_held": many}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--held", type=int, default=10000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(result))
        return 0
    c = result["cold_starts"]
    print(
        f"cold starts ({c['starts']}): replica listening -> held request's head: p50 {c['p50_ms']:.0f} ms, "
        f"p99 {c['p99_ms']:.0f} ms, max {c['max_ms']:.0f} ms (target <= 250)"
    )
    m = result["many_held"]
    if m is not None:
        print(
            f"{m['held']:,} held: RSS {m['rss_before_mb']} -> {m['rss_holding_mb']} MB (+{m['rss_added_mb']} MB, "
            f"target < 100); drained in {m['drain_seconds']} s after the push, {m['served']:,} served"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
