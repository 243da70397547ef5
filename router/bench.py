"""`router bench`: load against any OpenAI base URL.

Closed-loop: `concurrency` workers each send one request after another until
`requests` are done or `duration` has passed, whichever comes first. Reports
requests/s, latency and time-to-first-byte percentiles, and the errors seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp
import orjson
import uvloop


@dataclass(frozen=True, slots=True)
class BenchResult:
    requests: int
    errors: int
    seconds: float
    requests_per_second: float
    chunks: int
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    ttfb_p50_ms: float
    ttfb_p99_ms: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def run_load(
    base_url: str,
    *,
    model: str,
    concurrency: int,
    requests: int,
    duration: float,
    stream: bool,
    max_tokens: int = 16,
    path: str = "/v1/chat/completions",
) -> BenchResult:
    payload = orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "stream": stream}
    )
    url = base_url.rstrip("/") + path
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    chunks = 0
    remaining = requests
    deadline = time.perf_counter() + duration

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, errors, chunks
        while remaining > 0 and time.perf_counter() < deadline:
            remaining -= 1
            began = time.perf_counter()
            try:
                async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                    ttfbs.append(time.perf_counter() - began)
                    async for _ in resp.content.iter_any():
                        chunks += 1
                    if resp.status != 200:
                        errors += 1
                        continue
            except (aiohttp.ClientError, OSError, TimeoutError):
                errors += 1
                continue
            latencies.append(time.perf_counter() - began)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        seconds = time.perf_counter() - began
    latencies.sort()
    ttfbs.sort()
    done = len(latencies)
    return BenchResult(
        requests=done,
        errors=errors,
        seconds=seconds,
        requests_per_second=done / seconds if seconds > 0 else 0.0,
        chunks=chunks,
        latency_p50_ms=percentile(latencies, 0.5) * 1000,
        latency_p90_ms=percentile(latencies, 0.9) * 1000,
        latency_p99_ms=percentile(latencies, 0.99) * 1000,
        ttfb_p50_ms=percentile(ttfbs, 0.5) * 1000,
        ttfb_p99_ms=percentile(ttfbs, 0.99) * 1000,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="OpenAI base URL (without /v1)")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--concurrency", "-c", type=int, default=16)
    parser.add_argument("--requests", "-n", type=int, default=2000, help="stop after this many requests")
    parser.add_argument("--duration", "-d", type=float, default=10.0, help="or after this many seconds")
    parser.add_argument("--stream", action="store_true", help="ask for SSE streams")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.duration <= 0:
        parser.error("--concurrency and --requests must be at least 1, --duration above 0")
    result = uvloop.run(
        run_load(
            args.url,
            model=args.model,
            concurrency=args.concurrency,
            requests=args.requests,
            duration=args.duration,
            stream=args.stream,
            max_tokens=args.max_tokens,
            path=args.path,
        )
    )
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(
            f"{result.requests} requests in {result.seconds:.2f}s: {result.requests_per_second:.0f} req/s, "
            f"{result.errors} errors"
        )
        print(
            f"latency p50 {result.latency_p50_ms:.2f} ms, p90 {result.latency_p90_ms:.2f} ms, "
            f"p99 {result.latency_p99_ms:.2f} ms"
        )
        print(f"time to first byte p50 {result.ttfb_p50_ms:.2f} ms, p99 {result.ttfb_p99_ms:.2f} ms")
    return 0 if result.errors == 0 else 1
