"""Routing quality: this router's policies against SGLang's and vLLM's routers, in front of the same simulated engines.

    .venv/bin/python bench/routing.py [--workloads shared-prefix,multi-turn,mixed] [--loads 0.5,0.8,0.95]
                                      [--routers ...] [--seconds 60] [--time-scale 4] [--warmup S]
                                      [--set KEY=VALUE] [--model-set KEY=VALUE] [--json]

One fleet of 8 simulated vLLM engines (`router fake --engine vllm`,
router/tools/fake/engine.py: continuous batching, a paged KV cache with
prefix caching, chunked prefill, preemption; docs/routing.md says where its
figures come from), started afresh for every run so that no run inherits
another's caches. The same requests, drawn from the same seed, go through
each router in turn:

- `least_loaded`, `session`, `prefix`: this router's policies with engine
  metrics off (what it did before it read the engines);
- `engine`: least-loaded with engine metrics on (read every 50 ms, as the
  Gateway API Inference Extension's endpoint picker reads them), and
  `engine-session`, `engine-prefix`: session and prefix routing with them;
  `engine-spread[N]`: engine-aware session routing with `prefix_replicas = N`
  (2 unless named: each system prompt's sessions over its N replicas);
  `engine-prefixN`: engine-aware prefix routing with `prefix_replicas = N`
  (each request of a prefix to the least loaded of its N nearest replicas);
  `engine-learned[N]`: engine-aware prefix routing with
  `prefix_placement = "learned"` (and `prefix_replicas = N`, where named);
- `sglang-cache_aware`: SGLang's router, its default policy (cache_aware);
- `vllm-cache_aware`: vLLM's router (vllm-router), its cache-aware default;
- `vllm-power_of_two`: vLLM's router's load policy: two replicas drawn at
  random, the one with the lower load taken, the loads polled from each
  engine's `GET /get_load` (`{"load": N}`, vllm-project/router's
  src/routers/http/router.rs; the simulated vLLM engine serves it, its
  requests running plus waiting) every `--worker-startup-check-interval`
  seconds, here 1 (its default, 30, would read each engine once a run);
- `engine-x2`: two of this router, engine-aware, each sent half the load.

Workloads (engine time; `--time-scale` runs it faster than wall time):

- `shared-prefix`: SGLang's generated-shared-prefix set: 32 groups of prompts
  sharing a 2,048-token system prompt, each request one of its group's
  questions (128 tokens), groups drawn by a Zipf law (s = 1.1: a few
  popular prefixes, a long tail);
- `multi-turn`: chat sessions of 6 turns, each turn 150 tokens more, with
  a think time of 2 s on average between an answer and the next turn;
- `mixed`: prompts of 600 tokens, one in ten 50 times longer (30,000).

Every answer is 32 tokens, streamed. Each workload's capacity is measured
first: least_loaded at a rate the fleet cannot take, its completed requests
a second; the runs then send Poisson arrivals at 50%, 80% and 95% of it.
Reported per run: time to first token p50 and p99, end-to-end p99, completed
requests a second, the prefix cache's hit rate (cached over prompt tokens,
from the answers' usage) and the spread of load (the engines' running plus
waiting, max over mean, sampled every 100 ms and averaged). With
`--warmup S`, also the TTFT p99 of the requests sent after the first S
engine seconds: a fleet's steady state, its caches filled, where the whole
run's p99 counts each prefix's first prefill on each replica it reaches
(a fresh fleet's first minute). Each run's line also says what its slowest
1% were: the share that prefilled their prompt cold (`tail_cold_prefill`,
found under half of it cached), the share sent in the warm-up
(`tail_in_warmup`), how many were sent in each engine second
(`tail_by_second`), and the cold share of the warm requests' slowest 1%
(`warm_tail_cold_prefill`). The target: at
80% load, TTFT p99 at most 0.8 times the best of every other router and
policy, and p50 never worse than least_loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".cache" / "peers"
ENGINES = 8
OUTPUT_TOKENS = 32
WORDS = "the of and to in is that for it as with was on be by at this had not are but from or have an".split()  # noqa: SIM905
ROUTERS = (
    "least_loaded",
    "session",
    "prefix",
    "engine",
    "engine-session",
    "engine-prefix",
    "sglang-cache_aware",
    "vllm-cache_aware",
    "vllm-power_of_two",
    "engine-x2",
    "engine-spread",
)
WORKLOADS = ("shared-prefix", "multi-turn", "mixed")


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text (four characters a token, as the simulated engine counts them)."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


class Sent(NamedTuple):
    """One completed request, for the tail's make-up."""

    ttft: float
    # The share of its prompt the engine found cached (its usage's cached_tokens over prompt_tokens).
    cached: float
    in_warmup: bool
    # Engine seconds from the run's start.
    sent_at: float


def slowest_percent(requests: list[Sent]) -> list[Sent]:
    return sorted(requests, reverse=True)[: max(1, len(requests) // 100)] if requests else []


def share(requests: list[Sent], test: Callable[[Sent], bool]) -> float | None:
    return sum(1 for r in requests if test(r)) / len(requests) if requests else None


@dataclass
class Results:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    sent: int = 0
    completed: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spreads: list[float] = field(default_factory=list)
    # Times to first token of the requests sent after the warm-up (--warmup).
    ttft_warm: list[float] = field(default_factory=list)
    # Every completed request that said its usage: what the slowest 1% were (tail_*).
    requests: list[Sent] = field(default_factory=list)

    def summary(self, seconds: float, scale: float) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return scale * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        # The slowest 1% of the run, and of the requests sent after the warm-up: what share of them
        # prefilled their prompt cold (found under half of it cached), and when they were sent.
        slowest = slowest_percent(self.requests)
        slowest_warm = slowest_percent([r for r in self.requests if not r.in_warmup])
        return {
            "ttft_p50_s": pct(self.ttft, 0.5),
            "ttft_p99_s": pct(self.ttft, 0.99),
            "ttft_p99_warm_s": pct(self.ttft_warm, 0.99),
            "e2e_p99_s": pct(self.e2e, 0.99),
            "offered_rps": self.sent / seconds,
            "throughput_rps": self.completed / seconds,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "max_over_mean": statistics.fmean(self.spreads) if self.spreads else None,
            "tail_cold_prefill": share(slowest, lambda r: r.cached < 0.5),
            "tail_in_warmup": share(slowest, lambda r: r.in_warmup),
            "warm_tail_cold_prefill": share(slowest_warm, lambda r: r.cached < 0.5),
            # How many of the slowest 1% were sent in each engine second of the run.
            "tail_by_second": sorted(Counter(int(r.sent_at) for r in slowest).items()),
            "completed": self.completed,
            "errors": self.errors,
        }


# The fleet and the routers -------------------------------------------------------------


def launch(command: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """`command` started, its output piped to be read (started_at), or with `log` appended to that file.

    A process whose pipe nobody reads stops at the write that finds it full (64 KiB on
    Linux) and, a router, answers nothing from then on: a peer, whose address is known
    beforehand and whose output no one reads, writes to a file.
    """
    environment = {**os.environ, **(env or {})}
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, cwd=ROOT)
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=ROOT)


def started_at(process: subprocess.Popen[bytes], marker: bytes, timeout: float = 60) -> str:
    """The URL a process prints once it listens (the line holding `marker`)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"{process.args!r} exited before it listened")
        if marker in line:
            # What it prints from now on is read and dropped: a full pipe would stop it.
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return next(w for w in line.decode().split() if w.startswith("http://")).rstrip(",")
    raise RuntimeError(f"{process.args!r} did not say where it listens")


def start_engines(scale: float) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    processes, urls = [], []
    for _ in range(ENGINES):
        process = launch(
            [
                *(sys.executable, "-m", "router.tools.fake", "--port", "0", "--model", "m"),
                *("--engine", "vllm", "--time-scale", str(scale), "--tokens", "100000"),
            ]
        )
        processes.append(process)
        urls.append(started_at(process, b"fake replica"))
    return processes, urls


def wait_http(url: str, timeout: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_router(
    name: str, urls: list[str], tmp: Path, extra: list[str], model_extra: list[str]
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """The router `name` in front of `urls`: its processes and the client URLs to send to."""
    if name.startswith(("sglang-", "vllm-")):
        peer, policy = name.split("-", 1)
        port = free_port()
        if peer == "sglang":
            command = [str(PEERS / "sglang-router" / "bin" / "python"), "-m", "sglang_router.launch_router"]
        else:
            command = [str(PEERS / "vllm-router" / "bin" / "vllm-router")]
        command += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy]
        command += ["--prometheus-port", str(free_port())]
        if peer == "sglang":
            command += ["--tokenizer-path", str(tmp / "tokenizer.json"), "--log-level", "warn"]
        else:
            # Its launcher offers debug, info, warning, error and critical, but its Rust side parses the
            # name as a tracing level, which knows `warn`, not `warning`: `warning` (or `critical`) is
            # INFO there, silently, and at INFO power_of_two logs a line for every request it routes.
            command += ["--log-level", "error"]
            if policy == "power_of_two":
                # Its engines' loads are polled at this interval (seconds; 30 by default).
                command += ["--worker-startup-check-interval", "1"]
        process = launch(command, log=tmp / f"{name}.log")
        wait_http(f"http://127.0.0.1:{port}/v1/models")
        return [process], [f"http://127.0.0.1:{port}"]
    count = 2 if name.endswith("-x2") else 1
    routing = name.removeprefix("engine-")
    # engine-spread[N]: session routing, each prefix's sessions over prefix_replicas (2) replicas;
    # engine-prefixN: prefix routing, each prefix's requests over its N nearest (prefix_replicas).
    # engine-learned[N]: prefix routing, each prefix's replicas learned (prefix_placement), at most N.
    replicas = placement = ""
    if routing.startswith("spread"):
        routing, replicas = "session", routing.removeprefix("spread") or "2"
    elif routing.startswith("prefix") and routing != "prefix":
        routing, replicas = "prefix", routing.removeprefix("prefix")
    elif routing.startswith("learned"):
        routing, replicas, placement = "prefix", routing.removeprefix("learned"), "learned"
    routing = routing if routing in ("prefix", "session") else "least_loaded"
    metrics = "0.05" if name.startswith("engine") else "0"
    processes, clients = [], []
    for index in range(count):
        config = tmp / f"{name}-{index}.toml"
        lines = [
            'listen = "127.0.0.1:0"',
            'admin_listen = "127.0.0.1:0"',
            f"engine_metrics_seconds = {metrics}",
            "queue_timeout_seconds = 600",
            *extra,
        ]
        for i, url in enumerate(urls):
            lines += ["[[replicas]]", f'id = "e{i}"', 'model = "m"', f'url = "{url}"', 'engine = "vllm"']
        lines += ['[models."m"]', f'routing = "{routing}"']
        if replicas:
            lines.append(f"prefix_replicas = {replicas}")
        if placement:
            lines.append(f'prefix_placement = "{placement}"')
        lines += model_extra
        config.write_text("\n".join(lines) + "\n")
        process = launch([sys.executable, "-m", "router", "serve", "--config", str(config), "--log-level", "info"])
        processes.append(process)
        clients.append(started_at(process, b"router listening on"))
    return processes, clients


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# The load ----------------------------------------------------------------------------------


class Load:
    """One run's requests: what each workload sends, when, and what came back."""

    def __init__(
        self,
        workload: str,
        rate: float,
        seconds: float,
        scale: float,
        clients: list[str],
        flood: bool = False,
        warmup: float = 0.0,
    ) -> None:
        # A flood (the capacity's measure): what is still under way when the time is up is dropped,
        # and only what completed within the time counts.
        self.flood = flood
        self.end = 0.0
        # Engine seconds at the start left out of the warm TTFT (--warmup), and when they end.
        self.warmup = warmup
        self.warm_from = 0.0
        self.started = 0.0
        self.workload = workload
        self.rate = rate
        self.seconds = seconds
        self.scale = scale
        self.clients = clients
        self.results = Results()
        self.rng = random.Random(20261204)
        self.systems = [words(random.Random(100 + g), 2048) for g in range(32)]
        # Zipf popularity of the shared prefixes (s = 1.1).
        weights = [1 / (g + 1) ** 1.1 for g in range(32)]
        total = sum(weights)
        self.popularity = [w / total for w in weights]
        self._turn = 0

    def client(self) -> str:
        self._turn += 1
        return self.clients[self._turn % len(self.clients)]

    async def one(self, session: aiohttp.ClientSession, messages: list[dict[str, str]], key: str) -> str:
        body = {
            "model": "m",
            "messages": messages,
            "max_tokens": OUTPUT_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.results.sent += 1
        began = time.perf_counter()
        first: float | None = None
        reply: list[str] = []
        usage: dict[str, Any] | None = None
        try:
            url = self.client() + "/v1/chat/completions"
            async with session.post(url, json=body, headers={"X-Session-Id": key}) as resp:
                if resp.status != 200:
                    self.results.errors += 1
                    await resp.read()
                    return ""
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices", ()):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter() - began
                            reply.append(piece)
        except (aiohttp.ClientError, TimeoutError):
            self.results.errors += 1
            return ""
        if first is None:
            self.results.errors += 1
            return ""
        results = self.results
        results.ttft.append(first)
        if began >= self.warm_from:
            results.ttft_warm.append(first)
        results.e2e.append(time.perf_counter() - began)
        if self.flood and time.perf_counter() > self.end:
            return "".join(reply)
        results.completed += 1
        if usage is not None:
            prompt = usage["prompt_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            results.prompt_tokens += prompt
            results.cached_tokens += cached
            sent_at = (began - self.started) * self.scale
            results.requests.append(Sent(first, cached / prompt if prompt else 0.0, began < self.warm_from, sent_at))
        return "".join(reply)

    async def run(self) -> Results:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks: list[asyncio.Task[Any]] = []
            wall = self.seconds / self.scale
            self.started = time.perf_counter()
            end = self.end = self.started + wall
            self.warm_from = end - wall + self.warmup / self.scale
            # Arrivals on a schedule of their own, not a sleep after each: a generator that falls
            # behind (a busy machine) catches up, and the offered rate stays the rate asked for.
            next_at = time.perf_counter()
            n = 0
            # Sessions of six turns: a session's requests per second is its turns over its life.
            rate = self.rate / 6 if self.workload == "multi-turn" else self.rate
            while next_at < end:
                if self.workload == "multi-turn":
                    tasks.append(asyncio.create_task(self.conversation(session, n, end)))
                else:
                    tasks.append(asyncio.create_task(self.single(session, n)))
                n += 1
                next_at += self.rng.expovariate(rate) / self.scale
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if self.flood:
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=self.flood)
        return self.results

    async def single(self, session: aiohttp.ClientSession, n: int) -> None:
        rng = random.Random(n)
        if self.workload == "shared-prefix":
            group = rng.choices(range(32), self.popularity)[0]
            messages = [
                {"role": "system", "content": self.systems[group]},
                {"role": "user", "content": words(rng, 128)},
            ]
            await self.one(session, messages, f"group-{group}")
        else:
            tokens = 30_000 if rng.random() < 0.1 else 600
            await self.one(session, [{"role": "user", "content": words(rng, tokens)}], f"request-{n}")

    async def conversation(self, session: aiohttp.ClientSession, sid: int, end: float) -> None:
        rng = random.Random(10_000 + sid)
        messages = [{"role": "system", "content": self.systems[sid % 32][:2000]}]
        for _ in range(6):
            messages.append({"role": "user", "content": words(rng, 150)})
            reply = await self.one(session, messages, f"session-{sid}")
            messages.append({"role": "assistant", "content": reply})
            if time.perf_counter() > end:
                return
            await asyncio.sleep(rng.expovariate(1 / 2.0) / self.scale)


async def sample_spread(urls: list[str], results: Results, stop_event: asyncio.Event) -> None:
    """The engines' running plus waiting, max over mean, every 100 ms (where the mean is at least 1)."""
    async with aiohttp.ClientSession() as session:
        while not stop_event.is_set():
            loads = []
            for url in urls:
                async with session.get(url + "/metrics") as resp:
                    text = await resp.text()
                figure = 0.0
                for line in text.splitlines():
                    if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                        figure += float(line.rsplit(" ", 1)[1])
                loads.append(figure)
            mean = sum(loads) / len(loads)
            if mean >= 1:
                results.spreads.append(max(loads) / mean)
            try:
                await asyncio.wait_for(stop_event.wait(), 0.1)
            except TimeoutError:
                pass


async def measure(load: Load, engines: list[str]) -> Results:
    stop_event = asyncio.Event()
    sampler = asyncio.create_task(sample_spread(engines, load.results, stop_event))
    try:
        return await load.run()
    finally:
        stop_event.set()
        await sampler


def run(
    router: str, workload: str, rate: float, args: argparse.Namespace, tmp: Path, flood: bool = False
) -> dict[str, Any]:
    engines, urls = start_engines(args.time_scale)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes, clients = start_router(router, urls, tmp, args.set, args.model_set)
        load = Load(workload, rate, args.seconds, args.time_scale, clients, flood, args.warmup)
        results = asyncio.run(measure(load, urls))
        return results.summary(args.seconds, args.time_scale)
    finally:
        stop(processes)
        stop(engines)


def capacity(workload: str, args: argparse.Namespace, tmp: Path) -> float:
    """Completed requests a second (engine time) of least_loaded at a rate the fleet cannot take."""
    flood = {"shared-prefix": 400.0, "multi-turn": 400.0, "mixed": 200.0}[workload]
    summary = run("least_loaded", workload, flood, args, tmp, flood=True)
    return float(summary["throughput_rps"])


def write_tokenizer(tmp: Path) -> None:
    # A one-word tokenizer, so that SGLang's router loads a local file instead of a hub's.
    (tmp / "tokenizer.json").write_text(
        json.dumps(
            {
                "version": "1.0",
                "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1}, "unk_token": "[UNK]"},
                "pre_tokenizer": {"type": "Whitespace"},
                "added_tokens": [],
                "normalizer": None,
                "post_processor": None,
                "decoder": None,
                "truncation": None,
                "padding": None,
            }
        )
    )


def table(results: dict[str, dict[str, dict[str, dict[str, Any]]]], warm: bool = False) -> str:
    lines = []
    for workload, by_load in results.items():
        for load, by_router in by_load.items():
            if load == "capacity":
                continue
            lines += [f"\n{workload}, {load} of capacity ({by_load['capacity']['rps']['rps']:.1f} requests/s):\n"]
            lines += [
                "| router | TTFT p50 s | TTFT p99 s | "
                + ("TTFT p99 warm s | " if warm else "")
                + "e2e p99 s | sent/s | done/s | prefix hits | max/mean load | errors |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if warm else ""),
            ]
            for router, r in by_router.items():

                def f(value: Any, pattern: str) -> str:
                    return (
                        "-"
                        if value is None or (isinstance(value, float) and math.isnan(value))
                        else pattern.format(value)
                    )

                warm_p99 = f"| {f(r['ttft_p99_warm_s'], '{:.3f}')} " if warm else ""
                lines.append(
                    f"| {router} | {f(r['ttft_p50_s'], '{:.3f}')} | {f(r['ttft_p99_s'], '{:.3f}')} {warm_p99}"
                    f"| {f(r['e2e_p99_s'], '{:.2f}')} | {f(r['offered_rps'], '{:.1f}')} "
                    f"| {f(r['throughput_rps'], '{:.1f}')} "
                    f"| {f(r['hit_rate'], '{:.0%}')} | {f(r['max_over_mean'], '{:.2f}')} | {r['errors']} |"
                )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default="0.5,0.8,0.95")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seconds", type=float, default=60.0, help="engine seconds of load per run")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="engine seconds at the start of each run left out of the warm TTFT p99 (the caches filling)",
    )
    parser.add_argument("--capacity", action="append", default=[], metavar="WORKLOAD=RPS", help="skip measuring it")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a top-level setting of this router's runs"
    )
    parser.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the model's table in this router's runs (balance_factor=2)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    known = dict(spec.split("=") for spec in args.capacity)
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="router-routing-") as tmpdir:
        tmp = Path(tmpdir)
        write_tokenizer(tmp)
        for workload in args.workloads.split(","):
            rps = float(known[workload]) if workload in known else capacity(workload, args, tmp)
            print(f"{workload}: capacity {rps:.1f} requests/s", file=sys.stderr)
            results[workload] = {"capacity": {"rps": {"rps": rps}}}
            for share in args.loads.split(","):
                by_router = results[workload].setdefault(f"{float(share):.0%}", {})
                for router in args.routers.split(","):
                    summary = run(router, workload, rps * float(share), args, tmp)
                    by_router[router] = summary
                    print(f"{workload} {share} {router}: {summary}", file=sys.stderr)
    print(json.dumps(results) if args.json else table(results, warm=args.warmup > 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
