"""Instructions per request, counted by callgrind: the CPU budget's figure on a noisy machine.

    .venv/bin/python bench/instructions.py [--baseline REF ...] [--requests 2000]

CPU time per request on this shared 2-core machine moves by 20% from one
run to the next; an instruction count does not (valgrind --tool=callgrind
counts the same for the same code and inputs, whatever else the machine
does). Each router (the working tree, and each REF as `router@REF`) runs
under callgrind with instrumentation off; after a warm-up, it is switched on
for exactly `--requests` requests and off again. Reported: instructions per
request for short requests (non-streaming chat, 16 tokens), for 64-chunk
streams, and for the same streams with their usage asked for
(`stream_options.include_usage`), and each REF's ratio to the working tree. The fake replica and the
load generator run outside valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.compare import LISTENING, checkout, compiled_tree, router_config, said, wait_http  # noqa: E402
from bench.compare import fake as start_fake  # noqa: E402

WORKLOADS = {
    "short": {"model": "fast", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16},
    "stream": {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True},
    # The same stream with its usage asked for (a usage chunk before [DONE]): what reading it costs.
    "stream-usage": {
        "model": "fast",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}


def raw_requests(body: dict[str, object], varied: bool, key: str = "") -> list[bytes]:
    """The request as bytes; `varied`: 64 of them, each its own session and prompt (affinity's keys);
    `key`: sent as the client's key (a tenant's)."""
    variants = []
    for i in range(64 if varied else 1):
        doc = body if not varied else {**body, "messages": [{"role": "user", "content": f"hello {i}"}]}
        payload = json.dumps(doc).encode()
        session = b"X-Session-Id: s%d\r\n" % i if varied else b""
        if key:
            session += b"Authorization: Bearer %s\r\n" % key.encode()
        variants.append(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n%b"
            b"Content-Length: %d\r\n\r\n%b" % (session, len(payload), payload)
        )
    return variants


async def load(port: int, requests: list[bytes], count: int, connections: int) -> None:
    """`count` requests over `connections` keep-alive connections, each answer read whole."""
    left = [count]

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left[0] > 0:
                left[0] -= 1
                writer.write(requests[left[0] % len(requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                match = re.search(rb"(?i)content-length: (\d+)", head)
                if match is not None:
                    await reader.readexactly(int(match.group(1)))
                else:
                    await reader.readuntil(b"0\r\n\r\n")
        finally:
            writer.close()

    await asyncio.gather(*(one_connection() for _ in range(connections)))


def callgrind_control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def measure(
    name: str,
    cwd: Path | None,
    tmp: Path,
    fake: str,
    requests: int,
    extra: str = "",
    varied: bool = False,
    keep: Path | None = None,
    engine: str = "",
    key: str = "",
) -> dict[str, float]:
    # On port 0, but for a baseline at an older commit, which says where it listens only at info: told its ports.
    told = "@" in name
    config = router_config(tmp, name.replace("@", "-"), fake, 4, told=told)
    if engine:
        # Every replica names its engine: its load is read, and its picks weigh it.
        config.write_text(config.read_text().replace("\nurl = ", f"\nengine = {engine}\nurl = "))
    if extra:
        # Top-level keys go before the first table; tables after the last.
        text = config.read_text()
        tables = 0 if extra.startswith("[") else extra.find("\n[") + 1
        if tables <= 0 and not extra.startswith("["):
            tables = len(extra)
        config.write_text(extra[:tables] + text + extra[tables:])
    out = tmp / f"{name.replace('@', '-')}.callgrind"
    process = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}.%p",
            sys.executable,
            "-m",
            "router",
            "serve",
            "--config",
            str(config),
            "--log-level",
            "warning",
        ],
        cwd=cwd,
        stdout=subprocess.DEVNULL if told else subprocess.PIPE,
        stderr=subprocess.DEVNULL if told else subprocess.STDOUT,
    )
    figures: dict[str, float] = {}
    try:
        if told:
            port = int(config.read_text().split('"127.0.0.1:', 1)[1].split('"', 1)[0])
        else:
            port = int(said(process, LISTENING).group(1).rsplit(":", 1)[1])
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=300, process=process)
        for workload, body in WORKLOADS.items():
            raw = raw_requests(body, varied, key)
            asyncio.run(load(port, raw, 200, 4))  # warm-up: connections, caches, lazy imports
            for old in tmp.glob(f"{out.name}.*"):
                old.unlink()
            callgrind_control(process.pid, "-i", "on")
            asyncio.run(load(port, raw, requests, 4))
            callgrind_control(process.pid, "-i", "off")
            callgrind_control(process.pid, "-d")
            time.sleep(0.5)
            total = 0
            for dump in tmp.glob(f"{out.name}.*"):
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy(dump, keep / f"{name.replace('@', '-')}-{workload}.callgrind")
                for line in dump.read_text(errors="replace").splitlines():
                    if line.startswith("summary:") or line.startswith("totals:"):
                        total = max(total, int(line.split()[1]))
            figures[workload] = total / requests
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return figures


def engine_runs(
    tmp: Path, requests: int, tree: Path | None = None, keep: Path | None = None
) -> dict[str, dict[str, float]]:
    """The working tree (`tree`: its compiled build) in front of a simulated vLLM engine (`router fake
    --engine vllm`), its load read (ORCA headers on short answers, /metrics while streams run) and not:
    what reading the engines costs a request."""
    prefix = "router-compiled-engines" if tree is not None else "router-engines"
    engine, url = start_fake(
        *("--model", "fast", "--model", "slow", "--model", "sleepy"),
        *("--engine", "vllm", "--time-scale", "100", "--max-running", "512"),
    )
    try:
        wait_http(url + "/v1/models", process=engine)
        off = measure(f"{prefix}-off", tree, tmp, url, requests, "engine_metrics_seconds = 0\n", keep=keep)
        # Read every 30 s: under callgrind a thousand requests take many seconds of wall time, and
        # reads at the default interval (a cost per second, bench/scale.py's engines target) would
        # land on each request; what is counted here is what a request itself costs.
        on = measure(prefix, tree, tmp, url, requests, "engine_metrics_seconds = 30\n", engine='"vllm"', keep=keep)
    finally:
        engine.terminate()
        engine.wait(timeout=20)
    return {f"{prefix}-off": off, prefix: on}


def traced_runs(tmp: Path, fake_url: str, requests: int) -> dict[str, dict[str, float]]:
    """The working tree with [tracing] on, every span exported to bench/otlp_sink.py, at sample_ratio 0 and 1."""
    sink = subprocess.Popen(
        [sys.executable, str(HERE / "otlp_sink.py")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        url = said(sink, re.compile(r"otlp sink on (\S+)")).group(1)
        out = {}
        for ratio in (0, 1):
            table = f'[tracing]\nendpoint = "{url}"\nsample_ratio = {ratio}\n'
            out[f"router-traced-{ratio}"] = measure(f"router-traced-{ratio}", None, tmp, fake_url, requests, table)
        return out
    finally:
        sink.terminate()
        sink.wait(timeout=20)


# A tenant with a key, counted: the limits' runs and their baseline.
KEYED = 'count_tokens = true\n[api_keys.bench]\nkey = "sk-bench"\ntenant = "bench"\n'
# Limits never reached: what checking them costs, not what refusing does.
LIMITED = KEYED + "tokens_per_minute = 1000000000\nrequests_per_minute = 1000000000\n"


def redis_calls(socket: Path) -> int:
    """The scripts Redis ran and loaded so far (INFO commandstats): the limits' round trips."""
    info = subprocess.run(
        ["redis-cli", "-s", str(socket), "INFO", "commandstats"], capture_output=True, text=True, check=True
    ).stdout
    return sum(
        int(m.group(1)) for m in re.finditer(r"^cmdstat_(?:evalsha|script\|load|select):calls=(\d+)", info, re.M)
    )


def limits_runs(
    tmp: Path, fake_url: str, requests: int, tree: Path | None = None, name: str = "router"
) -> dict[str, dict[str, float]]:
    """A tenant counted and not limited (router-keyed), limited in memory (router-limits) and through a
    redis-server on a Unix socket (router-limits-redis, with Redis's round trips per request); `tree`
    and `name`: the compiled build's (router-compiled-...)."""
    results = {
        f"{name}-keyed": measure(f"{name}-keyed", tree, tmp, fake_url, requests, KEYED, key="sk-bench"),
        f"{name}-limits": measure(f"{name}-limits", tree, tmp, fake_url, requests, LIMITED, key="sk-bench"),
    }
    server = shutil.which("redis-server")
    if server is None:
        print("redis-server is not installed: router-limits-redis left out", file=sys.stderr)
        return results
    socket = tmp / "redis.sock"
    redis = subprocess.Popen(
        [server, "--port", "0", "--unixsocket", str(socket), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(500):
            if socket.exists():
                break
            time.sleep(0.01)
        # A timeout far above callgrind's slowness: every request checked, none admitted unchecked.
        shared = LIMITED.replace(
            "[api_keys.bench]", f'[limits]\nredis_url = "unix://{socket}"\nredis_timeout_seconds = 5\n[api_keys.bench]'
        )
        before = redis_calls(socket)
        redis_run = f"{name}-limits-redis"
        results[redis_run] = measure(redis_run, tree, tmp, fake_url, requests, shared, key="sk-bench")
        # Each workload: a warm-up of 200, then the requests counted.
        sent = len(WORKLOADS) * (200 + requests)
        results[redis_run]["round_trips"] = (redis_calls(socket) - before) / sent
    finally:
        redis.terminate()
        redis.wait(timeout=20)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REF", action="append", default=[], help="a commit to compare with")
    parser.add_argument("--requests", type=int, default=2000, help="requests counted per workload")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="also run the working tree writing its access log to a file (router-logged)",
    )
    parser.add_argument(
        "--hold-configured",
        action="store_true",
        help="also run the working tree with cold_start_seconds on every model, nothing held (router-hold)",
    )
    parser.add_argument(
        "--routing",
        action="append",
        default=[],
        choices=["session", "prefix"],
        help="also run the working tree with this routing on every model (router-POLICY), and least_loaded "
        "(router-varied) as its baseline, both with 64 sessions and prompts in turn",
    )
    parser.add_argument(
        "--engine-metrics",
        action="store_true",
        help="also run the working tree in front of a simulated vLLM engine with its load read "
        '(every replica `engine = "vllm"`: router-engines), and with reading off '
        "(router-engines-off) as its baseline",
    )
    parser.add_argument(
        "--count-tokens",
        action="store_true",
        help="also run the working tree reading every answer's usage (count_tokens = true: router-tokens; "
        "with --compiled, its compiled build too: router-compiled-tokens)",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also run the working tree with [tracing] at sample_ratio 0 and 1 (router-traced-0, router-traced-1), "
        "exporting to a local sink that accepts everything (bench/otlp_sink.py)",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="also run a tenant's requests counted (router-keyed), under limits never reached in memory "
        "(router-limits) and in a redis-server (router-limits-redis, with Redis's round trips per request); "
        "with --compiled, the compiled build's too (router-compiled-keyed, -limits, -limits-redis)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also run the working tree's compiled build (scripts/compiled build: router-compiled), "
        "against which the ratios are then read",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        type=Path,
        help="keep the callgrind dumps of the working tree (and of its compiled build) in DIR, one per "
        "workload: bench/profile.py reads them",
    )
    args = parser.parse_args()
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        parser.error("valgrind is not installed (Debian's valgrind package)")
    with tempfile.TemporaryDirectory(prefix="router-instructions-") as tmpdir:
        tmp = Path(tmpdir)
        fake, fake_url = start_fake("--model", "fast", "--tokens", "64")
        results: dict[str, dict[str, float]] = {}
        try:
            wait_http(fake_url + "/v1/models", process=fake)
            results["router"] = measure("router", None, tmp, fake_url, args.requests, keep=args.profile)
            if args.compiled:
                tree = compiled_tree()
                if tree is None:
                    parser.error("the compiled build cannot be made here (scripts/compiled build)")
                results["router-compiled"] = measure(
                    "router-compiled", tree, tmp, fake_url, args.requests, keep=args.profile
                )
                if args.count_tokens:
                    results["router-compiled-tokens"] = measure(
                        "router-compiled-tokens",
                        tree,
                        tmp,
                        fake_url,
                        args.requests,
                        "count_tokens = true\n",
                        keep=args.profile,
                    )
            if args.access_log:
                logged = f'access_log = "{tmp / "access.log"}"\n'
                results["router-logged"] = measure("router-logged", None, tmp, fake_url, args.requests, logged)
            if args.count_tokens:
                results["router-tokens"] = measure(
                    "router-tokens", None, tmp, fake_url, args.requests, "count_tokens = true\n", keep=args.profile
                )
            if args.tracing:
                results.update(traced_runs(tmp, fake_url, args.requests))
            if args.hold_configured:
                hold = "".join(f'[models."{m}"]\ncold_start_seconds = 60\n' for m in ("fast", "slow", "sleepy"))
                results["router-hold"] = measure("router-hold", None, tmp, fake_url, args.requests, hold)
            if args.routing:
                results["router-varied"] = measure("router-varied", None, tmp, fake_url, args.requests, varied=True)
            for policy in args.routing:
                routing = "".join(f'[models."{m}"]\nrouting = "{policy}"\n' for m in ("fast", "slow", "sleepy"))
                results[f"router-{policy}"] = measure(
                    f"router-{policy}", None, tmp, fake_url, args.requests, routing, varied=True
                )
            if args.engine_metrics:
                results.update(engine_runs(tmp, args.requests, keep=args.profile))
                if args.compiled:
                    results.update(engine_runs(tmp, args.requests, compiled_tree(), keep=args.profile))
            if args.limits:
                results.update(limits_runs(tmp, fake_url, args.requests))
                if args.compiled and tree is not None:
                    results.update(limits_runs(tmp, fake_url, args.requests, tree, "router-compiled"))
            for ref in args.baseline:
                tree = checkout(ref, tmp / "trees" / ref)
                results[f"router@{ref}"] = measure(f"router@{ref}", tree, tmp, fake_url, args.requests)
        finally:
            fake.terminate()
            fake.wait(timeout=20)
    if args.json:
        print(json.dumps(results))
        return 0
    now = results["router"]
    print("| router | instructions per short request | per 64-chunk stream | per stream with its usage |")
    print("| --- | --- | --- | --- |")
    for name, figures in results.items():
        # A routing run is read against least_loaded with the same requests.
        base = results["router-varied"] if name in ("router-session", "router-prefix") else now
        # Engine-aware picks are read against the same simulated engine with reading off.
        base = results["router-engines-off"] if name == "router-engines" else base
        base = results["router-compiled-engines-off"] if name == "router-compiled-engines" else base
        # The compiled build reading usage is read against the compiled build not reading it.
        base = results["router-compiled"] if name == "router-compiled-tokens" else base
        # A limited tenant's requests are read against the same tenant's, counted and not limited.
        base = results["router-keyed"] if name.startswith("router-limits") else base
        base = results["router-compiled-keyed"] if name.startswith("router-compiled-limits") else base
        ratios = (
            ""
            if figures is base
            else " ({}: {:.3f}x, {:.3f}x, {:.3f}x)".format(
                "working tree" if base is now else next(k for k, v in results.items() if v is base),
                base["short"] / figures["short"],
                base["stream"] / figures["stream"],
                base["stream-usage"] / figures["stream-usage"],
            )
        )
        trips = f"; Redis round trips per request: {figures['round_trips']:.3f}" if "round_trips" in figures else ""
        print(
            f"| {name} | {figures['short']:,.0f} | {figures['stream']:,.0f} | {figures['stream-usage']:,.0f}"
            f"{ratios}{trips} |"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
