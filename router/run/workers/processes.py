"""The worker processes of one supervisor: spawned, watched, restarted when they die, stopped.

A worker is up once its private admin socket answers /readyz. One that
dies is started again, after a pause that grows while it keeps dying
young; what its death cost (its requests in flight, its usage since the
last tick) is the supervisor's to account for, told through `on_death`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from router.run.worker_metrics import Report
from router.run.workers.state import Paths

log = logging.getLogger("router.run.workers")

_READY_TIMEOUT = 60.0
_CALL_TIMEOUT = 10.0


class WorkerFailed(RuntimeError):
    """A worker did not start."""


@dataclass
class Worker:
    """One worker process of --workers: how to start it, and whether it lives."""

    index: int
    paths: Paths
    session: aiohttp.ClientSession
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    live: bool = False
    restarts: int = 0
    quick_deaths: int = 0
    # Its data-path metrics at the last report it answered.
    report: Report | None = None
    watcher: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    @property
    def running(self) -> bool:
        """Its process is up, ready or not yet: it takes changes."""
        return self.process is not None and self.process.returncode is None

    async def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One request to its private admin socket: (status, body)."""
        async with self.session.request(
            method,
            "http://worker" + path,
            data=body,
            headers={"Content-Type": "application/json"} if body is not None else None,
            timeout=aiohttp.ClientTimeout(total=_CALL_TIMEOUT),
        ) as resp:
            return resp.status, await resp.read()


class WorkerProcesses:
    """`count` workers, each started by `argv(worker)`."""

    def __init__(
        self, count: int, argv: Callable[[Worker], list[str]], on_death: Callable[[Worker, int], None]
    ) -> None:
        self.count = count
        self._argv = argv
        # Told of each death (the worker, its exit status) before the restart.
        self._on_death = on_death
        self.workers: list[Worker] = []
        # The directory of the workers' sockets and the state file, once opened.
        self.runtime: Path | None = None
        self.stopping = False

    def open(self, runtime: Path) -> None:
        """The workers' places in the runtime directory, and a client of each one's socket."""
        self.runtime = runtime
        for index in range(self.count):
            paths = Paths(runtime, index)
            session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(paths.socket)))
            self.workers.append(Worker(index, paths, session))

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.live]

    async def spawn_all(self) -> None:
        """Start every worker; WorkerFailed if one does not become ready."""
        await asyncio.gather(*(self._spawn(w) for w in self.workers))

    def watch_all(self) -> None:
        """From now on, restart each worker that dies."""
        loop = asyncio.get_running_loop()
        for worker in self.workers:
            worker.watcher = loop.create_task(self._watch(worker))

    def signal_live(self, sig: signal.Signals) -> None:
        for worker in self.workers:
            if worker.live and worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(sig)

    async def stop(self, grace: float) -> None:
        """SIGTERM every worker and wait `grace` for each to finish its requests; kill those that do not."""
        self.stopping = True
        # No restart from here on, not even one already under way.
        watchers = [w.watcher for w in self.workers if w.watcher is not None]
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(self._reap(w, grace) for w in self.workers))

    async def close(self) -> None:
        """Kill what still runs and close the clients of the sockets."""
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.kill()
                await worker.process.wait()
            await worker.session.close()

    async def _reap(self, worker: Worker, grace: float) -> None:
        process = worker.process
        if process is None:
            return
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            log.error("worker %d (pid %d) outlived the grace; killed", worker.index, process.pid)  # noqa: TRY400
            process.kill()
            await process.wait()

    async def _spawn(self, worker: Worker) -> None:
        worker.paths.final.unlink(missing_ok=True)
        worker.process = await asyncio.create_subprocess_exec(*self._argv(worker))
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

    async def _watch(self, worker: Worker) -> None:
        """Restart a worker that died, once its loss is accounted for."""
        while not self.stopping:
            assert worker.process is not None
            status = await worker.process.wait()
            if self.stopping:
                return
            worker.live = False
            worker.restarts += 1
            self._on_death(worker, status)
            lived = time.monotonic() - worker.started
            worker.quick_deaths = worker.quick_deaths + 1 if lived < 10.0 else 0
            if worker.quick_deaths:
                # One that keeps dying is not restarted in a tight loop.
                await asyncio.sleep(min(30.0, 0.5 * 2 ** (worker.quick_deaths - 1)))
            try:
                await self._spawn(worker)
            except WorkerFailed as exc:
                log.error("%s; trying again", exc)  # noqa: TRY400 (the message says it all)
