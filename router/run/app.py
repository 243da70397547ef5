"""Wiring: the pool, the proxy, the admin API, the usage tick and its sinks.

`RouterServer` owns both listeners and their lifecycle; `serve()` runs one
until SIGTERM/SIGINT and shuts it down gracefully: /readyz turns 503 at
once while requests are still served for `shutdown_delay_seconds` (the
time a load balancer or Kubernetes takes to stop sending here), then the
client port stops accepting, requests in flight get up to
`shutdown_grace_seconds` to finish, the final usage snapshot is pushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from router.control.admin import Admin
from router.control.cards import CardReader
from router.control.engines import EngineReader
from router.control.fleet import LocalFleet
from router.control.health import HealthChecker
from router.control.sinks import Sinks, build_sinks
from router.control.sinks.latest import LatestSink
from router.control.sinks.push import PushSink
from router.control.sinks.waiting import waiting_now
from router.control.sources import (
    ReplicaSource,
    build_sources,
    exclusive_source,
    initial_set,
    reload_all,
    sources_ready,
)
from router.core.clock import Clock, LoopClock
from router.core.config.limits import LimitsConfig
from router.core.config.models import ModelConfig
from router.core.config.settings import Config, load_config
from router.core.config.tenants import Queueing, unit_weight
from router.core.errors import CannotListen, ConfigError
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
from router.http.client import Client
from router.http.protocol_errors import ProtocolErrorCollector
from router.http.server import Server as ClientServer
from router.run.optional import limit_tenants, sleep_tier, waker_of
from router.run.readers import engine_view, start_readers
from router.run.session import make_session
from router.run.tracing import start_tracing
from router.run.worker_metrics import METRICS_PATH, report

log = logging.getLogger("router")
# Where a router listens is said whatever --log-level asks for: with port 0
# (tests, benchmarks, a second router on a laptop) this line is the only
# way to learn the ports, and a run at --log-level warning needs them too.
listening_log = logging.getLogger("router.listening")
listening_log.setLevel(logging.INFO)

# On a worker's private socket only: its whole snapshot, for the supervisor.
SNAPSHOT_PATH = "/internal/v1/snapshot"


class Listening:
    """Where a router listens, once started: its client and admin addresses."""

    client_address: tuple[str, int] | None = None
    admin_address: tuple[str, int] | None = None
    # What /readyz answers: False until started, and again from SIGTERM on.
    ready: bool = False

    @property
    def client_url(self) -> str:
        assert self.client_address is not None, "start() first"
        return http_url(self.client_address)

    @property
    def admin_url(self) -> str:
        assert self.admin_address is not None, "start() first"
        return http_url(self.admin_address)


def _routing(models: Mapping[str, ModelConfig]) -> dict[str, Routing]:
    """Each model's picking policy, as its [models] table configures it."""
    return {n: Routing(m.routing, m.balance_factor, m.prefix_replicas, m.prefix_placement) for n, m in models.items()}


class RouterServer(Listening):
    """One router: its pool, the proxy on the client port, the admin API, the tick and its exporters.

    Made from a Config; start() listens, stop() drains and closes. The same
    class is a whole router (`router serve`) or one worker of `--workers`
    (its supervisor then ticks, exports and answers the admin port).
    """

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
        # The file SIGHUP reads again (the replicas, and the keys: reload_keys).
        self.config_path = config_path
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
            routing=_routing(config.models),
            queueing=Queueing(
                config.priority_classes,
                config.max_queued_per_tenant,
                unit_weight(config.api_keys),
                config.fairness_unit,
                config.fairness_output_weight,
            ),
            engines=engine_view(config, clock),
        )
        if worker_socket is not None:
            # The supervisor bounds the unserved names once it has summed its workers'.
            self.pool.tallies.max_unserved_names = WORKER_UNSERVED_NAMES
        self.sinks = Sinks()
        # The wall clock (Unix time) of the usage map and the wake calls.
        self.wall = wall
        self._mono = clock.now
        self.fleet: LocalFleet | None = None
        self.ticker: Ticker | None = None
        self.proxy: Proxy | None = None
        self.ready = False
        self._client_server: ClientServer | None = None
        self._admin_runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._client_listener: asyncio.Server | None = None
        # What start() opened, closed in reverse by stop().
        self._resources = contextlib.AsyncExitStack()
        self.health: HealthChecker | None = None
        self.cards: CardReader | None = None
        self.engines: EngineReader | None = None
        self.client_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None

    async def start(self, before_clients: Callable[[], None] | None = None) -> None:
        """Listen on both ports; `before_clients` runs once the admin API is up.

        Two assemblies share the parts (`_parts`): a router alone (`_alone`)
        ticks, exports and runs its sources, with the admin API on TCP; a
        worker of `--workers` (`_worker`) leaves those to its supervisor, and
        answers it on a Unix socket. Everything opened is on one exit stack,
        closed in reverse by stop(), or at once if starting fails.
        """
        async with contextlib.AsyncExitStack() as stack:
            admin_app, client = self._parts(stack)
            if self.worker_socket is None:
                await self._alone(stack, admin_app, client, before_clients)
            else:
                await self._worker(stack, self.worker_socket, admin_app, client, before_clients)
            assert self.proxy is not None
            readers = start_readers(
                stack, self.config, self.pool, session=self._session, cards=self.proxy.catalog.cards, clock=self.clock
            )
            self.cards, self.engines, self.health = readers
            self._tasks.extend(readers.run())
            self._resources = stack.pop_all()
        self.ready = True

    def _parts(self, stack: contextlib.AsyncExitStack) -> tuple[web.Application, ClientServer]:
        """What a router and a worker both have: the session, the upstream client, the proxy and its
        server, the ticker, the fleet and the admin API; each thing that must be closed on `stack`."""
        config = self.config
        worker = self.worker_socket is not None
        # Opened first: a file that cannot be opened leaves nothing else to close.
        access_log = AccessLog(config.access_log) if config.access_log else None
        if access_log is not None:
            stack.callback(access_log.close)
        session = make_session(config)
        stack.push_async_callback(session.close)
        self._session = session
        # A worker's usage is ticked, exported and pushed by its supervisor.
        self.sinks = sinks = build_sinks(config, None if worker else session)
        self.ticker = ticker = Ticker(
            self.pool,
            sinks.all,
            router=config.router_name,
            started_at=self.started_at,
            tick_seconds=config.tick_seconds,
            wall=self.wall,
            mono=self._mono,
        )
        self.upstream = Client(
            connect_timeout=config.connect_timeout_seconds,
            keepalive_seconds=config.upstream_keepalive_seconds,
            idle_timeout=config.upstream_idle_timeout_seconds,
            clock=self.clock,
        )
        stack.push_async_callback(self.upstream.close)
        metrics = DataPathMetrics(self.registry)
        self.proxy = proxy = Proxy(config, self.pool, self.upstream, metrics, started_at=self.started_at)
        limit_tenants(proxy, config, self.clock.now, self.registry, stack)
        sleeper = sleep_tier(proxy, config, self.pool, session, self.clock, self.registry, stack)
        proxy.waker = waker_of(config, self.pool, session, self.clock, self.wall, self.registry)
        proxy.access_log = access_log
        start_tracing(proxy, config, stack)
        self._client_server = client = ClientServer(
            proxy.handler(),
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
            exposition=bytes if worker else sinks.exposition,
            before_scrape=lambda: sinks.prometheus.read_waiting(waiting_now(self.pool, self.wall())),
            sleeper=sleeper,
        )
        admin = Admin(
            fleet,
            sinks.latest,
            admin_token=config.admin_token,
            admin_token_reads=config.admin_token_reads,
            # The sources run here unless a supervisor runs them: the first set must be in before ready.
            is_ready=(lambda: self.ready) if worker else (lambda: self.ready and sources_ready(self.sources)),
            rates=sinks.rates,
            wall=self.wall,
            exclusive_source=None if worker else exclusive_source(self.sources),
        )
        # The first snapshot exists before anyone can ask for it.
        ticker.tick()
        return admin.app(), client

    async def _alone(
        self,
        stack: contextlib.AsyncExitStack,
        admin_app: web.Application,
        client: ClientServer,
        before_clients: Callable[[], None] | None,
    ) -> None:
        """A router on its own: it exports its usage, runs its sources, and listens on both TCP ports."""
        config, ticker = self.config, self.ticker
        assert ticker is not None
        self.sinks.register(
            self.registry, sink_failures=lambda: ticker.sink_failures, tick_seconds=lambda: ticker.last_tick_seconds
        )
        for source in self.sources:
            source.register(self.registry)
        key, address = "admin_listen", config.admin_listen
        try:
            runner = self._admin_runner = await admin_runner(stack, admin_app)
            await web.TCPSite(runner, address.host, address.port).start()
            if before_clients is not None:
                before_clients()
            key, address = "listen", config.listen
            self._client_listener = await listen(stack, self.config, client, reuse_port=False)
            self.client_address = _bound_client(self._client_listener)
        except OSError as exc:
            raise CannotListen(config.source, key, str(address), exc) from exc
        self.admin_address = _bound(runner)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(ticker.run()))
        assert self.fleet is not None
        self._tasks += [loop.create_task(source.run(self.fleet)) for source in self.sources]

    async def _worker(
        self,
        stack: contextlib.AsyncExitStack,
        socket_path: str,
        admin_app: web.Application,
        client: ClientServer,
        before_clients: Callable[[], None] | None,
    ) -> None:
        """One worker of `--workers`: the admin API on its supervisor's Unix socket, the client port shared."""
        admin_app.router.add_get(SNAPSHOT_PATH, self._snapshot_json)
        admin_app.router.add_get(METRICS_PATH, self._metrics_json)
        runner = self._admin_runner = await admin_runner(stack, admin_app)
        # The admin API first: the worker takes the supervisor's pushes from
        # here on, so its pool is current before the first client arrives.
        await web.UnixSite(runner, socket_path).start()
        if before_clients is not None:
            before_clients()
        self._client_listener = await listen(stack, self.config, client, reuse_port=True)
        self.client_address = _bound_client(self._client_listener)
        self.admin_address = ("", 0)

    async def stop(self) -> None:
        """Graceful: not ready, stop accepting, let requests finish, final push; then close what start() opened."""
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
        if self.ticker is not None:
            final = self.ticker.tick()
            if self.sinks.push is not None:
                await self.sinks.push.flush(final)
                await self.sinks.push.close()
        self._admin_runner = None
        # The admin API, the upstream client, the session and the access log, last opened first closed.
        await self._resources.aclose()

    async def _snapshot_json(self, request: web.Request) -> web.Response:
        """The supervisor's collection: what changed since its last report taken (`?since=BOOK.SEQ`), else all."""
        assert self.ticker is not None
        return web.Response(
            body=report_since(self.ticker, request.query.get("since", "")), content_type="application/json"
        )

    async def _metrics_json(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(report(self.registry)), content_type="application/json")

    async def reload(self) -> bool:
        """SIGHUP: every source reads its replica set again (the config file's [[replicas]]), the client
        keys are read again, and the access log reopens."""
        self.reopen_logs()
        if self.config_path is not None:
            self.reload_keys(self.config_path)
        assert self.fleet is not None, "start() first"
        return await reload_all(self.sources, self.fleet)

    def reload_keys(self, path: str) -> bool:
        """SIGHUP: `api_keys` as the file says now, all at once (reread_keys); False if the file is refused."""
        fresh = reread_keys(path, self.config, self.proxy)
        if fresh is not None:
            self.config = fresh
        return fresh is not None

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


def report_since(ticker: Ticker, since: str) -> bytes:
    """What changed since the report `since` (`BOOK.SEQ`) names, when it is of this book; else all of it."""
    book, _, seq = since.partition(".")
    taken = int(seq) if seq.isdigit() and book == str(ticker.snapshotter.book.number) else None
    return orjson.dumps(report_json(ticker.snapshot(since=taken)))


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


def reread_keys(path: str, config: Config, proxy: Proxy | None) -> Config | None:
    """`api_keys` (keys, tenants, their classes and weights) from the file as it is now, applied to `proxy`.

    An invalid file changes nothing (None). A request under way keeps the
    tenant it started with. The priority classes are the running ones: a key
    naming a class they do not have is refused with the whole file.
    """
    try:
        fresh = load_config(path)
        if fresh.priority_classes != config.priority_classes:
            raise ConfigError(f"{path}: priority_classes changed: that needs a restart; the keys were kept")
        if not config.count_tokens and any(k.tokens_per_minute is not None for k in fresh.api_keys):
            # A token limit is settled with the answers' usage, which this process does not read:
            # every estimate would be kept for good.
            raise ConfigError(
                f"{path}: a key sets tokens_per_minute, and this router reads no usage (it started without "
                "count_tokens = true): that needs a restart; the keys were kept"
            )
        if proxy is not None:
            proxy.apply_keys(fresh)
    except ConfigError as exc:
        log.error("api_keys not reloaded, nothing changed: %s", exc)  # noqa: TRY400 (the message says it all)
        return None
    if fresh.api_keys != config.api_keys:
        log.info("reloaded api_keys: %d keys, %d tenants", len(fresh.api_keys), len({k.tenant for k in fresh.api_keys}))
    _say_what_limits_wait_for(path, config.limits, fresh.limits)
    return replace(config, api_keys=fresh.api_keys)


def _say_what_limits_wait_for(path: str, running: LimitsConfig | None, fresh: LimitsConfig | None) -> None:
    """Log what of a reloaded file's [limits] waits for a restart: the limiter is made at start."""
    if fresh is None:
        return
    if running is None:
        log.warning(
            "%s limits tenants %s, and this router started with no tenant limited: their limits take effect "
            "at the next restart",
            path,
            ", ".join(sorted(fresh.tenants)),
        )
    elif replace(fresh, tenants=running.tenants) != running:
        log.warning(
            "%s changed [limits] (mode, redis_url, unbounded_output_tokens or the others): that takes effect at "
            "the next restart; the tenants' limits were reloaded",
            path,
        )


async def admin_runner(stack: contextlib.AsyncExitStack, app: web.Application) -> web.AppRunner:
    """The admin API's runner, set up, its cleanup on `stack`."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    return runner


async def listen(
    stack: contextlib.AsyncExitStack, config: Config, client: ClientServer, *, reuse_port: bool
) -> asyncio.Server:
    """The client port, listening (shared between workers with `reuse_port`), its close on `stack`."""
    listener = await asyncio.get_running_loop().create_server(
        client, config.listen.host, config.listen.port, reuse_address=True, reuse_port=reuse_port, backlog=1024
    )
    stack.callback(listener.close)
    return listener


def _bound_client(listener: asyncio.Server) -> tuple[str, int]:
    host, port = listener.sockets[0].getsockname()[:2]
    return (str(host), int(port))


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
    delay_seconds: float = 0.0,
    on_hup: Callable[[], Coroutine[Any, Any, object]] | None,
    on_ready: Callable[[_Running], None] | None,
    listening: str,
) -> None:
    """Run a started router until SIGTERM or SIGINT, then stop it; SIGHUP calls `on_hup`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    said: list[signal.Signals] = []

    def signalled(sig: signal.Signals) -> None:
        said.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled, sig)
    reloads: set[asyncio.Task[object]] = set()

    def hup() -> None:
        assert on_hup is not None
        # One reload after another's end is fine; each is a task of its own.
        task = loop.create_task(on_hup())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    if on_hup is not None:
        loop.add_signal_handler(signal.SIGHUP, hup)
    listening_log.info(
        "router listening on %s (clients%s) and %s (admin)", server.client_url, listening, server.admin_url
    )
    if on_ready is not None:
        on_ready(server)
    try:
        await stop.wait()
        # SIGINT is a person at a terminal (Ctrl-C), with no load balancer to wait for.
        if delay_seconds > 0 and said[0] is signal.SIGTERM:
            await _unready_for(server, stop, delay_seconds)
        log.info("shutting down: finishing requests in flight (up to %gs)", grace_seconds)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await stop_server()


async def _unready_for(server: Listening, signalled: asyncio.Event, seconds: float) -> None:
    """Answer /readyz 503 and go on serving for `seconds`: a Service (or a load balancer) takes
    that long to stop sending new connections here, which would be refused if the port closed
    at once. A second SIGTERM or SIGINT ends the wait."""
    server.ready = False
    log.info("shutting down: /readyz answers 503; serving on for %gs while clients are sent elsewhere", seconds)
    signalled.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(signalled.wait(), seconds)


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
        delay_seconds=config.shutdown_delay_seconds,
        on_hup=server.reload if config_path is not None else None,
        on_ready=on_ready,
        listening="",
    )
