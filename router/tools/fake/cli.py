"""A fake OpenAI replica: good enough to stand in for vLLM in tests, demo, bench.

It answers chat, completions (both streaming, in vLLM's chunk format),
embeddings and models, the Responses API (stored in memory, as engines keep
them: another replica does not know them), and the other endpoints vLLM and
SGLang serve (rerank, score, pooling, classify, tokenize, audio, images) with
an echo that says which replica served and what body arrived (its length and
SHA-256, so that a test can check it came byte for byte), and has switches for the shape of its answers
(tokens, delays) and for failures (a status code, a reset after K chunks, a
stall before the first byte, a short keep-alive). The switches live in a
mutable `Behaviour`, so a test can flip them while the replica runs, and the
replica records what it saw (requests, headers, cancellations).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence

import uvloop

from router.tools.fake.replica import FakeReplica
from router.tools.fake.switches import Behaviour


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m router.tools.fake`: serve a fake replica, optionally in several processes."""
    parser = argparse.ArgumentParser(prog="python -m router.tools.fake", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", action="append", dest="models", help="model name to serve (repeatable)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--first-token-delay", type=float, default=0.0)
    parser.add_argument(
        "--paced",
        action="append",
        default=[],
        metavar="MODEL=LOW:HIGH",
        help="stream MODEL's tokens LOW to HIGH seconds apart (repeatable; MODEL is also served)",
    )
    parser.add_argument("--tokenizer-path", default="", help="reported by /get_model_info (for peer routers)")
    parser.add_argument(
        "--prefix-cache-blocks", type=int, default=0, help="a prefix cache of this many blocks (0: none)"
    )
    parser.add_argument("--cache-block-chars", type=int, default=64, help="characters of prompt per cache block")
    parser.add_argument(
        "--prefill-seconds-per-token", type=float, default=0.0, help="time to first token per prompt token not cached"
    )
    parser.add_argument("--processes", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    args = parser.parse_args(argv)
    if args.cache_block_chars < 1 or args.prefix_cache_blocks < 0 or args.prefill_seconds_per_token < 0:
        parser.error(
            "--cache-block-chars must be at least 1; --prefix-cache-blocks and --prefill-seconds-per-token >= 0"
        )
    children: list[int] = []
    for _ in range(max(0, args.processes - 1)):
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)
    # SIGTERM becomes SystemExit so that the finally below stops the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvloop.run(_serve_forever(args))
    except KeyboardInterrupt:
        pass
    finally:
        for pid in children:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass


def _pace(spec: str) -> tuple[str, tuple[float, float]]:
    model, _, span = spec.partition("=")
    low, _, high = span.partition(":")
    try:
        pace = (float(low), float(high or low))
    except ValueError:
        pace = (-1.0, -1.0)
    if not model or not 0 <= pace[0] <= pace[1]:
        raise SystemExit(f"--paced: expected MODEL=LOW:HIGH seconds with 0 <= LOW <= HIGH, got {spec!r}")
    return model, pace


async def _serve_forever(args: argparse.Namespace) -> None:
    paced = dict(_pace(spec) for spec in args.paced)
    models = [*(args.models or ([] if paced else ["fake-model"])), *paced]
    fake = FakeReplica(
        models=tuple(models),
        behaviour=Behaviour(
            tokens=args.tokens,
            token_delay=args.token_delay,
            first_token_delay=args.first_token_delay,
            paced=paced,
            prefix_cache_blocks=args.prefix_cache_blocks,
            cache_block_chars=args.cache_block_chars,
            prefill_seconds_per_token=args.prefill_seconds_per_token,
        ),
        record=False,
        name=f"fake-{args.port}",
        tokenizer_path=args.tokenizer_path,
    )
    await fake.start(args.host, args.port)
    await asyncio.Event().wait()
