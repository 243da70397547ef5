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
import socket
import sys
from collections.abc import Sequence

import uvloop

from router.tools.fake.engine import Engine, EngineParams
from router.tools.fake.exposition import ENGINES
from router.tools.fake.replica import FakeReplica
from router.tools.fake.sleep import ANSWERS, SleepMode
from router.tools.fake.switches import Behaviour

# The simulated engine's defaults, shown by --help.
_DEFAULTS = EngineParams()


def main(argv: Sequence[str] | None = None, prog: str = "router fake") -> int:
    """`router fake` (or `python -m router.tools.fake`): serve a fake replica, optionally in several processes."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A fake OpenAI-compatible replica (as vLLM answers), to put behind the router.",
        epilog="It prints its address and models once it listens; Ctrl-C (or SIGTERM) stops it.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the line it prints names it)")
    parser.add_argument(
        "--model", action="append", dest="models", help="model name to serve (repeatable; default fake-model)"
    )
    parser.add_argument(
        "--adapter",
        action="append",
        dest="adapters",
        default=[],
        metavar="NAME",
        help="a LoRA adapter loaded on the first model, listed in /v1/models with it as parent (repeatable)",
    )
    parser.add_argument(
        "--api-key", default="", help="refuse /v1 requests without 'Authorization: Bearer KEY', as vLLM's --api-key"
    )
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer, at most")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds before the first token")
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
    engine = parser.add_argument_group(
        "simulated engine", "tokens made by a simulated engine (continuous batching, KV cache, prefix cache)"
    )
    engine.add_argument(
        "--engine",
        choices=ENGINES,
        help="simulate this engine, and report its load under its own metric names (docs/routing.md)",
    )
    engine.add_argument("--time-scale", type=float, default=1.0, help="engine time runs this many times faster")
    engine.add_argument("--max-running", type=int, default=_DEFAULTS.max_running, help="sequences running at once")
    engine.add_argument("--kv-blocks", type=int, default=_DEFAULTS.kv_blocks, help="KV cache blocks")
    engine.add_argument("--block-tokens", type=int, default=_DEFAULTS.block_tokens, help="tokens per KV block")
    engine.add_argument(
        "--metrics-seconds", type=float, default=_DEFAULTS.metrics_seconds, help="the gauges' refresh, at most"
    )
    sleep = parser.add_argument_group(
        "sleep mode",
        "vLLM's sleep API (POST /sleep?level=, POST /wake_up?tags=, GET /is_sleeping) and SGLang's "
        "(POST /release_memory_occupation, /resume_memory_occupation), as with VLLM_SERVER_DEV_MODE=1",
    )
    sleep.add_argument("--enable-sleep-mode", action="store_true", help="serve the sleep API (vLLM's flag)")
    sleep.add_argument("--sleep-seconds", type=float, default=0.0, help="how long a sleep call takes")
    sleep.add_argument("--wake-seconds", type=float, default=0.0, help="how long a wake call takes")
    sleep.add_argument(
        "--asleep-answer",
        choices=ANSWERS,
        default="503",
        help="inference requests while asleep: 503 saying 'sleeping', or held until awake (vLLM's own behaviour)",
    )
    parser.add_argument("--processes", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument(
        "--share-port",
        action="store_true",
        help="listen even if something listens on the port already, sharing it (SO_REUSEPORT); "
        "without it a port in use is refused",
    )
    args = parser.parse_args(argv)
    if args.cache_block_chars < 1 or args.prefix_cache_blocks < 0 or args.prefill_seconds_per_token < 0:
        parser.error(
            "--cache-block-chars must be at least 1; --prefix-cache-blocks and --prefill-seconds-per-token >= 0"
        )
    if args.engine is not None and not (
        args.time_scale > 0 and args.max_running >= 1 and args.kv_blocks >= 1 and args.block_tokens >= 1
    ):
        parser.error("--time-scale must be above 0; --max-running, --kv-blocks and --block-tokens at least 1")
    if args.sleep_seconds < 0 or args.wake_seconds < 0:
        parser.error("--sleep-seconds and --wake-seconds must be >= 0")
    if args.processes < 1 or (args.processes > 1 and args.port == 0):
        parser.error("--processes must be at least 1, and share a port given with --port (not 0)")
    paced = dict(_pace(spec) for spec in args.paced)
    models = [*(args.models or ([] if paced else ["fake-model"])), *paced]
    if not args.share_port and args.port:
        # Its socket shares the port (SO_REUSEPORT, for --processes and
        # --share-port), but a fake that joined an engine or another fake
        # by accident would answer half of the requests meant for them.
        try:
            check_free(args.host, args.port)
        except OSError as exc:
            hint = "(--share-port to share it with what listens there)"
            print(f"{prog}: {_cannot_listen(args, exc)} {hint}", file=sys.stderr)
            return 2
    children: list[int] = []
    for _ in range(args.processes - 1):
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)
    # SIGTERM and SIGINT (Ctrl-C) become SystemExit, whatever the disposition
    # inherited (a shell that ignores SIGINT), so that the finally below stops the children.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        # The first process alone says where it listens.
        uvloop.run(_serve_forever(args, models, paced, tell=args.processes == 1 or bool(children)))
    except OSError as exc:
        # Shared with a listener that does not share (an engine), or an address not this host's.
        print(f"{prog}: {_cannot_listen(args, exc)}", file=sys.stderr)
        return 2
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return 0


def _cannot_listen(args: argparse.Namespace, exc: OSError) -> str:
    return f"cannot listen on {args.host}:{args.port}: {os.strerror(exc.errno) if exc.errno else exc}"


def check_free(host: str, port: int) -> None:
    """OSError if something listens on host:port already (a plain bind, without SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)


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


async def _serve_forever(
    args: argparse.Namespace, models: list[str], paced: dict[str, tuple[float, float]], *, tell: bool
) -> None:
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
        adapters=list(args.adapters),
        api_key=args.api_key,
    )
    if args.enable_sleep_mode:
        fake.sleep = SleepMode(
            sleep_seconds=args.sleep_seconds, wake_seconds=args.wake_seconds, asleep_answer=args.asleep_answer
        )
    if args.engine is not None:
        fake.engine_kind = args.engine
        fake.engine = Engine(
            EngineParams(
                max_running=args.max_running,
                kv_blocks=args.kv_blocks,
                block_tokens=args.block_tokens,
                metrics_seconds=args.metrics_seconds,
                time_scale=args.time_scale,
            )
        )
    url = await fake.start(args.host, args.port)
    if tell:
        # Once it listens: a script may wait for this line and read the address from it.
        count = f" in {args.processes} processes" if args.processes > 1 else ""
        print(f"fake replica of {', '.join(models)} at {url}{count}", flush=True)
    # From here SIGTERM and SIGINT are the loop's: uvloop runs a Python handler inside whatever
    # callback it is in, and a SystemExit raised there is logged as a transport's fatal error
    # while the fake runs on (a test's terminate() then waited for ever).
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # Then gone at once, as the SystemExit left: whatever is in flight ends with the process.
    await stopping.wait()
