"""The supervisor of `--workers`: makes the workers one router.

It holds the client port, runs the replica-set sources and the admin API,
collects and combines the workers' usage each tick, merges their metrics,
and stops them as one router stops. The worker processes themselves are
`processes.py`'s to spawn, watch and restart; each change to the replica
set reaches them through `fanout.py`'s fleet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from router.control.admin import Admin
from router.control.sinks import build_sinks
from router.control.sinks.waiting import waiting_of
from router.control.sources import build_sources, exclusive_source, initial_set, reload_all, sources_ready
from router.core.config.settings import Config
from router.core.errors import CannotListen
from router.core.usage.merging import Combiner, Memory, WorkerReport
from router.core.usage.snapshots import UsageSnapshot, publish
from router.run.app import SNAPSHOT_PATH, Listening, freeze_start_up, run_until_signalled
from router.run.session import make_session
from router.run.worker_metrics import METRICS_PATH, MergedCollector, Report, SampleKey, merge, retire
from router.run.workers.fanout import SupervisedFleet
from router.run.workers.ports import check_free, reserve_port
from router.run.workers.processes import Worker, WorkerProcesses
from router.run.workers.state import make_runtime

log = logging.getLogger("router.run.workers")


class Supervisor(Listening):
    """`router serve --workers N`: starts and restarts the workers, merges their usage, and serves the admin port."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: str,
        workers: int,
        log_level: str = "info",
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.count = workers
        self.log_level = log_level
        self._wall = wall
        self.started_at = wall()
        self.ready = False
        # The replica-set sources run here, once, never in the workers: each
        # change reaches every worker through the supervised fleet.
        self.sources = build_sources(config, config_path)
        self.processes = WorkerProcesses(workers, self._worker_argv, self._lost)
        self.fleet = SupervisedFleet(
            self.processes, initial_set(self.sources), collect=self.collect, metrics=self.metrics
        )
        self.memory = Memory()
        # The workers' reports, combined as they come (router/core/usage/merging.py).
        self.combiner = Combiner(self.memory)
        # The seq of the last snapshot published: the next carries what changed since.
        self._published: int | None = None
        self.registry = CollectorRegistry()
        self.sinks = build_sinks(config, None)
        self.sink_failures: dict[str, int] = {}
        self.last_tick_seconds = 0.0
        self.collect_failures = 0
        # The workers' data-path families (help, type), and dead workers' last counts.
        self.families: dict[str, tuple[str, str]] = {}
        self.retired: dict[SampleKey, float] = {}
        self._hold: socket.socket | None = None
        self._runtime: Path | None = None
        self._admin_runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.client_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None

    @property
    def workers(self) -> list[Worker]:
        return self.processes.workers

    # Lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        config = self.config
        # First: without a place for the workers' sockets nothing may listen.
        self._runtime = make_runtime(os.environ)
        key = "listen"
        try:
            self._hold = reserve_port(config.listen.host, config.listen.port)
            key = "admin_listen"
            check_free(config.admin_listen.host, config.admin_listen.port)
        except OSError as exc:
            if self._hold is not None:
                self._hold.close()
                self._hold = None
            shutil.rmtree(self._runtime, ignore_errors=True)
            self._runtime = None
            raise CannotListen(config.source, key, str(getattr(config, key)), exc) from exc
        self.client_address = (config.listen.host, self._hold.getsockname()[1])
        self._session = make_session(config)
        self.sinks = build_sinks(config, self._session)
        self.sink_failures = {sink.name: 0 for sink in self.sinks.all}
        self.sinks.register(
            self.registry, sink_failures=lambda: self.sink_failures, tick_seconds=lambda: self.last_tick_seconds
        )
        self.registry.register(_WorkerCollector(self))
        for source in self.sources:
            source.register(self.registry)
        try:
            self.processes.open(self._runtime)
            # Before any worker starts: each loads the set from it.
            self.fleet.write_state()
            await self.processes.spawn_all()
            first = await self.collect()
            if first is not None:
                self._publish(first)
            admin = Admin(
                self.fleet,
                self.sinks.latest,
                admin_token=config.admin_token,
                admin_token_reads=config.admin_token_reads,
                # Ready while any worker serves: one restarting leaves the others.
                # and not before the sources applied their first set.
                is_ready=lambda: self.ready and bool(self.processes.live()) and sources_ready(self.sources),
                rates=self.sinks.rates,
                wall=self._wall,
                exclusive_source=exclusive_source(self.sources),
            )
            self._admin_runner = web.AppRunner(admin.app(), access_log=None, shutdown_timeout=1.0)
            await self._admin_runner.setup()
            site = web.TCPSite(self._admin_runner, config.admin_listen.host, config.admin_listen.port)
            try:
                await site.start()
            except OSError as exc:
                raise CannotListen(config.source, "admin_listen", str(config.admin_listen), exc) from exc
        except BaseException:
            await self._teardown()
            raise
        host, port = self._admin_runner.addresses[0][:2]
        self.admin_address = (str(host), int(port))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick_forever())]
        self._tasks += [loop.create_task(source.run(self.fleet)) for source in self.sources]
        self.processes.watch_all()
        self.ready = True

    async def stop(self) -> None:
        """Graceful, as one router: not ready, workers finish their requests, final push."""
        self.ready = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.processes.stop(self.config.shutdown_grace_seconds + 10.0)
        for worker in self.workers:
            try:
                final = WorkerReport.from_json(orjson.loads(worker.paths.final.read_bytes()))
            except (OSError, ValueError, KeyError):
                # Its last report taken is its last word.
                self.combiner.drop(worker.index)
            else:
                self.combiner.update(worker.index, final)
        final_snapshot = self._combine(self._published)
        self._publish(final_snapshot)
        if self.sinks.push is not None:
            await self.sinks.push.flush(final_snapshot)
            await self.sinks.push.close()
        await self._teardown()

    async def _teardown(self) -> None:
        await self.processes.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        if self._session is not None:
            await self._session.close()
        if self._hold is not None:
            self._hold.close()
            self._hold = None
        if self._runtime is not None:
            shutil.rmtree(self._runtime, ignore_errors=True)

    def _worker_argv(self, worker: Worker) -> list[str]:
        assert self._runtime is not None
        return [
            sys.executable,
            "-m",
            "router",
            "_worker",
            "--config",
            self.config_path,
            "--port",
            str(self.client_address[1] if self.client_address else 0),
            "--workers",
            str(self.count),
            "--index",
            str(worker.index),
            "--runtime",
            str(self._runtime),
            "--log-level",
            self.log_level,
        ]

    def _lost(self, worker: Worker, status: int) -> None:
        """Say what a worker that died took with it, and take its last figures into the totals."""
        cut = self.combiner.in_flight(worker.index) or 0
        log.error(
            "worker %d (pid %d) exited with status %s; restarting it. Its requests in flight (%d at its "
            "last report) were cut off, and usage it saw since then is lost: replicas are watched anew "
            "from its restart.",
            worker.index,
            worker.pid,
            status,
            cut,
        )
        self.combiner.drop(worker.index)
        retire(self.retired, worker.report)
        worker.report = None

    # Usage ---------------------------------------------------------------------------

    async def collect(self, since: int | None = None) -> UsageSnapshot | None:
        """Every live worker's report now, combined; None if one did not answer.

        Each worker says what changed since its report last taken, and only
        the replicas some worker changed are combined again. `since`: the seq
        of an earlier combined snapshot, whose changes the new one carries.
        """
        live = [w for w in self.workers if w.live]
        answers = await asyncio.gather(
            *(w.call("GET", SNAPSHOT_PATH + _since(self.combiner.since(w.index))) for w in live),
            return_exceptions=True,
        )
        failed = False
        for worker, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException) or answer[0] != 200:
                if worker.live:
                    self.collect_failures += 1
                    log.warning("worker %d did not report its usage: %r", worker.index, answer)
                    failed = True
                continue  # it died meanwhile; its totals were retired
            if worker.live:
                self.combiner.update(worker.index, WorkerReport.from_json(orjson.loads(answer[1])))
        return None if failed else self._combine(since)

    def _combine(self, since: int | None = None) -> UsageSnapshot:
        config = self.config
        return self.combiner.snapshot(
            router=config.router_name,
            started_at=self.started_at,
            generated_at=self._wall(),
            tick_seconds=config.tick_seconds,
            since=since,
        )

    def _publish(self, snapshot: UsageSnapshot) -> None:
        publish(self.sinks.all, snapshot, self.sink_failures)
        self._published = snapshot.seq

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.config.tick_seconds
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if loop.time() > next_at + self.config.tick_seconds:
                next_at = loop.time()
            began = time.perf_counter()
            try:
                snapshot = await self.collect(since=self._published)
            except Exception:
                log.exception("usage collection failed")
                continue
            # A tick whose workers did not all answer publishes nothing: the
            # previous snapshot stays, and its age says so.
            if snapshot is not None:
                self._publish(snapshot)
            self.last_tick_seconds = time.perf_counter() - began

    # Changes and metrics -----------------------------------------------------------------

    async def reload(self) -> bool:
        """SIGHUP: every source reads its replica set again and applies it to every worker.

        The workers get the signal too: each reopens its own access log.
        """
        self.processes.signal_live(signal.SIGHUP)
        return await reload_all(self.sources, self.fleet)

    async def metrics(self) -> bytes:
        """One set of series: the supervisor's own, and the workers' data-path ones merged by mode."""
        # Fresh per-worker figures for router_worker_in_flight_requests, and the
        # requests held and queued now: every worker's, read at this scrape.
        fresh = await self.collect()
        # A worker that did not answer: the last tick's figures for all, never half fresh.
        self.sinks.prometheus.waiting = None if fresh is None else waiting_of(fresh)
        # Counters summed over workers must never go down: a worker that does
        # not answer (dying, restarting) counts with its last figures, and a
        # dead worker's last figures stay in the sum (_lost retires them).
        live = [w for w in self.workers if w.live]
        answers = await asyncio.gather(*(w.call("GET", METRICS_PATH) for w in live), return_exceptions=True)
        for worker, answer in zip(live, answers, strict=True):
            if not isinstance(answer, BaseException) and answer[0] == 200:
                worker.report = Report(orjson.loads(answer[1]))
                self.families.update(worker.report.families)
        merged = merge([w.report for w in self.workers if w.report is not None], self.retired)
        loop = asyncio.get_running_loop()
        own = await loop.run_in_executor(None, generate_latest, self.registry)
        extra = CollectorRegistry()
        extra.register(MergedCollector(self.families, merged))
        return own + generate_latest(extra) + self.sinks.exposition()


def _since(taken: tuple[int, int] | None) -> str:
    """The query asking a worker for what changed since its report last taken."""
    return "" if taken is None else f"?since={taken[0]}.{taken[1]}"


class _WorkerCollector(Collector):
    """The workers' own series for /metrics, read from their last reports."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.supervisor
        yield GaugeMetricFamily(
            "router_workers", "Worker processes serving the client port now.", value=sum(w.live for w in s.workers)
        )
        restarts = CounterMetricFamily(
            "router_worker_restarts", "Workers that died and were started again.", labels=["worker"]
        )
        for worker in s.workers:
            restarts.add_metric([str(worker.index)], worker.restarts)
        yield restarts
        in_flight = GaugeMetricFamily(
            "router_worker_in_flight_requests",
            "Requests in flight per worker at the last usage collection (how evenly the kernel spreads them).",
            labels=["worker"],
        )
        for worker in s.workers:
            reported = s.combiner.in_flight(worker.index)
            if worker.live and reported is not None:
                in_flight.add_metric([str(worker.index)], reported)
        yield in_flight
        yield CounterMetricFamily(
            "router_worker_usage_collect_failures",
            "Ticks at which a worker did not report its usage (nothing was published).",
            value=s.collect_failures,
        )


async def serve_workers(
    config: Config,
    *,
    config_path: str,
    workers: int,
    log_level: str = "info",
    on_ready: Callable[[Supervisor], None] | None = None,
) -> None:
    """`router serve --workers N`: run until SIGTERM/SIGINT; SIGHUP reloads the replicas."""
    supervisor = Supervisor(config, config_path=config_path, workers=workers, log_level=log_level)
    await supervisor.start()
    freeze_start_up()
    await run_until_signalled(
        supervisor,
        stop_server=supervisor.stop,
        grace_seconds=config.shutdown_grace_seconds,
        delay_seconds=config.shutdown_delay_seconds,
        on_hup=supervisor.reload,
        on_ready=on_ready,
        listening=f", {workers} workers",
    )
