"""The `router` command: serve, demo, ctl, bench, scaler, fake.

Server modules are imported inside the commands that need them, so that
`router ctl` starts fast.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.core.config.settings import Config

DEMO_MODELS = {
    "llama-3.1-8b": {"aliases": ["llama", "default"], "fallbacks": ["qwen2.5-7b"]},
    "qwen2.5-7b": {"aliases": ["qwen"]},
}
DEMO_FLEET = (
    ("llama-0", "llama-3.1-8b", {"node": "gpu-a1", "gpu_class": "h100", "gpus": 1}),
    ("llama-1", "llama-3.1-8b", {"node": "gpu-a2", "gpu_class": "h100", "gpus": 1}),
    ("llama-2", "llama-3.1-8b", {"node": "gpu-a3", "gpu_class": "h100", "gpus": 1}),
    ("qwen-0", "qwen2.5-7b", {"node": "gpu-b1", "gpu_class": "l4", "gpus": 1}),
    ("qwen-1", "qwen2.5-7b", {"node": "gpu-b2", "gpu_class": "l4", "gpus": 1}),
)


def _setup_logging(level: str) -> None:
    from router.run.logs import install

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        install(handler)


def _run(coro: Any) -> None:
    import uvloop

    uvloop.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    from router.core.config.settings import check_files, load_config
    from router.core.errors import ConfigError
    from router.run.app import serve
    from router.run.tracing import check_installed

    try:
        config = load_config(args.config)
        check_files(config)
        check_installed(config)
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    try:
        if args.workers > 1:
            from router.run.workers import serve_workers

            _run(serve_workers(config, config_path=args.config, workers=args.workers, log_level=args.log_level))
        else:
            _run(serve(config, config_path=args.config))
    except ConfigError as exc:
        # Found only at start: an address in use (CannotListen), where the Kubernetes
        # API is ([discovery.kubernetes]), or, with --workers, that no directory is
        # writable for their sockets.
        print(f"router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"router: cannot listen: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        # A worker of --workers that did not start (workers.WorkerFailed).
        print(f"router: {exc}", file=sys.stderr)
        return 1
    return 0


def demo_config(listen: str, admin_listen: str, urls: dict[str, str], tick_seconds: float = 5.0) -> Config:
    from router.core.config.settings import parse_config

    raw = {
        "listen": listen,
        "admin_listen": admin_listen,
        "router_name": "demo",
        "tick_seconds": tick_seconds,
        # Nothing sends the demo's clients elsewhere: no wait before it stops.
        "shutdown_delay_seconds": 0,
        "replicas": [
            {"id": rid, "model": model, "url": urls[rid], "labels": labels} for rid, model, labels in DEMO_FLEET
        ],
        "models": DEMO_MODELS,
    }
    return parse_config(raw, "<demo>")


def in_a_new_shell() -> tuple[str, str]:
    """How another terminal reaches this install's `router` and `python`.

    Inside a venv, by path (relative when under the current directory): a new
    terminal has not activated it. Otherwise by name, as PATH finds them.
    """
    if sys.prefix == sys.base_prefix:
        return "router", "python3"
    bin_dir = Path(sys.executable).parent
    try:
        spelled = str(bin_dir.relative_to(Path.cwd()))
    except ValueError:
        spelled = str(bin_dir)
    python = shlex.quote(f"{spelled}/python")
    router = shlex.quote(f"{spelled}/router") if (bin_dir / "router").exists() else f"{python} -m router"
    return router, python


def demo_models() -> list[str]:
    """One line per model of the demo: its aliases and where its requests go when it has no replica."""
    lines = []
    for model, settings in DEMO_MODELS.items():
        aliases = settings.get("aliases", [])
        said = [f"{'aliases' if len(aliases) > 1 else 'alias'}: {', '.join(aliases)}"] if aliases else []
        fallbacks = settings.get("fallbacks", [])
        if fallbacks:
            said.append(f"falls back to {', '.join(fallbacks)}")
        count = sum(1 for _, of, _ in DEMO_FLEET if of == model)
        lines.append(f"{model} ({count} replicas{'; ' if said else ''}{'; '.join(said)})")
    return lines


def demo_printout(client: str, admin: str, replicas: int) -> str:
    admin_server = admin.removeprefix("http://")
    router, python = in_a_new_shell()
    models = ("\n" + " " * 11).join(demo_models())
    llama = DEMO_FLEET[0][1]
    drained = [rid for rid, model, _ in DEMO_FLEET if model == llama]
    fallback = DEMO_MODELS[llama]["fallbacks"][0]
    return f"""
router demo: {replicas} fake replicas of {len(DEMO_MODELS)} models behind the router.

  clients  {client}/v1
  admin    {admin}/api/v1     (metrics at {admin}/metrics)
  models   {models}

Try, in another terminal (from {Path.cwd()}):

  curl -s {client}/v1/models
  curl -s {client}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "llama", "messages": [{{"role": "user", "content": "hi"}}]}}'
  curl -sN {client}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "qwen2.5-7b", "stream": true, "messages": [{{"role": "user", "content": "hi"}}]}}'
  {python} -c "import openai; c = openai.OpenAI(base_url='{client}/v1', api_key='x'); \\
print(c.chat.completions.create(model='llama', messages=[{{'role': 'user', 'content': 'hi'}}]))"

  {router} ctl replicas --server {admin_server}     # who was used when ('-' = unknown)
  {router} ctl usage --server {admin_server}
  {router} ctl status --server {admin_server} --idle-for 1m
  {router} ctl idle --server {admin_server} --idle-for 1m

Draining every replica of {llama} sends its requests to {fallback}, its fallback:

  for r in {" ".join(drained)}; do {router} ctl drain $r --server {admin_server}; done
  (and back: the same with ctl undrain)

Ctrl-C stops it."""


async def _demo(args: argparse.Namespace) -> None:
    from router.core.config.settings import Config
    from router.run.app import serve
    from router.tools.fake import Behaviour, FakeReplica

    fakes = []
    urls = {}
    # The demo's config leaves max_body_bytes at its default: the fakes take whatever it lets through.
    body_limit = Config().max_body_bytes
    for rid, model, _ in DEMO_FLEET:
        fake = FakeReplica(
            models=(model,),
            name=rid,
            record=False,
            behaviour=Behaviour(tokens=args.tokens, token_delay=args.token_delay),
            max_body_bytes=body_limit,
        )
        urls[rid] = await fake.start("127.0.0.1", 0)
        fakes.append(fake)
    config = demo_config(args.listen, args.admin_listen, urls)

    def tell(server: Any) -> None:
        print(demo_printout(server.client_url, server.admin_url, len(fakes)), flush=True)

    try:
        await serve(config, on_ready=tell)
    finally:
        for fake in fakes:
            await fake.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from router.core.errors import CannotListen

    _setup_logging(args.log_level)
    try:
        _run(_demo(args))
    except CannotListen as exc:
        flag = "--listen" if exc.key == "listen" else "--admin-listen"
        print(
            f"router demo: cannot listen on {exc.address} ({flag}): {exc.reason} "
            f"(is another router running? use --listen/--admin-listen)",
            file=sys.stderr,
        )
        return 1
    return 0


def _workers(value: str) -> int:
    from router.run.workers import worker_count

    return worker_count(value)


def build_kind() -> str:
    """Which build is installed: the hot modules as the C extensions setup.py makes, or as Python.

    Read from the files, not by importing them, so that `router ctl` loads none of the server.
    """
    from importlib.machinery import EXTENSION_SUFFIXES

    server = Path(__file__).resolve().parent.parent / "http" / "server"
    return "compiled" if any((server / f"reader{suffix}").exists() for suffix in EXTENSION_SUFFIXES) else "pure Python"


def build_parser() -> argparse.ArgumentParser:
    from router import __version__

    parser = argparse.ArgumentParser(prog="router", description="An OpenAI-compatible gateway for LLM replicas.")
    parser.add_argument("--version", action="version", version=f"router {__version__} ({build_kind()})")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router")
    serve.add_argument("--config", "-c", required=True, help="the TOML configuration file")
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N|auto",
        help="processes sharing the client port, one admin view (auto: one per core; default 1)",
    )
    demo = sub.add_parser("demo", help="a local fleet of fake replicas behind the router")
    demo.add_argument("--listen", default="127.0.0.1:8080")
    demo.add_argument("--admin-listen", default="127.0.0.1:9090")
    demo.add_argument("--tokens", type=int, default=16)
    demo.add_argument("--token-delay", type=float, default=0.02, help="seconds between streamed tokens")
    demo.add_argument("--log-level", default="info")
    sub.add_parser("ctl", help="read and steer running routers (router ctl --help)", add_help=False)
    sub.add_parser("bench", help="load against an OpenAI base URL (router bench --help)", add_help=False)
    sub.add_parser(
        "scaler", help="KEDA's external push scaler over every router (router scaler --help)", add_help=False
    )
    sub.add_parser("fake", help="a fake OpenAI replica to try the router with (router fake --help)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "ctl":
        from router.tools.ctl import main as ctl_main

        return ctl_main(argv[1:])
    if argv and argv[0] == "_worker":
        from router.run.workers import worker_main

        return worker_main(argv[1:])
    if argv and argv[0] == "bench":
        from router.tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "scaler":
        from router.scaler.main import main as scaler_main

        return scaler_main(argv[1:])
    if argv and argv[0] == "fake":
        from router.tools.fake.cli import main as fake_main

        return fake_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "demo":
        return cmd_demo(args)
    raise AssertionError(f"unhandled command {args.command}")


def entry() -> None:
    sys.exit(main())
