"""One worker of `router serve --workers N`: a whole router on the shared port, steered by its supervisor."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import orjson
import uvloop
from prometheus_client import CollectorRegistry

from router.core.config.settings import Config, load_config
from router.core.errors import ConfigError
from router.run.app import RouterServer, freeze_start_up
from router.run.logs import install as install_request_ids
from router.run.workers.claims import WakeClaims
from router.run.workers.state import Paths, load_state

log = logging.getLogger("router.run.workers")


def for_worker(config: Config, port: int, workers: int) -> Config:
    """A worker's view of the config: the shared port, its share of the limits,
    no admin token (its socket is private) and no push (the supervisor pushes)."""

    def share(limit: int) -> int:
        return max(1, limit // workers) if limit > 0 else 0

    return replace(
        config,
        listen=replace(config.listen, port=port),
        admin_token="",
        usage_push_url="",
        max_in_flight_per_replica=share(config.max_in_flight_per_replica),
        max_in_flight=share(config.max_in_flight),
        # A tenant's bound on a model's queue too; weights need no share: each worker's
        # queue gives its slots in the same proportions.
        max_queued_per_tenant=share(config.max_queued_per_tenant),
        # The buffered-body cap bounds the router's memory: the workers' shares add up to it.
        max_buffered_body_bytes=share(config.max_buffered_body_bytes),
        # Held requests per model too: each worker holds its share.
        models=MappingProxyType(
            {name: replace(model, max_held=share(model.max_held)) for name, model in config.models.items()}
        ),
    )


def worker_main(argv: Sequence[str]) -> int:
    """`router _worker ...`: one worker, started by the supervisor only."""
    parser = argparse.ArgumentParser(prog="router _worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker-{args.index} %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        install_request_ids(handler)
    try:
        config = for_worker(load_config(args.config), args.port, args.workers)
    except ConfigError as exc:
        print(f"router worker {args.index}: {exc}", file=sys.stderr)
        return 2
    uvloop.run(_run_worker(config, Path(args.runtime), args.index, args.config))
    return 0


async def start_worker(
    config: Config, runtime: Path, index: int, *, registry: CollectorRegistry | None = None
) -> RouterServer:
    """The worker's router, started: its admin socket, the supervisor's state, then the shared client port."""
    paths = Paths(runtime, index)
    server = RouterServer(config, registry=registry, worker_socket=str(paths.socket))

    def before_clients() -> None:
        # One wake call per replica across the workers, from the very first request: the claims are
        # in place before the client port opens (a request that came first would wake on its own,
        # beside another worker's wake of the same replica), and before the state file's sleepers load.
        if server.fleet is not None and server.fleet.sleeper is not None:
            server.fleet.sleeper.wakes.claims = WakeClaims(runtime)
        load_state(server, paths.state)

    await server.start(before_clients=before_clients)
    return server


async def _run_worker(config: Config, runtime: Path, index: int, config_path: str) -> None:
    server = await start_worker(config, runtime, index)
    paths = Paths(runtime, index)
    freeze_start_up()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # The supervisor passes SIGHUP on: the replica set comes from it; the access log and the
    # client keys are this worker's, read again from the file.
    def reload() -> None:
        server.reopen_logs()
        server.reload_keys(config_path)

    loop.add_signal_handler(signal.SIGHUP, reload)
    parent = os.getppid()

    async def orphaned() -> None:
        # A supervisor killed outright takes its workers with it.
        while os.getppid() == parent:  # noqa: ASYNC110 (no event tells of a parent's death)
            await asyncio.sleep(1.0)
        log.error("the supervisor is gone; stopping")
        stop.set()

    watch = loop.create_task(orphaned())
    try:
        await stop.wait()
    finally:
        watch.cancel()
        await server.stop()
        if server.ticker is not None and server.ticker.latest is not None:
            # The last word on this worker's usage, for the supervisor's final push.
            partial = paths.final.with_suffix(".partial")
            partial.write_bytes(orjson.dumps(server.ticker.latest.to_json()))
            partial.rename(paths.final)
