"""A real engine, straight and through the router: time to first token, tokens/s.

Starts one llama.cpp server (Gemma 3 270M, installed by scripts/install-engine)
and a `router serve` in front of it, then streams chat completions at 1 and 8
concurrent streams, alternating straight and routed, and reports time to first
token (first content chunk), tokens/s (content chunks over the wall time), the
router's added time to first token and its CPU per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.compare import cpu_seconds, free_port, serve, wait_http
from tests.engine.test_engine import ENGINE_MODEL, ENGINE_PYTHON, engine_argv

TOKEN_EVENT = re.compile(rb'"finish_reason":\s*null')


async def one_stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float, int, float]:
    body = orjson.dumps(
        {
            "model": "gemma",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
        }
    )
    began = time.perf_counter()
    first = 0.0
    tokens = 0
    headers = {"Content-Type": "application/json"}
    async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {") and TOKEN_EVENT.search(event):
                    tokens += 1
                    if not first:
                        first = time.perf_counter() - began
    return first, tokens, time.perf_counter() - began


async def load(url: str, streams: int, max_tokens: int) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        began = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, max_tokens) for _ in range(streams)))
        wall = time.perf_counter() - began
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1000,
        "ttft_max_ms": ttfts[-1] * 1000,
        "tokens": tokens,
        "tokens_per_second": tokens / wall,
    }


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (ENGINE_PYTHON.exists() and ENGINE_MODEL.exists()):
        sys.exit("no engine: run scripts/install-engine first")
    # llama.cpp is told its port and does not say which it took; the router binds port 0 and says.
    engine_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        engine = subprocess.Popen(engine_argv(engine_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        config = Path(tmp) / "router.toml"
        config.write_text(
            'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
            f'[[replicas]]\nid = "gemma-0"\nmodel = "gemma"\nurl = "http://127.0.0.1:{engine_port}"\n'
        )
        router, client_url, _ = serve(config)
        results: dict[str, list[dict[str, float]]] = {}
        try:
            wait_http(f"http://127.0.0.1:{engine_port}/v1/models", timeout=120)
            paths = {"direct": f"http://127.0.0.1:{engine_port}", "router": client_url}
            for _ in range(args.rounds):
                for streams in (1, 8):
                    for name, url in paths.items():
                        before = cpu_seconds([router.pid])
                        figures = asyncio.run(load(url, streams, args.max_tokens))
                        if name == "router":
                            figures["cpu_us"] = (cpu_seconds([router.pid]) - before) * 1e6
                        results.setdefault(f"{name} {streams}", []).append(figures)
        finally:
            router.terminate()
            engine.terminate()
            router.wait(timeout=40)
            engine.wait(timeout=20)

    def median(name: str, key: str) -> float:
        values = sorted(r[key] for r in results[name])
        return values[len(values) // 2]

    def cpu_per_token(streams: int) -> float:
        # /proc counts CPU in 10 ms ticks: sum over all rounds, never a median of few ticks.
        rows = results[f"router {streams}"]
        return sum(r["cpu_us"] for r in rows) / sum(r["tokens"] for r in rows)

    summary: dict[str, Any] = {}
    lines = ["| streams | path | TTFT p50 | tokens/s | router CPU per token |", "| --- | --- | --- | --- | --- |"]
    for streams in (1, 8):
        for name in ("direct", "router"):
            key = f"{name} {streams}"
            ttft = median(key, "ttft_p50_ms")
            rate = median(key, "tokens_per_second")
            cpu = f"{cpu_per_token(streams):.0f} us" if name == "router" else "-"
            summary[key] = {"ttft_p50_ms": ttft, "tokens_per_second": rate}
            lines.append(f"| {streams} | {name} | {ttft:.1f} ms | {rate:.1f} | {cpu} |")
        added = summary[f"router {streams}"]["ttft_p50_ms"] - summary[f"direct {streams}"]["ttft_p50_ms"]
        summary[f"added_ttft_ms_{streams}"] = added
        summary[f"router_cpu_us_per_token_{streams}"] = cpu_per_token(streams)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"Gemma 3 270M Q4_K_M on llama.cpp, 1 thread, {args.max_tokens} tokens, medians of {args.rounds} rounds")
        print("\n".join(lines))
        for streams in (1, 8):
            print(f"added TTFT at {streams} stream(s): {summary[f'added_ttft_ms_{streams}']:+.1f} ms")
    return summary


if __name__ == "__main__":
    main()
