"""`router scaler`: the command, and `Scaler`, the whole scaler in one process.

    router scaler --server A --server B [--listen 127.0.0.1:9091] [--poll-seconds 1]
    router scaler --servers-from-dns router-admin.default.svc.cluster.local:9090
    router scaler --config scaler.toml       # its [scaler] table; flags win over it

Runs on the plain asyncio loop: grpcio's asyncio server drives its own
polling on it, and uvloop gains nothing for a few calls a second.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp
import grpc
from aiohttp import web
from grpc import aio
from prometheus_client import CollectorRegistry

from router.core.errors import ConfigError
from router.scaler.board import Board
from router.scaler.externalscaler_pb2_grpc import add_ExternalScalerServicer_to_server
from router.scaler.http_api import HttpApi
from router.scaler.poller import Poller, Resolve, resolve_servers
from router.scaler.service import ExternalScaler
from router.scaler.settings import HELP, ScalerSettings, apply, finish, load_section

log = logging.getLogger("router.scaler")
# Where it listens is said whatever --log-level asks for, as `router serve` says it
# (router/run/app.py): with port 0 this line is the only way to learn the ports.
listening_log = logging.getLogger("router.listening")
listening_log.setLevel(logging.INFO)

# Streams end at once on stop (the board closes them); unary calls in flight get this long.
STOP_GRACE_SECONDS = 2.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def server_credentials(settings: ScalerSettings) -> grpc.ServerCredentials | None:
    """TLS for KEDA's calls, as its external_scaler.go dials them: enableTLS or caCert (the scaler's
    certificate is checked), tlsClientCert and tlsClientKey (KEDA's is sent; required with tls_client_ca)."""
    if not settings.tls_cert:
        return None
    chain = Path(settings.tls_cert).read_bytes()
    key = Path(settings.tls_key).read_bytes()
    client_ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


class Scaler:
    """The poller, the gRPC service and the HTTP port, started and stopped together."""

    def __init__(
        self,
        settings: ScalerSettings,
        *,
        registry: CollectorRegistry | None = None,
        resolve: Resolve = resolve_servers,
    ) -> None:
        self.settings = settings
        self.registry = CollectorRegistry() if registry is None else registry
        self._resolve = resolve
        # Past a few rounds' time (each: a pause, a DNS answer and the routers' answers) without a new view.
        self.board = Board(stale_after=3 * (settings.poll_seconds + 2 * settings.timeout_seconds))
        self.poller: Poller | None = None
        self.grpc_address = ""
        self.http_url = ""
        self._session: aiohttp.ClientSession | None = None
        self._grpc: aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen on both ports and start polling; OSError if a port cannot be had."""
        settings = self.settings
        self._session = aiohttp.ClientSession()
        self.poller = poller = Poller(settings, self._session, self.board, resolve=self._resolve)
        try:
            server = aio.server()
            add_ExternalScalerServicer_to_server(ExternalScaler(self.board), server)
            try:
                credentials = server_credentials(settings)
                if credentials is None:
                    port = server.add_insecure_port(str(settings.listen))
                else:
                    port = server.add_secure_port(str(settings.listen), credentials)
            except RuntimeError as exc:
                # grpcio says only "Failed to bind"; the address is what the operator needs.
                raise OSError(f"{settings.listen} (gRPC): {exc}") from exc
            self._grpc = server
            await server.start()
            self.grpc_address = f"{settings.listen.host}:{port}"
            api = HttpApi(poller, self.board, token=settings.token, registry=self.registry)
            self._runner = runner = web.AppRunner(api.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, settings.http_listen.host, settings.http_listen.port).start()
            http_port = runner.addresses[0][1]
            self.http_url = f"http://{settings.http_listen.host}:{http_port}"
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.get_running_loop().create_task(poller.run())

    async def stop(self) -> None:
        """Ends the streams, the polling and both ports; calling it again does nothing."""
        self.board.close()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self.poller is not None:
            await self.poller.sleeper.close()
        grpc_server, self._grpc = self._grpc, None
        if grpc_server is not None:
            await grpc_server.stop(STOP_GRACE_SECONDS)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def run(settings: ScalerSettings, *, on_ready: Callable[[Scaler], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT."""
    scaler = Scaler(settings)
    await scaler.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    servers = ", ".join(settings.servers)
    if settings.servers_from_dns is not None:
        servers = ", ".join(filter(None, [servers, f"every address of {settings.servers_from_dns}"]))
    listening_log.info(
        "router scaler: gRPC on %s, HTTP on %s, polling %s", scaler.grpc_address, scaler.http_url, servers
    )
    if on_ready is not None:
        on_ready(scaler)
    try:
        await stop.wait()
    finally:
        log.info("router scaler: stopping")
        await scaler.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router scaler",
        description="KEDA's external push scaler over every router's usage map (docs/kubernetes.md).",
    )
    parser.add_argument("--config", "-c", help="a TOML file with a [scaler] table (a router's own may hold it)")
    parser.add_argument(
        "--server", action="append", help="a router's admin address; repeat for each: " + HELP["servers"]
    )
    parser.add_argument("--servers-from-dns", metavar="HOST:PORT", help=HELP["servers_from_dns"])
    parser.add_argument("--listen", metavar="HOST:PORT", help=HELP["listen"] + " (default 127.0.0.1:9091)")
    parser.add_argument("--http-listen", metavar="HOST:PORT", help=HELP["http_listen"] + " (default 127.0.0.1:9092)")
    parser.add_argument("--poll-seconds", metavar="S", help=HELP["poll_seconds"] + " (default 1)")
    parser.add_argument("--timeout-seconds", metavar="S", help=HELP["timeout_seconds"] + " (default 2)")
    parser.add_argument("--token", help="the routers' admin token (default: the file's, else $ROUTER_ADMIN_TOKEN)")
    parser.add_argument("--tls-cert", metavar="PEM", help=HELP["tls_cert"])
    parser.add_argument("--tls-key", metavar="PEM", help=HELP["tls_key"])
    parser.add_argument("--tls-client-ca", metavar="PEM", help=HELP["tls_client_ca"])
    parser.add_argument("--log-level", default="info")
    return parser


def settings_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ScalerSettings:
    """The file's [scaler] table, then each flag given over it; ConfigError names the file key or the flag."""
    settings = load_section(args.config) if args.config else ScalerSettings()
    given = {
        "servers": args.server,
        "servers_from_dns": args.servers_from_dns,
        "listen": args.listen,
        "http_listen": args.http_listen,
        "poll_seconds": args.poll_seconds,
        "timeout_seconds": args.timeout_seconds,
        "token": args.token,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
    }
    flags: dict[str, object] = {key: value for key, value in given.items() if value is not None}
    for key in ("poll_seconds", "timeout_seconds"):
        if key in flags:
            flags[key] = _number(str(flags[key]), "--" + key.replace("_", "-"))
    settings = apply(settings, flags, "command line", label=lambda key: "--" + key.replace("_", "-"))
    if args.log_level.upper() not in LOG_LEVELS:
        # Checked here, or logging.basicConfig would end the command with a traceback.
        choices = ", ".join(level.lower() for level in LOG_LEVELS)
        raise ConfigError(f"command line: --log-level: must be one of {choices}, got {args.log_level!r}")
    return finish(settings, args.config or "command line", environ)


def _number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"command line: {flag}: must be a number of seconds, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ConfigError as exc:
        print(f"router scaler: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run(settings))
    except OSError as exc:
        print(f"router scaler: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0
