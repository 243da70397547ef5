"""Session and prefix affinity against least-loaded: what the engines' prefix caches get out of it.

    .venv/bin/python bench/affinity.py [--sessions 200] [--turns 8] [--json]

Four fake replicas (router.tools.fake, one process each) keep a prefix cache as
vLLM does: the prompt in blocks of 64 characters, an LRU of `--cache-blocks`
blocks per replica, a block found only after the blocks before it; the part
of a prompt not found costs prefill time before the first token, and the
part found comes back in usage.prompt_tokens_details.cached_tokens; the
answer's blocks are cached too, as an engine keeps the KV it generated. The
cache (2,000 blocks) holds the conversations going on at once on one
replica when each conversation stays on one replica (about 700 blocks),
not all of them (about 2,900) as least-loaded needs.

A multi-turn chat is replayed through `router serve` once per policy
(least_loaded, session, prefix), each time with fresh replicas: `--sessions`
conversations start at Poisson times, each on one of five shared system
prompts; each turn adds a user message and, once answered, the assistant's
reply, then the next turn follows after an exponential think time. Session
routing is keyed by X-Session-Id; prefix routing by the first 1024
characters of the prompt, which reach past the system prompt into the
conversation's first message.

Reported per policy: the prefix-cache hit rate (cached over prompt tokens,
all requests), time to first token p50 and p99 (client side, streamed), and
the max/mean ratio of requests in flight over the replicas (the router's
own figures, sampled every 50 ms while the load runs, averaged where the
mean is at least 1). Targets: session and prefix hit rate >= 85%, max/mean
<= 1.3. The CPU cost per request of the policies is bench/instructions.py's
`--routing session --routing prefix`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import fake, serve, wait_http  # noqa: E402

POLICIES = ("least_loaded", "session", "prefix")
REPLICAS = 4
WORDS = "the of and to in is that for it as with was on be by at this had not are but from or have an".split()  # noqa: SIM905


@dataclass
class Results:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0
    # router_affinity_total at the end, by outcome.
    outcomes: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "ttft_p50_ms": 1000 * ttft[len(ttft) // 2] if ttft else None,
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else None,
            "max_over_mean": statistics.fmean(self.ratios) if self.ratios else None,
            "spilled": self.outcomes.get("spill", 0) / self.requests if self.requests else None,
        }


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


async def conversation(
    session: aiohttp.ClientSession, url: str, sid: int, args: argparse.Namespace, systems: list[str], out: Results
) -> None:
    rng = random.Random(sid)
    messages: list[dict[str, str]] = [{"role": "system", "content": systems[sid % len(systems)]}]
    for _ in range(args.turns):
        messages.append({"role": "user", "content": text(rng, args.message_chars)})
        body = {
            "model": "chat",
            "messages": messages,
            "max_tokens": args.tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        began = time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] | None = None
        reply: list[str] = []
        out.requests += 1
        try:
            async with session.post(url, json=body, headers={"X-Session-Id": f"conversation-{sid}"}) as resp:
                if resp.status != 200:
                    out.errors += 1
                    await resp.read()
                    return
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
        except aiohttp.ClientError:
            out.errors += 1
            return
        if first is not None:
            out.ttft.append(first)
        if usage is not None:
            out.prompt_tokens += usage["prompt_tokens"]
            out.cached_tokens += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        messages.append({"role": "assistant", "content": "".join(reply)})
        await asyncio.sleep(rng.expovariate(1 / args.think))


async def sample_load(admin: str, out: Results, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(admin + "/api/v1/replicas") as resp:
                rows = await resp.json()
            loads = [row["in_flight"] for row in rows]
            mean = sum(loads) / len(loads) if loads else 0
            if mean >= 1:
                out.ratios.append(max(loads) / mean)
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass


async def replay(port: int, admin: int, args: argparse.Namespace) -> Results:
    out = Results()
    systems = [f"You are assistant number {i}. " + text(random.Random(1000 + i), 800) for i in range(5)]
    rng = random.Random(7)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        sampler = asyncio.create_task(sample_load(f"http://127.0.0.1:{admin}", out, stop))
        tasks = []
        for sid in range(args.sessions):
            tasks.append(
                asyncio.create_task(
                    conversation(session, f"http://127.0.0.1:{port}/v1/chat/completions", sid, args, systems, out)
                )
            )
            await asyncio.sleep(rng.expovariate(args.sessions / args.arrival_seconds))
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
        await asyncio.sleep(1.5)  # a tick, so that /metrics has every request
        async with session.get(f"http://127.0.0.1:{admin}/metrics") as resp:
            for family in text_string_to_metric_families(await resp.text()):
                for sample in family.samples:
                    if sample.name == "router_affinity_total":
                        out.outcomes[sample.labels["outcome"]] = sample.value
    return out


def run_policy(policy: str, args: argparse.Namespace, tmp: Path) -> Results:
    fakes: list[subprocess.Popen[bytes]] = []
    router: subprocess.Popen[bytes] | None = None
    try:
        lines = []
        for i in range(REPLICAS):
            process, url = fake(
                *("--model", "chat", "--tokens", str(args.tokens), "--token-delay", str(args.token_delay)),
                *("--prefix-cache-blocks", str(args.cache_blocks), "--prefill-seconds-per-token", str(args.prefill)),
            )
            fakes.append(process)
            lines += ["[[replicas]]", f'id = "r{i}"', 'model = "chat"', f'url = "{url}"']
            wait_http(f"{url}/v1/models", process=process)
        config = tmp / f"{policy}.toml"
        config.write_text(
            'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\ntick_seconds = 1\n'
            + "\n".join(lines)
            + f'\n[models."chat"]\nrouting = "{policy}"\n'
        )
        router, client, admin_url = serve(config)
        port, admin = int(client.rsplit(":", 1)[1]), int(admin_url.rsplit(":", 1)[1])
        return asyncio.run(replay(port, admin, args))
    finally:
        for process in [*fakes, *([router] if router is not None else [])]:
            process.terminate()
            process.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--arrival-seconds", type=float, default=15.0, help="conversations start over this long")
    parser.add_argument("--think", type=float, default=0.3, help="mean seconds between an answer and the next turn")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument("--prefill", type=float, default=0.0002, help="seconds per prompt token not cached")
    parser.add_argument("--cache-blocks", type=int, default=2000, help="prefix cache per replica, 64-character blocks")
    parser.add_argument("--message-chars", type=int, default=200, help="characters of each user message")
    parser.add_argument("--policy", action="append", choices=POLICIES, help="only these (default: all three)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="router-affinity-") as tmpdir:
        for policy in args.policy or POLICIES:
            results[policy] = run_policy(policy, args, Path(tmpdir)).summary()
    if args.json:
        print(json.dumps(results))
        return 0
    print(
        f"{args.sessions} conversations x {args.turns} turns, {REPLICAS} replicas, "
        f"prefix cache {args.cache_blocks} blocks of 64 characters per replica\n"
    )
    print(
        "| routing | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | max/mean in flight | spilled "
        "| requests | errors |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for policy, r in results.items():
        spilled = "-" if policy == "least_loaded" else f"{r['spilled']:.1%}"
        print(
            f"| {policy} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
            f"| {r['max_over_mean']:.2f} | {spilled} | {r['requests']} | {r['errors']} |"
        )
    print("\n| target | measured | |\n| --- | --- | --- |")
    for policy in ("session", "prefix"):
        if policy in results:
            hit = results[policy]["hit_rate"]
            ratio = results[policy]["max_over_mean"]
            print(f"| {policy}: hit rate >= 85% | {hit:.1%} | {'met' if hit >= 0.85 else 'NOT met'} |")
            print(f"| {policy}: max/mean in flight <= 1.3 | {ratio:.2f} | {'met' if ratio <= 1.3 else 'NOT met'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
