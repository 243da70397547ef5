"""Priority classes and tenants' shares at the limits, measured through `router serve`.

    .venv/bin/python bench/fairness.py [--seconds 60] [--service 0.1] [--repeats 3] [--json]

One model, two replicas (fake ones, each its own process, answering after
`--service` seconds) of capacity 4 (`max_in_flight_per_replica = 4`):

1. Beside a flood: tenant A's key is `batch` and sends 400 requests at once;
   tenant B's is `interactive` and sends one request at a time for as long as
   A's flood lasts. Reported: B's queue wait (the access log's
   `queued_seconds`, 0 for a request that found a slot at once) p50/p99/max,
   against the target of 50 ms plus one service time; and B's whole latency.
2. Shares: two tenants of one class each keep 32 requests in flight for
   `--seconds` (so both always wait): the share of the requests served to
   each, with equal weights (target 50 +- 5%) and with weights 2 : 1
   (target 67 +- 5%).
3. The same shares with `router serve --workers 2`: each worker queues its
   own connections, the limits split over the workers.
4. The pick, in process: 10,000 requests queued for one model over 1, 10
   and 100 tenants; the CPU time of a release() that hands the slot to the
   next in turn (target: 100 tenants within 10% of 10), and the same in
   instructions counted by callgrind (when valgrind is installed), which
   the machine's other work does not move.

Timings on this shared machine are noisy: each figure is the median of
`--repeats` runs, and every run is shown. The load is light (8 requests in
flight, a tenth of a second each), so the client's own CPU does not shape
the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import fake, serve, wait_http  # noqa: E402
from router.core.config.settings import ReplicaConfig  # noqa: E402
from router.core.config.tenants import Caller, Queueing  # noqa: E402
from router.core.pool.pool import Limits, Pool  # noqa: E402
from router.core.pool.replicas import Replica  # noqa: E402

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CAPACITY = 4
FLOOD = 400
CONCURRENCY = 32
QUEUED = 10_000
PICKS = 5_000


class Fleet:
    """Two fake replicas and a router in front, each its own process; stopped on exit."""

    def __init__(self, tmp: Path, service: float, keys: str, workers: int = 1) -> None:
        self.tmp = tmp
        self.service = service
        self.keys = keys
        self.workers = workers
        self.processes: list[subprocess.Popen[bytes]] = []
        # Its own folder: a benchmark runs several fleets in one temporary directory.
        self.folder = Path(tempfile.mkdtemp(dir=tmp))
        self.log = self.folder / "access.log"
        # The router's client port, once it said where it listens (it binds port 0).
        self.port = 0

    def __enter__(self) -> Fleet:
        urls = []
        for _ in range(2):
            process, url = fake("--model", "m", "--first-token-delay", str(self.service))
            self.processes.append(process)
            wait_http(f"{url}/v1/models", process=process)
            urls.append(url)
        lines = [
            'listen = "127.0.0.1:0"',
            'admin_listen = "127.0.0.1:0"',
            f"max_in_flight_per_replica = {CAPACITY}",
            f'access_log = "{self.log}"',
            "tick_seconds = 1",
        ]
        for i, url in enumerate(urls):
            lines += ["[[replicas]]", f'id = "r{i}"', 'model = "m"', f'url = "{url}"']
        config = self.folder / "router.toml"
        config.write_text("\n".join(lines) + "\n" + self.keys)
        router, client, _ = serve(config, "--workers", str(self.workers))
        self.processes.append(router)
        self.port = int(client.rsplit(":", 1)[1])
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log_lines(self) -> dict[str, dict[str, Any]]:
        """The access log by request id, once every line is written (the log is flushed a few times a second)."""
        time.sleep(0.5)
        return {doc["id"]: doc for doc in map(orjson.loads, self.log.read_bytes().splitlines())}


def keys_table(**tenants: tuple[str, float]) -> str:
    """[api_keys.NAME] for each tenant: its key is sk-NAME; (class, weight)."""
    out = []
    for name, (priority, weight) in tenants.items():
        out += [f"[api_keys.{name}]", f'key = "sk-{name}"', f'priority = "{priority}"', f"weight = {weight}"]
    return "\n".join(out) + "\n"


async def ask(session: aiohttp.ClientSession, port: int, tenant: str, request_id: str) -> int:
    headers = {"Authorization": f"Bearer sk-{tenant}", "X-Request-Id": request_id}
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        await resp.read()
        return resp.status


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def beside_a_flood(fleet: Fleet) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        flood = [asyncio.create_task(ask(session, fleet.port, "a", f"a{i}")) for i in range(FLOOD)]
        await asyncio.sleep(0.2)  # the flood has arrived and fills the queue
        latencies: list[float] = []
        i = 0
        while not all(task.done() for task in flood):
            began = time.perf_counter()
            status = await ask(session, fleet.port, "b", f"b{i}")
            assert status == 200, status
            latencies.append(time.perf_counter() - began)
            i += 1
        statuses = Counter(await asyncio.gather(*flood))
    lines = fleet.log_lines()
    waits = [lines[f"b{j}"]["queued_seconds"] or 0.0 for j in range(i)]
    flood_waits = [lines[f"a{j}"]["queued_seconds"] or 0.0 for j in range(FLOOD)]
    return {
        "b_requests": i,
        "b_wait_p50_ms": 1000 * percentile(waits, 0.5),
        "b_wait_p99_ms": 1000 * percentile(waits, 0.99),
        "b_wait_max_ms": 1000 * max(waits),
        "b_latency_p99_ms": 1000 * percentile(latencies, 0.99),
        "b_waits_ms": [1000 * w for w in waits],
        "a_served": statuses[200],
        "a_wait_max_s": max(flood_waits),
    }


async def shares(fleet: Fleet, seconds: float) -> dict[str, Any]:
    served: Counter[str] = Counter()
    refused: Counter[int] = Counter()
    counting = asyncio.Event()
    stop = asyncio.Event()

    async def loop(session: aiohttp.ClientSession, tenant: str, lane: int) -> None:
        n = 0
        while not stop.is_set():
            status = await ask(session, fleet.port, tenant, f"{tenant}-{lane}-{n}")
            n += 1
            if not counting.is_set() or stop.is_set():
                continue
            if status == 200:
                served[tenant] += 1
            else:
                refused[status] += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [
            asyncio.create_task(loop(session, tenant, lane)) for lane in range(CONCURRENCY) for tenant in ("a", "b")
        ]
        # A few seconds for every lane to be waiting before counting starts.
        await asyncio.sleep(3.0)
        counting.set()
        await asyncio.sleep(seconds)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    total = served["a"] + served["b"]
    return {"served": total, "a_share": served["a"] / total, "refused": dict(refused)}


async def queued_pool(tenants: int, queued: int) -> tuple[Pool, Replica, list[asyncio.Task[Any]]]:
    """One replica at its limit and `queued` requests waiting for it, spread over `tenants` in turn."""
    pool = Pool([ReplicaConfig("r0", "m", "http://127.0.0.1:9000")], limits=Limits(per_replica=1), queueing=Queueing())
    replica = pool.acquire("m")
    assert replica is not None
    callers = [Caller(f"t{i}") for i in range(tenants)]
    waiting = [
        asyncio.create_task(pool.queues.acquire_or_wait("m", wait_seconds=3600, caller=callers[i % tenants]))
        for i in range(queued)
    ]
    await asyncio.sleep(0)
    assert pool.queues.waiting("m") == queued
    return pool, replica, waiting


def pick_cost(tenants: int, *, queued: int = QUEUED, picks: int = PICKS, rounds: int = 5) -> float:
    """CPU ns per release() that hands its slot to the next queued request in turn, `queued` over `tenants`."""

    async def one_round() -> float:
        pool, replica, waiting = await queued_pool(tenants, queued)
        release = pool.release
        # CPU time, not wall time: on a shared machine the process is often off its core.
        began = time.process_time_ns()
        for _ in range(picks):
            release(replica)
        elapsed = time.process_time_ns() - began
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return elapsed / picks

    return min(asyncio.run(one_round()) for _ in range(rounds))


def pick_child(tenants: int, picks: int) -> None:
    """Under callgrind: set up the queue, make `picks` picks, and leave at once (no teardown to count)."""

    async def run() -> None:
        pool, replica, _ = await queued_pool(tenants, QUEUED)
        for _ in range(picks):
            pool.release(replica)
        sys.stdout.flush()
        os._exit(0)

    asyncio.run(run())


def pick_instructions(tenants: int, tmp: Path) -> float:
    """Instructions per pick, counted by callgrind: a run with PICKS picks less one with none, over PICKS.

    Both runs do the same set-up with the same hash seed, so what is left is the picks alone.
    """
    totals = []
    for picks in (0, PICKS):
        out = tmp / f"pick-{tenants}-{picks}.callgrind"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--pick-child",
                f"{tenants}:{picks}",
            ],
            env={**os.environ, "PYTHONHASHSEED": "0"},
            check=True,
            capture_output=True,
            timeout=1800,
        )
        totals.append(
            max(
                int(line.split()[1])
                for line in out.read_text(errors="replace").splitlines()
                if line.startswith(("summary:", "totals:"))
            )
        )
    return (totals[1] - totals[0]) / PICKS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the shares are counted")
    parser.add_argument("--service", type=float, default=0.1, help="seconds each replica takes per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["flood", "shares", "workers", "pick"], action="append", default=[])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pick-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pick_child:
        tenants, picks = map(int, args.pick_child.split(":"))
        pick_child(tenants, picks)
    wanted = set(args.only) or {"flood", "shares", "workers", "pick"}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="router-fairness-") as tmpdir:
        tmp = Path(tmpdir)
        if "flood" in wanted:
            runs = []
            for _ in range(args.repeats):
                with Fleet(tmp, args.service, keys_table(a=("batch", 1), b=("interactive", 1))) as fleet:
                    runs.append(asyncio.run(beside_a_flood(fleet)))
            results["flood"] = runs
        for label, workers in (("shares", 1), ("workers", 2)):
            if label not in wanted:
                continue
            for weights in ((1, 1), (2, 1)):
                runs = []
                for _ in range(args.repeats):
                    keys = keys_table(a=("interactive", weights[0]), b=("interactive", weights[1]))
                    with Fleet(tmp, args.service, keys, workers=workers) as fleet:
                        runs.append(asyncio.run(shares(fleet, args.seconds)))
                results[f"{label}-{weights[0]}:{weights[1]}"] = runs
        if "pick" in wanted:
            results["pick"] = {str(n): [pick_cost(n) for _ in range(args.repeats)] for n in (1, 10, 100)}
            if shutil.which("valgrind"):
                results["pick_instructions"] = {str(n): pick_instructions(n, tmp) for n in (1, 10, 100)}
    if args.json:
        print(json.dumps(results))
    else:
        report(results, args.service)
    return 0


def report(results: dict[str, Any], service: float) -> None:
    if "flood" in results:
        runs = results["flood"]
        target = 50 + 1000 * service
        print(f"1. interactive B beside batch A's {FLOOD} at once (target: B's wait p99 < {target:.0f} ms)")
        for run in runs:
            print(
                f"   B {run['b_requests']} requests: wait p50 {run['b_wait_p50_ms']:.1f} ms, p99 "
                f"{run['b_wait_p99_ms']:.1f} ms, max {run['b_wait_max_ms']:.1f} ms; latency p99 "
                f"{run['b_latency_p99_ms']:.1f} ms; A served {run['a_served']}/{FLOOD}, its longest wait "
                f"{run['a_wait_max_s']:.2f} s"
            )
        pooled = [w for r in runs for w in r["b_waits_ms"]]
        print(
            f"   every run's B together: {len(pooled)} requests, wait p99 {percentile(pooled, 0.99):.1f} ms; "
            f"median of the runs' p99 {statistics.median(r['b_wait_p99_ms'] for r in runs):.1f} ms"
        )
    for key, target in (
        ("shares-1:1", 0.5),
        ("shares-2:1", 2 / 3),
        ("workers-1:1", 0.5),
        ("workers-2:1", 2 / 3),
    ):
        if key not in results:
            continue
        runs = results[key]
        shown = ", ".join(f"{100 * r['a_share']:.1f}% of {r['served']}" for r in runs)
        refused = sum(sum(r["refused"].values()) for r in runs)
        print(f"2. {key} (A's target {100 * target:.0f} +- 5%): A got {shown}; refused {refused}")
    if "pick" in results:
        pick = results["pick"]
        best = {n: min(v) for n, v in pick.items()}
        print("4. release() handing its slot to the next of 10,000 queued (ns, best of each run):")
        for n, values in pick.items():
            print(f"   {n:>3} tenants: {', '.join(f'{v:.0f}' for v in values)}; best {best[n]:.0f}")
        print(f"   100 tenants / 10 tenants: {best['100'] / best['10']:.3f}x")
    if "pick_instructions" in results:
        counted = results["pick_instructions"]
        shown = ", ".join(f"{n} tenants {v:,.0f}" for n, v in counted.items())
        print(f"   instructions per pick (callgrind): {shown}; 100 / 10: {counted['100'] / counted['10']:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
