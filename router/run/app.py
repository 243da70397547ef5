"""Wiring: the pool, the proxy, the admin API, the usage tick and its sinks.

`RouterServer` owns both listeners and their lifecycle; `serve()` runs one
until SIGTERM/SIGINT and shuts it down gracefully: /readyz turns 503 at
once, the client port stops accepting, requests in flight get up to
`shutdown_grace_seconds` to finish, the final usage snapshot is pushed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from router.control.admin import Admin
from router.control.cards import CardReader
from router.control.fleet import LocalFleet
from router.control.health import HealthChecker
from router.control.sinks import Sinks, build_sinks
from router.control.sinks.latest import LatestSink
from router.control.sinks.push import PushSink
from router.control.sources import (
    ReplicaSource,
    build_sources,
    exclusive_source,
    initial_set,
    reload_all,
    sources_ready,
)
from router.core.clock import Clock, LoopClock
from router.core.config.settings import Config
from router.core.config.tenants import Queueing, unit_weight
from router.core.errors import CannotListen
from router.core.pool.ejection import EjectionPolicy
from router.core.pool.picking import Routing
from router.core.pool.pool import Limits, Pool
from router.core.pool.tallies import WORKER_UNSERVED_NAMES
from router.core.usage.merging import report_json
from router.core.usage.snapshots import Ticker
from router.gateway.access_log import AccessLog
from router.gateway.answers import server_error
from router.gateway.dispatch import Proxy
from router.gateway.metrics import DataPathMetrics
from router.gateway.wake import Waker
from router.http.client import Client
from router.http.protocol_errors import ProtocolErrorCollector
from router.http.server import Server as ClientServer
from router.run.session import make_session
from router.run.worker_metrics import METRICS_PATH, report

log = logging.getLogger("router")

# On a worker's private socket only: its whole snapshot, for the supervisor.
SNAPSHOT_PATH = "/internal/v1/snapshot"


class Listening:
    """Where a router listens, once started: its client and admin addresses."""

    client_address: tuple[str, int] | None = None
    admin_address: tuple[str, int] | None = None

    @property
    def client_url(self) -> str:
        assert self.client_address is not None, "start() first"
        return http_url(self.client_address)

    @property
    def admin_url(self) -> str:
        assert self.admin_address is not None, "start() first"
        return http_url(self.admin_address)


class RouterServer(Listening):
    def __init__(
        self,
        config: Config,
        *,
        registry: CollectorRegistry | None = None,
        wall: Callable[[], float] = time.time,
        clock: Clock | None = None,
        worker_socket: str | None = None,
        config_path: str | None = None,
        sources: list[ReplicaSource] | None = None,
    ) -> None:
        """`worker_socket`: run as one worker of `router serve --workers N` (workers.py):
        the client port is shared (SO_REUSEPORT), the admin API listens on that
        private Unix socket for the supervisor, and the supervisor, not this
        process, ticks, pushes and exports usage, and runs the replica-set
        sources. `config_path`: the file SIGHUP reads the replicas from.
        `sources`: where the replica set comes from (default: what `config` names).
        `clock`: the one clock of the pool, its holds and the wake calls (a fake one in tests)."""
        self.config = config
        self.worker_socket = worker_socket
        self.sources = sources if sources is not None else build_sources(config, config_path)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.started_at = wall()
        self.clock = clock = clock if clock is not None else LoopClock()
        self.pool = Pool(
            initial_set(self.sources),
            clock=clock,
            ejection=EjectionPolicy(
                config.ejection_failures, config.ejection_base_seconds, config.ejection_max_seconds
            ),
            limits=Limits(config.max_in_flight_per_replica, config.max_in_flight),
            routing={name: Routing(model.routing, model.balance_factor) for name, model in config.models.items()},
            queueing=Queueing(config.priority_classes, config.max_queued_per_tenant, unit_weight(config.api_keys)),
        )
        if worker_socket is not None:
            # The supervisor bounds the unserved names once it has summed its workers'.
            self.pool.tallies.max_unserved_names = WORKER_UNSERVED_NAMES
        self.sinks = Sinks()
        self._wall = wall
        self._mono = clock.now
        self.fleet: LocalFleet | None = None
        self.ticker: Ticker | None = None
        self.proxy: Proxy | None = None
        self.ready = False
        self._client_server: ClientServer | None = None
        self._admin_runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._client_listener: asyncio.Server | None = None
        self.health: HealthChecker | None = None
        self.cards: CardReader | None = None
        self.client_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None

    async def start(self, before_clients: Callable[[], None] | None = None) -> None:
        """Listen on both ports; `before_clients` runs once the admin API is up."""
        config = self.config
        worker_socket = self.worker_socket
        # Opened first: a file that cannot be opened leaves nothing else to close.
        access_log = AccessLog(config.access_log) if config.access_log else None
        session = make_session(config)
        self._session = session
        # A worker's usage is ticked, exported and pushed by its supervisor.
        self.sinks = sinks = build_sinks(config, session if worker_socket is None else None)
        self.ticker = ticker = Ticker(
            self.pool,
            sinks.all,
            router=config.router_name,
            started_at=self.started_at,
            tick_seconds=config.tick_seconds,
            wall=self._wall,
            mono=self._mono,
        )
        if worker_socket is None:
            sinks.register(
                self.registry,
                sink_failures=lambda: ticker.sink_failures,
                tick_seconds=lambda: ticker.last_tick_seconds,
            )
            for source in self.sources:
                source.register(self.registry)
        metrics = DataPathMetrics(self.registry)
        self.upstream = Client(
            connect_timeout=config.connect_timeout_seconds,
            keepalive_seconds=config.upstream_keepalive_seconds,
            idle_timeout=config.upstream_idle_timeout_seconds,
        )
        self.proxy = proxy = Proxy(config, self.pool, self.upstream, metrics, started_at=self.started_at)
        if config.wake_url:
            pool, wall, mono = self.pool, self._wall, self._mono

            def held_now(model: str) -> tuple[int, float | None]:
                oldest = pool.cold_start.oldest_held(model)
                return pool.cold_start.held(model), None if oldest is None else wall() - (mono() - oldest)

            proxy.waker = Waker(
                session,
                config.wake_url,
                router=config.router_name,
                cooldown=config.wake_cooldown_seconds,
                token=config.admin_token,
                registry=self.registry,
                held_now=held_now,
                clock=self.clock,
            )

        # The client port's own HTTP/1.1 server (router/http/server/): the request
        # path stays in one protocol object, with no framework per request.
        proxy.access_log = access_log
        self._client_server = client = ClientServer(
            # With no access log, the handler keeps nothing per request for it.
            proxy.dispatch_logged if proxy.access_log is not None else proxy.dispatch,
            max_body_bytes=config.max_body_bytes,
            header_timeout=config.header_timeout_seconds,
            body_timeout=config.body_timeout_seconds,
            write_stall_timeout=config.write_stall_timeout_seconds,
            max_buffered_body_bytes=config.max_buffered_body_bytes,
            # Read in the server's own pass over each head, not searched for per request.
            captured=[m.session_header.encode() for m in config.models.values() if m.routing == "session"],
            # Keys are checked from the head when a body follows: nothing of it is read without one.
            head_check=proxy.refuse_keyless_body if proxy.keys.active else None,
            # WebSocket upgrades on upgrade_paths may switch their connection (router/gateway/tunnel.py).
            upgrade_check=proxy.may_switch if proxy.upgrades else None,
            error=server_error,
            log_exception=log.exception,
        )
        self.registry.register(ProtocolErrorCollector(client.protocol_errors, self.upstream.protocol_errors))

        self.fleet = fleet = LocalFleet(
            self.pool,
            self.registry,
            ticker.snapshot,
            # A worker's series are its supervisor's to export.
            exposition=sinks.exposition if worker_socket is None else bytes,
        )
        admin = Admin(
            fleet,
            sinks.latest,
            admin_token=config.admin_token,
            # The sources run here unless a supervisor runs them: the first set must be in before ready.
            is_ready=(lambda: self.ready and sources_ready(self.sources))
            if worker_socket is None
            else lambda: self.ready,
            rates=sinks.rates,
            wall=self._wall,
            exclusive_source=exclusive_source(self.sources) if worker_socket is None else None,
        )
        # The first snapshot exists before anyone can ask for it.
        ticker.tick()
        admin_app = admin.app()
        if worker_socket is not None:
            admin_app.router.add_get(SNAPSHOT_PATH, self._snapshot_json)
            admin_app.router.add_get(METRICS_PATH, self._metrics_json)
        self._admin_runner = web.AppRunner(admin_app, access_log=None, shutdown_timeout=1.0)
        await self._admin_runner.setup()
        key, address = "admin_listen", config.admin_listen
        try:
            admin_site: web.BaseSite
            if worker_socket is not None:
                admin_site = web.UnixSite(self._admin_runner, worker_socket)
            else:
                admin_site = web.TCPSite(self._admin_runner, address.host, address.port)
            # The admin API first: a worker takes the supervisor's pushes from
            # here on, so its pool is current before the first client arrives.
            await admin_site.start()
            if before_clients is not None:
                before_clients()
            key, address = "listen", config.listen
            self._client_listener = await asyncio.get_running_loop().create_server(
                client,
                config.listen.host,
                config.listen.port,
                reuse_address=True,
                reuse_port=worker_socket is not None,
                backlog=1024,
            )
        except OSError as exc:
            if self._client_listener is not None:
                self._client_listener.close()
            await self._admin_runner.cleanup()
            await session.close()
            await self.upstream.close()
            if access_log is not None:
                access_log.close()
            if worker_socket is not None:
                raise
            raise CannotListen(config.source, key, str(address), exc) from exc
        assert self._client_listener is not None
        host, port = self._client_listener.sockets[0].getsockname()[:2]
        self.client_address = (str(host), int(port))
        self.admin_address = _bound(self._admin_runner) if worker_socket is None else ("", 0)
        loop = asyncio.get_running_loop()
        self._tasks = []
        if worker_socket is None:
            self._tasks.append(loop.create_task(ticker.run()))
            self._tasks += [loop.create_task(source.run(fleet)) for source in self.sources]
        if config.model_cards:
            # Each replica's /v1/models when it joins or comes back: the catalog's model cards.
            self.cards = CardReader(self.pool, session, self.proxy.catalog.cards)
            self._tasks.append(loop.create_task(self.cards.run()))
        if config.health_check_interval_seconds > 0:
            self.health = HealthChecker(
                self.pool,
                session,
                path=config.health_check_path,
                interval=config.health_check_interval_seconds,
                timeout=config.health_check_timeout_seconds,
            )
            self._tasks.append(loop.create_task(self.health.run()))
        self.ready = True

    async def stop(self) -> None:
        """Graceful: not ready, stop accepting, let requests finish, final push."""
        self.ready = False
        # Held requests would wait for a replica this router will never send
        # them to: they get their 503 now, not at the end of the grace.
        ended = self.pool.cold_start.end_holds()
        if ended:
            said = "1 held request" if ended == 1 else f"{ended} held requests"
            log.info("shutting down: %s answered 503 model_cold", said)
        if self._client_listener is not None:
            # Stop accepting at once; those connected finish within the grace.
            self._client_listener.close()
            self._client_listener = None
        if self._client_server is not None:
            # Idle connections close now; requests in flight get the grace.
            await self._client_server.shutdown(self.config.shutdown_grace_seconds)
            self._client_server = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.proxy is not None and self.proxy.waker is not None:
            await self.proxy.waker.close()
        if self.proxy is not None and self.proxy.access_log is not None:
            self.proxy.access_log.close()
        if self.ticker is not None:
            final = self.ticker.tick()
            if self.sinks.push is not None:
                await self.sinks.push.flush(final)
                await self.sinks.push.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        await self._session.close()
        await self.upstream.close()

    async def _snapshot_json(self, request: web.Request) -> web.Response:
        """The supervisor's collection: what changed since its last report taken (`?since=BOOK.SEQ`), else all."""
        assert self.ticker is not None
        book, _, seq = request.query.get("since", "").partition(".")
        own = self.ticker.snapshotter.book.number
        since = int(seq) if seq.isdigit() and book == str(own) else None
        body = orjson.dumps(report_json(self.ticker.snapshot(since=since)))
        return web.Response(body=body, content_type="application/json")

    async def _metrics_json(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(report(self.registry)), content_type="application/json")

    async def reload(self) -> bool:
        """SIGHUP: every source reads its replica set again (the config file's [[replicas]]); the access log reopens."""
        self.reopen_logs()
        assert self.fleet is not None, "start() first"
        return await reload_all(self.sources, self.fleet)

    def reopen_logs(self) -> None:
        """After logrotate moved the access log away: what is gathered goes to the old file, then a new one."""
        if self.proxy is not None and self.proxy.access_log is not None:
            self.proxy.access_log.reopen()

    @property
    def push(self) -> PushSink | None:
        return self.sinks.push

    @property
    def latest(self) -> LatestSink:
        return self.sinks.latest


def freeze_start_up() -> None:
    """Keep the cyclic collector off what start-up made and what lives as long as the process.

    A router of thousands of replicas holds hundreds of thousands of objects
    (configs, replicas, their records); each full collection would walk them
    all, at a rate set by the garbage the data path makes. Frozen, they are
    never walked again; what is freed later is freed by its reference count.
    Called by the processes' entry points, not by RouterServer: a test process
    that runs many routers must keep collecting what each leaves behind.
    """
    gc.collect()
    gc.freeze()


def _bound(runner: web.AppRunner) -> tuple[str, int]:
    host, port = runner.addresses[0][:2]
    return str(host), int(port)


def http_url(address: tuple[str, int]) -> str:
    host, port = address
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


_Running = TypeVar("_Running", bound="Listening")


async def run_until_signalled(
    server: _Running,
    *,
    stop_server: Callable[[], Awaitable[None]],
    grace_seconds: float,
    on_hup: Callable[[], Coroutine[Any, Any, object]] | None,
    on_ready: Callable[[_Running], None] | None,
    listening: str,
) -> None:
    """Run a started router until SIGTERM or SIGINT, then stop it; SIGHUP calls `on_hup`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[object]] = set()

    def hup() -> None:
        assert on_hup is not None
        # One reload after another's end is fine; each is a task of its own.
        task = loop.create_task(on_hup())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    if on_hup is not None:
        loop.add_signal_handler(signal.SIGHUP, hup)
    log.info("router listening on %s (clients%s) and %s (admin)", server.client_url, listening, server.admin_url)
    if on_ready is not None:
        on_ready(server)
    try:
        await stop.wait()
        log.info("shutting down: finishing requests in flight (up to %gs)", grace_seconds)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await stop_server()


async def serve(
    config: Config, *, on_ready: Callable[[RouterServer], None] | None = None, config_path: str | None = None
) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully; SIGHUP reloads the replicas."""
    server = RouterServer(config, config_path=config_path)
    await server.start()
    freeze_start_up()
    await run_until_signalled(
        server,
        stop_server=server.stop,
        grace_seconds=config.shutdown_grace_seconds,
        on_hup=server.reload if config_path is not None else None,
        on_ready=on_ready,
        listening="",
    )
