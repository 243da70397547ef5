"""`router serve --workers N`: worker processes on one client port, one admin view.

One Python process proxies on one core. With N workers, each worker is a
whole router (its own pool, proxy and upstream connections) listening on the
shared client port with SO_REUSEPORT, so the kernel spreads connections over
them. The supervisor (this module, the process that `router serve` started)
does not proxy: it owns the admin port and makes the workers look like one
router to the control plane and to Prometheus.

- Usage: once a tick the supervisor asks every worker for its snapshot over
  the worker's private Unix socket and combines them (combined.py): newest
  stamp wins, counts and in-flight add up. It, not the workers, feeds the
  sinks (the usage endpoint, /metrics, the push).
- Changes (PUT /api/v1/endpoints, drain): validated once, written to a state
  file that a (re)starting worker loads, then sent to every worker; the call
  answers once every worker has taken it. A worker brings its admin socket
  up before loading the state file and before its client port opens, so no
  worker ever serves a replica set older than an acknowledged push.
- The drain fence reads `drained` only when every worker holds the replica
  out and none has it in flight.
- A worker that dies is restarted (with a growing pause if it keeps dying);
  its loss is logged: its requests in flight were cut off, and what it did
  since the last tick is unknown, so the watch of every replica restarts
  from the new worker's start (unknown is never idle).
- Concurrency limits (max_in_flight_per_replica, max_in_flight) are split
  evenly over the workers, rounded down, so that together they never exceed
  the configured limit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from router.admin import Admin
from router.app import SNAPSHOT_PATH, Listening, RouterServer, run_until_signalled
from router.combined import Memory, combine, merged_state
from router.config import Config, ReplicaConfig, load_config, parse_replicas, replicas_where
from router.errors import ConfigError
from router.fleet import FleetUnavailable
from router.sinks import build_sinks
from router.sources import build_sources, exclusive_source, initial_set, reload_all
from router.upstream import make_session
from router.usage import UsageSnapshot, publish

log = logging.getLogger("router.workers")

# Families a worker's own /metrics holds (the data path's histograms); the
# supervisor sums them over the workers. Everything else it exports itself.
_WORKER_FAMILIES = (
    "router_request_duration_seconds",
    "router_time_to_first_byte_seconds",
    "router_client_protocol_errors",
    "router_upstream_protocol_errors",
)
_READY_TIMEOUT = 60.0
_CALL_TIMEOUT = 10.0


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota.

    In a container limited to 2 CPUs on a 64-core node the affinity says 64;
    the quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`) says 2.
    """
    cores = len(os.sched_getaffinity(0))
    quota: float | None = None
    try:
        fields = (cgroup / "cpu.max").read_text().split()
        # "max 100000" is no quota; "200000 100000" is two CPUs' worth.
        if fields[0] != "max":
            quota = int(fields[0]) / int(fields[1] if len(fields) > 1 else 100000)
    except (OSError, ValueError):
        try:
            limit_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
            period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
            if limit_us > 0 and period_us > 0:
                quota = limit_us / period_us
        except (OSError, ValueError):
            quota = None
    if quota is not None and quota > 0:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def worker_count(value: str, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """`--workers`: a number >= 1, or `auto` for every core this process may use."""
    if value == "auto":
        return usable_cores(cgroup)
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 or 'auto', got {value!r}")
    return count


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
        # The buffered-body cap bounds the router's memory: the workers' shares add up to it.
        max_buffered_body_bytes=share(config.max_buffered_body_bytes),
    )


# The worker's side ---------------------------------------------------------------


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
    try:
        config = for_worker(load_config(args.config), args.port, args.workers)
    except ConfigError as exc:
        print(f"router worker {args.index}: {exc}", file=sys.stderr)
        return 2
    uvloop.run(_run_worker(config, Path(args.runtime), args.index))
    return 0


async def _run_worker(config: Config, runtime: Path, index: int) -> None:
    paths = _Paths(runtime, index)
    server = RouterServer(config, worker_socket=str(paths.socket))
    await server.start(before_clients=lambda: _load_state(server, paths.state))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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


def _load_state(server: RouterServer, state: Path) -> None:
    """The supervisor's current replica set and drains, newer than the config file's."""
    try:
        doc = orjson.loads(state.read_bytes())
    except FileNotFoundError:
        return
    configs = parse_replicas(replicas_where(str(state)), "replicas", doc["replicas"])
    server.pool.set_replicas(configs)
    for replica_id in doc["draining"]:
        server.pool.set_draining(replica_id, True)


@dataclass(frozen=True)
class _Paths:
    runtime: Path
    index: int

    @property
    def socket(self) -> Path:
        return self.runtime / f"worker-{self.index}.sock"

    @property
    def final(self) -> Path:
        return self.runtime / f"worker-{self.index}.final.json"

    @property
    def state(self) -> Path:
        return self.runtime / "state.json"


# The supervisor's side -----------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    paths: _Paths
    session: aiohttp.ClientSession
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    live: bool = False
    # Its snapshot at the last collection: what is folded into the totals if it dies.
    last: UsageSnapshot | None = None
    restarts: int = 0
    quick_deaths: int = 0
    # Its data-path samples at the last /metrics it answered.
    samples: dict[_SampleKey, float] = field(default_factory=dict)
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


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold the client port for the workers (and learn it when `port` is 0).

    First a plain bind, which fails if anything listens there already, so
    that two routers never share a port by accident; then a socket in the
    SO_REUSEPORT group the workers join. It never listens, so it takes no
    connections.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        port = probe.getsockname()[1]
    hold = socket.socket(family, kind, proto)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind((address[0], port, *address[2:]))
    return hold


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
        self.families: dict[str, _Family] = {}
        self.retired_samples: dict[_SampleKey, float] = {}
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
        self._hold = reserve_port(config.listen.host, config.listen.port)
        self.client_address = (config.listen.host, self._hold.getsockname()[1])
        # mkdtemp makes it 0700: only this user reaches the workers' sockets.
        self._runtime = Path(tempfile.mkdtemp(prefix="router-workers-"))
        self._write_state()
        self._session = make_session(config)
        self.sinks = build_sinks(config, self._session)
        self.sink_failures = {sink.name: 0 for sink in self.sinks.all}
        self.sinks.register(
            self.registry, sink_failures=lambda: self.sink_failures, tick_seconds=lambda: self.last_tick_seconds
        )
        self.registry.register(_WorkerCollector(self))
        try:
            for index in range(self.count):
                paths = _Paths(self._runtime, index)
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
                is_ready=lambda: self.ready and any(w.live for w in self.workers),
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
            _add_samples(self.retired_samples, worker.samples)
            worker.samples = {}
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
        path = self._runtime / "state.json"
        partial = path.with_suffix(".partial")
        doc = {"replicas": [c.as_json() for c in self.desired], "draining": sorted(self.draining)}
        partial.write_bytes(orjson.dumps(doc))
        partial.rename(path)

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
        """SIGHUP: every source reads its replica set again and applies it to every worker."""
        return await reload_all(self.sources, self.fleet)

    @property
    def fleet(self) -> _SupervisedFleet:
        return _SupervisedFleet(self)

    async def metrics(self) -> bytes:
        """One set of series: the supervisor's own, and the workers' histograms summed."""
        # Fresh per-worker figures for router_worker_in_flight_requests.
        await self.collect()
        # Counters summed over workers must never go down: a worker that does
        # not answer (dying, restarting) counts with its last figures, and a
        # dead worker's last figures stay in the sum (_watch retires them).
        live = [w for w in self.workers if w.live]
        answers = await asyncio.gather(*(w.call("GET", "/metrics") for w in live), return_exceptions=True)
        for worker, answer in zip(live, answers, strict=True):
            if not isinstance(answer, BaseException) and answer[0] == 200:
                worker.samples = _data_path_samples(answer[1].decode(), self.families)
        summed = dict(self.retired_samples)
        for worker in self.workers:
            _add_samples(summed, worker.samples)
        loop = asyncio.get_running_loop()
        own = await loop.run_in_executor(None, generate_latest, self.registry)
        extra = CollectorRegistry()
        extra.register(_Fixed(_as_families(self.families, summed)))
        return own + generate_latest(extra)


class WorkerFailed(RuntimeError):
    """A worker did not start."""


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


# One family's identity, and one sample's: (family, sample name, labels).
_Family = tuple[str, str, str]  # name, help, type
_SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]


def _data_path_samples(text: str, families: dict[str, _Family]) -> dict[_SampleKey, float]:
    """A worker's data-path samples from its /metrics text; their families noted in `families`."""
    samples: dict[_SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in _WORKER_FAMILIES:
            continue
        families[family.name] = (family.name, family.documentation, family.type)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # a creation time, not a count: meaningless summed
            samples[(family.name, sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _add_samples(total: dict[_SampleKey, float], more: dict[_SampleKey, float]) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value


def _as_families(families: dict[str, _Family], samples: dict[_SampleKey, float]) -> list[Metric]:
    out: dict[str, Metric] = {}
    for (family, name, labels), value in samples.items():
        metric = out.get(family)
        if metric is None:
            metric = out[family] = Metric(*families[family])
        metric.add_sample(name, dict(labels), value)
    return list(out.values())


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
