"""The supervisor of `--workers`: spawn, watch and restart the workers, and make them one router."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from router.control.admin import Admin
from router.control.fleet import FleetUnavailable
from router.control.sinks import build_sinks
from router.control.sources import build_sources, exclusive_source, initial_set, reload_all, sources_ready
from router.core.config import Config, ReplicaConfig
from router.core.merging import Memory, combine, merged_state
from router.core.usage import UsageSnapshot, publish
from router.run.app import SNAPSHOT_PATH, Listening, run_until_signalled
from router.run.session import make_session
from router.run.worker_metrics import METRICS_PATH, MergedCollector, Report, SampleKey, merge, retire
from router.run.workers.ports import reserve_port
from router.run.workers.state import Paths, make_runtime, write_state

log = logging.getLogger("router.run.workers")

_READY_TIMEOUT = 60.0
_CALL_TIMEOUT = 10.0


@dataclass
class _Worker:
    index: int
    paths: Paths
    session: aiohttp.ClientSession
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    live: bool = False
    # Its snapshot at the last collection: what is folded into the totals if it dies.
    last: UsageSnapshot | None = None
    restarts: int = 0
    quick_deaths: int = 0
    # Its data-path metrics at the last report it answered.
    report: Report | None = None
    watcher: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    async def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        async with self.session.request(
            method,
            "http://worker" + path,
            data=body,
            headers={"Content-Type": "application/json"} if body is not None else None,
            timeout=aiohttp.ClientTimeout(total=_CALL_TIMEOUT),
        ) as resp:
            return resp.status, await resp.read()


class Supervisor(Listening):
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
        self.stopping = False
        # The replica-set sources run here, once, never in the workers: each
        # change reaches every worker through the supervised fleet.
        self.sources = build_sources(config, config_path)
        # desired: what a (re)starting worker loads; current: what every live
        # worker has acknowledged, which GET /api/v1/endpoints answers.
        self.desired: tuple[ReplicaConfig, ...] = initial_set(self.sources)
        self.current: tuple[ReplicaConfig, ...] = self.desired
        self.draining: set[str] = set()
        self.memory = Memory()
        self.registry = CollectorRegistry()
        self.sinks = build_sinks(config, None)
        self.sink_failures: dict[str, int] = {}
        self.last_tick_seconds = 0.0
        self.collect_failures = 0
        # The workers' data-path families (help, type), and dead workers' last counts.
        self.families: dict[str, tuple[str, str]] = {}
        self.retired: dict[SampleKey, float] = {}
        self.workers: list[_Worker] = []
        self._hold: socket.socket | None = None
        self._runtime: Path | None = None
        self._admin_runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changes = asyncio.Lock()
        self.client_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None

    # Lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        config = self.config
        # First: without a place for the workers' sockets nothing may listen.
        self._runtime = make_runtime(os.environ)
        self._hold = reserve_port(config.listen.host, config.listen.port)
        self.client_address = (config.listen.host, self._hold.getsockname()[1])
        self._write_state()
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
            for index in range(self.count):
                paths = Paths(self._runtime, index)
                session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(paths.socket)))
                self.workers.append(_Worker(index, paths, session))
            await asyncio.gather(*(self._spawn(w) for w in self.workers))
            first = await self.collect()
            if first is not None:
                publish(self.sinks.all, first, self.sink_failures)
            admin = Admin(
                self.fleet,
                self.sinks.latest,
                admin_token=config.admin_token,
                # Ready while any worker serves: one restarting leaves the others.
                # and not before the sources applied their first set.
                is_ready=lambda: self.ready and any(w.live for w in self.workers) and sources_ready(self.sources),
                rates=self.sinks.rates,
                wall=self._wall,
                exclusive_source=exclusive_source(self.sources),
            )
            self._admin_runner = web.AppRunner(admin.app(), access_log=None, shutdown_timeout=1.0)
            await self._admin_runner.setup()
            site = web.TCPSite(self._admin_runner, config.admin_listen.host, config.admin_listen.port)
            await site.start()
        except BaseException:
            await self._teardown()
            raise
        host, port = self._admin_runner.addresses[0][:2]
        self.admin_address = (str(host), int(port))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick_forever())]
        self._tasks += [loop.create_task(source.run(self.fleet)) for source in self.sources]
        for worker in self.workers:
            worker.watcher = loop.create_task(self._watch(worker))
        self.ready = True

    async def stop(self) -> None:
        """Graceful, as one router: not ready, workers finish their requests, final push."""
        self.ready = False
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # No restart from here on, not even one already under way.
        watchers = [w.watcher for w in self.workers if w.watcher is not None]
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        grace = self.config.shutdown_grace_seconds + 10.0
        await asyncio.gather(*(self._reap(w, grace) for w in self.workers))
        finals = []
        for worker in self.workers:
            try:
                finals.append(UsageSnapshot.from_json(orjson.loads(worker.paths.final.read_bytes())))
            except (OSError, ValueError, KeyError):
                if worker.last is not None:
                    self.memory.retire(worker.last)
        final = self._combine(finals)
        publish(self.sinks.all, final, self.sink_failures)
        if self.sinks.push is not None:
            await self.sinks.push.flush(final)
            await self.sinks.push.close()
        await self._teardown()

    async def _reap(self, worker: _Worker, grace: float) -> None:
        process = worker.process
        if process is None:
            return
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            log.error("worker %d (pid %d) outlived the grace; killed", worker.index, process.pid)  # noqa: TRY400
            process.kill()
            await process.wait()

    async def _teardown(self) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.kill()
                await worker.process.wait()
            await worker.session.close()
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

    async def _spawn(self, worker: _Worker) -> None:
        assert self._runtime is not None
        worker.paths.final.unlink(missing_ok=True)
        worker.process = await asyncio.create_subprocess_exec(
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
        )
        worker.started = time.monotonic()
        deadline = worker.started + _READY_TIMEOUT
        while True:
            if worker.process.returncode is not None:
                raise WorkerFailed(
                    f"worker {worker.index} exited with status {worker.process.returncode} as it started"
                )
            try:
                status, _ = await worker.call("GET", "/readyz")
                if status == 200:
                    break
            except (aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline:
                # Not left running half-started: its watcher restarts it.
                worker.process.kill()
                raise WorkerFailed(f"worker {worker.index} was not ready within {_READY_TIMEOUT:g} s")
            await asyncio.sleep(0.05)
        worker.live = True
        log.info("worker %d ready (pid %d)", worker.index, worker.pid)

    async def _watch(self, worker: _Worker) -> None:
        """Restart a worker that died, and say what was lost with it."""
        while not self.stopping:
            assert worker.process is not None
            status = await worker.process.wait()
            if self.stopping:
                return
            worker.live = False
            worker.restarts += 1
            cut = sum(r.in_flight for r in worker.last.replicas) if worker.last is not None else 0
            log.error(
                "worker %d (pid %d) exited with status %s; restarting it. Its requests in flight (%d at its "
                "last report) were cut off, and usage it saw since then is lost: replicas are watched anew "
                "from its restart.",
                worker.index,
                worker.pid,
                status,
                cut,
            )
            if worker.last is not None:
                self.memory.retire(worker.last)
                worker.last = None
            retire(self.retired, worker.report)
            worker.report = None
            lived = time.monotonic() - worker.started
            worker.quick_deaths = worker.quick_deaths + 1 if lived < 10.0 else 0
            if worker.quick_deaths:
                # One that keeps dying is not restarted in a tight loop.
                await asyncio.sleep(min(30.0, 0.5 * 2 ** (worker.quick_deaths - 1)))
            try:
                await self._spawn(worker)
            except WorkerFailed as exc:
                log.error("%s; trying again", exc)  # noqa: TRY400 (the message says it all)

    # Usage ---------------------------------------------------------------------------

    async def collect(self) -> UsageSnapshot | None:
        """Every live worker's snapshot now, combined; None if one did not answer."""
        live = [w for w in self.workers if w.live]
        answers = await asyncio.gather(*(w.call("GET", SNAPSHOT_PATH) for w in live), return_exceptions=True)
        snapshots = []
        for worker, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException) or answer[0] != 200:
                if worker.live:
                    self.collect_failures += 1
                    log.warning("worker %d did not report its usage: %r", worker.index, answer)
                    return None
                continue  # it died meanwhile; its totals were retired
            worker.last = UsageSnapshot.from_json(orjson.loads(answer[1]))
            snapshots.append(worker.last)
        return self._combine(snapshots)

    def _combine(self, snapshots: list[UsageSnapshot]) -> UsageSnapshot:
        config = self.config
        return combine(
            snapshots,
            self.memory,
            router=config.router_name,
            started_at=self.started_at,
            generated_at=self._wall(),
            tick_seconds=config.tick_seconds,
        )

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
                snapshot = await self.collect()
            except Exception:
                log.exception("usage collection failed")
                continue
            # A tick whose workers did not all answer publishes nothing: the
            # previous snapshot stays, and its age says so.
            if snapshot is not None:
                publish(self.sinks.all, snapshot, self.sink_failures)
            self.last_tick_seconds = time.perf_counter() - began

    # Changes -------------------------------------------------------------------------

    def _write_state(self) -> None:
        assert self._runtime is not None
        write_state(self._runtime, self.desired, self.draining)

    async def _everywhere(self, method: str, path: str, body: bytes) -> list[tuple[int, bytes]]:
        """Send one change to every worker that is up; raise if a live one did not take it.

        A worker that is starting has its admin socket up before it reads the
        state file, so it either gets this call or reads the new state.
        """
        targets = [w for w in self.workers if w.process is not None and w.process.returncode is None]
        answers = await asyncio.gather(*(w.call(method, path, body) for w in targets), return_exceptions=True)
        taken: list[tuple[int, bytes]] = []
        missed: list[str] = []
        for worker, answer in zip(targets, answers, strict=True):
            if isinstance(answer, BaseException):
                if worker.live:
                    missed.append(f"worker {worker.index}: {answer!r}")
            elif answer[0] >= 500:
                missed.append(f"worker {worker.index}: HTTP {answer[0]}")
            else:
                taken.append(answer)
        if missed:
            raise FleetUnavailable("Not every worker took the change: " + "; ".join(missed))
        return taken

    async def set_replicas(self, configs: tuple[ReplicaConfig, ...]) -> dict[str, Any]:
        async with self._changes:
            self.desired = configs
            self.draining &= {c.id for c in configs}
            self._write_state()
            body = orjson.dumps({"replicas": [c.as_json() for c in configs]})
            try:
                answers = await self._everywhere("PUT", "/api/v1/endpoints", body)
            finally:
                # Those that answered have it; one that did not restarts with it.
                self.current = configs
        diff: dict[str, Any] = orjson.loads(answers[0][1])
        log.info(
            "replica set applied by %d workers: %d added, %d removed, %d changed",
            len(answers),
            len(diff["added"]),
            len(diff["removed"]),
            len(diff["changed"]),
        )
        return diff

    async def set_draining(self, replica_id: str, draining: bool) -> dict[str, Any] | None:
        async with self._changes:
            if draining:
                self.draining.add(replica_id)
            else:
                self.draining.discard(replica_id)
            self._write_state()
            body = orjson.dumps({"state": "draining" if draining else "ready"})
            answers = await self._everywhere("POST", f"/api/v1/replicas/{replica_id}/state", body)
        found = [orjson.loads(data) for status, data in answers if status == 200]
        if not found:
            self.draining.discard(replica_id)
            return None
        in_flight = sum(a["in_flight"] for a in found)
        return {"id": replica_id, "state": merged_state([a["state"] for a in found], in_flight), "in_flight": in_flight}

    async def reload(self) -> bool:
        """SIGHUP: every source reads its replica set again and applies it to every worker.

        The workers get the signal too: each reopens its own access log.
        """
        for worker in self.workers:
            if worker.live and worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGHUP)
        return await reload_all(self.sources, self.fleet)

    @property
    def fleet(self) -> _SupervisedFleet:
        return _SupervisedFleet(self)

    async def metrics(self) -> bytes:
        """One set of series: the supervisor's own, and the workers' data-path ones merged by mode."""
        # Fresh per-worker figures for router_worker_in_flight_requests.
        await self.collect()
        # Counters summed over workers must never go down: a worker that does
        # not answer (dying, restarting) counts with its last figures, and a
        # dead worker's last figures stay in the sum (_watch retires them).
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
        return own + generate_latest(extra)


class WorkerFailed(RuntimeError):
    """A worker did not start."""


class _WorkerCollector(Collector):
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
            if worker.live and worker.last is not None:
                in_flight.add_metric([str(worker.index)], sum(r.in_flight for r in worker.last.replicas))
        yield in_flight
        yield CounterMetricFamily(
            "router_worker_usage_collect_failures",
            "Ticks at which a worker did not report its usage (nothing was published).",
            value=s.collect_failures,
        )


class _SupervisedFleet:
    def __init__(self, supervisor: Supervisor) -> None:
        self.s = supervisor

    async def snapshot(self) -> UsageSnapshot:
        snapshot = await self.s.collect()
        if snapshot is None:
            raise FleetUnavailable("Not every worker reported its usage; try again.")
        return snapshot

    async def configs(self) -> tuple[ReplicaConfig, ...]:
        return self.s.current

    async def set_replicas(self, configs: tuple[ReplicaConfig, ...]) -> dict[str, Any]:
        return await self.s.set_replicas(configs)

    async def set_draining(self, replica_id: str, draining: bool) -> dict[str, Any] | None:
        return await self.s.set_draining(replica_id, draining)

    async def metrics(self) -> bytes:
        return await self.s.metrics()


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
    await run_until_signalled(
        supervisor,
        stop_server=supervisor.stop,
        grace_seconds=config.shutdown_grace_seconds,
        on_hup=supervisor.reload,
        on_ready=on_ready,
        listening=f", {workers} workers",
    )
