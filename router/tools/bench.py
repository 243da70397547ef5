"""`router bench`: load against any OpenAI base URL.

Closed-loop: `concurrency` workers each send one request after another until
`requests` are done or `duration` has passed, whichever comes first. Reports
requests/s, latency and time-to-first-byte percentiles, and the errors seen.

Against a router with `api_keys`, `--api-key` (or $OPENAI_API_KEY, as the
openai SDK reads it) is sent as a bearer token; `--header` adds any header.
A mix of tenants and priority classes: `--key KEY=WEIGHT` and
`--priority CLASS=WEIGHT` (each repeatable) give each request a key and an
X-Priority drawn by weight, and the report gives each pair's figures apart
(a key shown by its last four characters only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp
import orjson
import uvloop

# Kinds of error kept apart; more are counted under one "other kinds" line, so a message that
# differs per request (an id in it) cannot grow the report without bound.
MAX_ERROR_KINDS = 20
OTHER_KINDS = "other kinds"
# Defaults when neither a count nor a duration is given.
DEFAULT_REQUESTS = 2000
DEFAULT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class BenchResult:
    """One router bench run's figures: requests per second, latency and time to first token."""

    requests: int
    errors: int
    seconds: float
    requests_per_second: float
    chunks: int
    # None when no request succeeded: there is nothing to take a percentile of.
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    ttfb_p50_ms: float | None
    ttfb_p99_ms: float | None
    # What went wrong, counted by kind: "503 no_replica_available: <message>", or an exception.
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    # With a mix of keys or priorities: each pair's figures ("key ...abcd, priority batch").
    groups: dict[str, GroupResult] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GroupResult:
    """One key and priority pair's share of a mixed run."""

    requests: int
    errors: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    ttfb_p50_ms: float | None


@dataclass(frozen=True, slots=True)
class Mix:
    """Who sends: the keys and priority classes drawn by weight for each request, and fixed headers."""

    keys: tuple[tuple[str, float], ...] = ()
    priorities: tuple[tuple[str, float], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()

    def draw(self, rng: random.Random) -> tuple[str | None, str | None]:
        key = rng.choices([k for k, _ in self.keys], [w for _, w in self.keys])[0] if self.keys else None
        priority = (
            rng.choices([p for p, _ in self.priorities], [w for _, w in self.priorities])[0]
            if self.priorities
            else None
        )
        return key, priority


def group_name(key: str | None, priority: str | None) -> str:
    """A pair's name in the report: never the key itself."""
    parts = []
    if key is not None:
        parts.append(f"key ...{key[-4:]}" if len(key) > 8 else "key ...")
    if priority is not None:
        parts.append(f"priority {priority}")
    return ", ".join(parts)


def percentile_ms(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index] * 1000


def describe_answer(status: int, body: bytes) -> str:
    """One line for an error answer: its status and, for an OpenAI-shaped error, code and message."""
    try:
        error = orjson.loads(body)["error"]
        code = error.get("code") or error.get("type") or ""
        message = str(error.get("message", ""))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        code = ""
        message = body.decode("utf-8", "replace").strip()
    text = f"{status} {code}".rstrip()
    if message:
        text += ": " + " ".join(message.split())
    return text[:200]


def describe_exception(exc: BaseException) -> str:
    text = str(exc)
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:200]


def endpoint(base_url: str, path: str) -> str:
    """`path` under `base_url`, given with /v1 (as the openai SDK's base_url wants it) or without."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base.removesuffix("/v1")
    return base + path


async def run_load(
    base_url: str,
    *,
    model: str,
    concurrency: int,
    requests: int | None,
    duration: float | None,
    stream: bool,
    max_tokens: int = 16,
    path: str = "/v1/chat/completions",
    mix: Mix = Mix(),
    seed: int = 0,
) -> BenchResult:
    """Run until `requests` are done or `duration` has passed (None: no such limit; not both None)."""
    if requests is None and duration is None:
        raise ValueError("run_load needs a request count, a duration, or both")
    payload = orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "stream": stream}
    )
    url = endpoint(base_url, path)
    latencies: list[float] = []
    ttfbs: list[float] = []
    kinds: Counter[str] = Counter()
    chunks = 0
    remaining = requests if requests is not None else -1
    deadline = math.inf
    rng = random.Random(seed)
    base_headers = {"Content-Type": "application/json", **dict(mix.headers)}
    mixed = bool(mix.keys or mix.priorities)
    # Per key and priority pair: latencies, first bytes, errors.
    by_group: dict[str, tuple[list[float], list[float], list[int]]] = {}

    def failed(kind: str) -> None:
        if kind in kinds or len(kinds) < MAX_ERROR_KINDS:
            kinds[kind] += 1
        else:
            kinds[OTHER_KINDS] += 1

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, chunks
        while remaining != 0 and time.perf_counter() < deadline:
            remaining -= 1
            headers = base_headers
            group: tuple[list[float], list[float], list[int]] | None = None
            if mixed:
                key, priority = mix.draw(rng)
                headers = dict(base_headers)
                if key is not None:
                    headers["Authorization"] = f"Bearer {key}"
                if priority is not None:
                    headers["X-Priority"] = priority
                group = by_group.setdefault(group_name(key, priority), ([], [], [0]))
            began = time.perf_counter()
            try:
                async with session.post(url, data=payload, headers=headers) as resp:
                    ttfb = time.perf_counter() - began
                    ttfbs.append(ttfb)
                    if resp.status != 200:
                        failed(describe_answer(resp.status, await resp.read()))
                        if group is not None:
                            group[2][0] += 1
                        continue
                    async for _ in resp.content.iter_any():
                        chunks += 1
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                failed(describe_exception(exc))
                if group is not None:
                    group[2][0] += 1
                continue
            latency = time.perf_counter() - began
            latencies.append(latency)
            if group is not None:
                group[0].append(latency)
                group[1].append(ttfb)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.perf_counter()
        # The run's time counts from here, as `seconds` does: set before the
        # session was made, the deadline ended runs short of --duration.
        if duration is not None:
            deadline = began + duration
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        seconds = time.perf_counter() - began
    latencies.sort()
    ttfbs.sort()
    done = len(latencies)
    return BenchResult(
        requests=done,
        errors=sum(kinds.values()),
        seconds=seconds,
        requests_per_second=done / seconds if seconds > 0 else 0.0,
        chunks=chunks,
        latency_p50_ms=percentile_ms(latencies, 0.5),
        latency_p90_ms=percentile_ms(latencies, 0.9),
        latency_p99_ms=percentile_ms(latencies, 0.99),
        ttfb_p50_ms=percentile_ms(ttfbs, 0.5),
        ttfb_p99_ms=percentile_ms(ttfbs, 0.99),
        errors_by_kind=dict(kinds.most_common()),
        groups={name: _group(*figures) for name, figures in sorted(by_group.items())},
    )


def _group(latencies: list[float], ttfbs: list[float], errors: list[int]) -> GroupResult:
    latencies.sort()
    ttfbs.sort()
    return GroupResult(
        requests=len(latencies),
        errors=errors[0],
        latency_p50_ms=percentile_ms(latencies, 0.5),
        latency_p99_ms=percentile_ms(latencies, 0.99),
        ttfb_p50_ms=percentile_ms(ttfbs, 0.5),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def report(result: BenchResult) -> str:
    lines = [
        f"{result.requests} requests in {result.seconds:.2f}s: {result.requests_per_second:.0f} req/s, "
        f"{result.errors} errors",
        f"latency p50 {_ms(result.latency_p50_ms)}, p90 {_ms(result.latency_p90_ms)}, p99 {_ms(result.latency_p99_ms)}",
        f"time to first byte p50 {_ms(result.ttfb_p50_ms)}, p99 {_ms(result.ttfb_p99_ms)}",
    ]
    for name, group in result.groups.items():
        lines.append(
            f"  {name}: {group.requests} requests, {group.errors} errors, latency p50 "
            f"{_ms(group.latency_p50_ms)}, p99 {_ms(group.latency_p99_ms)}, first byte p50 {_ms(group.ttfb_p50_ms)}"
        )
    if result.errors_by_kind:
        lines.append("errors:")
        lines += [f"{count:>8}  {kind}" for kind, count in result.errors_by_kind.items()]
    return "\n".join(lines)


def limits(requests: int | None, duration: float | None) -> tuple[int | None, float | None]:
    """The count and time limits a run keeps: each as given, the defaults only when neither is."""
    if requests is None and duration is None:
        return DEFAULT_REQUESTS, DEFAULT_SECONDS
    return requests, duration


def _weighted(spec: str, option: str) -> tuple[str, float]:
    """NAME or NAME=WEIGHT; a key whose own text ends in '=' (base64) is a name, its weight 1."""
    name, _, weight = spec.rpartition("=")
    try:
        figure = float(weight) if name else 1.0
    except ValueError:
        name, figure = spec, 1.0
    if not name:
        name = spec
    if not name or not (0 < figure < math.inf):
        raise ValueError(f"{option} {spec!r}: give NAME or NAME=WEIGHT, the weight a number above 0")
    return name, figure


def parse_mix(api_key: str | None, headers: Sequence[str], keys: Sequence[str], priorities: Sequence[str]) -> Mix:
    """The command line's keys, priorities and headers; ValueError naming the one that is malformed."""
    fixed: list[tuple[str, str]] = []
    for header in headers:
        name, sep, value = header.partition(":")
        if not sep or not name.strip() or any(c in name for c in " \t\r\n") or any(c in value for c in "\r\n"):
            raise ValueError(f"--header {header!r}: give 'NAME: VALUE'")
        fixed.append((name.strip(), value.strip()))
    weighted_keys = tuple(_weighted(spec, "--key") for spec in keys)
    if not weighted_keys and api_key:
        fixed.append(("Authorization", f"Bearer {api_key}"))
    return Mix(weighted_keys, tuple(_weighted(spec, "--priority") for spec in priorities), tuple(fixed))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the router's client URL, with /v1 or without")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--concurrency", "-c", type=int, default=16)
    parser.add_argument(
        "--requests",
        "-n",
        type=int,
        help=f"stop after this many requests (alone: no time limit; neither: {DEFAULT_REQUESTS} or "
        f"{DEFAULT_SECONDS:.0f}s, whichever comes first)",
    )
    parser.add_argument("--duration", "-d", type=float, help="stop after this many seconds (alone: no count limit)")
    parser.add_argument("--stream", action="store_true", help="ask for SSE streams")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token (default: $OPENAI_API_KEY, as the openai SDK reads it)",
    )
    parser.add_argument(
        "--header", action="append", default=[], metavar="'NAME: VALUE'", help="a header of every request (repeatable)"
    )
    parser.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY[=WEIGHT]",
        help="a tenant's key, drawn by weight for each request (repeatable; instead of --api-key)",
    )
    parser.add_argument(
        "--priority",
        action="append",
        default=[],
        metavar="CLASS[=WEIGHT]",
        help="an X-Priority class, drawn by weight for each request (repeatable)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.duration is not None and not (0 < args.duration < math.inf):
        parser.error("--duration must be a number of seconds above 0")
    args.requests, args.duration = limits(args.requests, args.duration)
    try:
        mix = parse_mix(args.api_key, args.header, args.key, args.priority)
    except ValueError as exc:
        parser.error(str(exc))
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
            mix=mix,
        )
    )
    # JSON has no NaN: a percentile of nothing is null.
    print(json.dumps(asdict(result)) if args.json else report(result))
    return 0 if result.errors == 0 else 1
