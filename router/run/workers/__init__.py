"""`router serve --workers N`: worker processes on one client port, one admin view.

One Python process proxies on one core. With N workers, each worker is a
whole router (its own pool, proxy and upstream connections) listening on the
shared client port with SO_REUSEPORT, so the kernel spreads connections over
them. The supervisor (the process that `router serve` started) does not
proxy: it owns the admin port and makes the workers look like one router to
the control plane and to Prometheus.

- Usage: once a tick the supervisor asks every worker for its snapshot over
  the worker's private Unix socket and combines them (router/core/usage/merging.py):
  newest stamp wins, counts and in-flight add up. It, not the workers, feeds
  the sinks (the usage endpoint, /metrics, the push).
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
The package, one concern a file: `cores` (how many workers `auto` is),
`ports` (holding the shared client port), `state` (the runtime directory and
the state file), `worker` (one worker's process), `processes` (spawning,
watching and restarting them), `fanout` (the fleet that sends each change
to every worker), `supervisor` (the one router they make: lifecycle, usage,
metrics); the data-path metrics a worker reports and how they merge are
declared in router/run/worker_metrics.py.
"""

from __future__ import annotations

from router.run.workers.cores import usable_cores, worker_count
from router.run.workers.ports import reserve_port
from router.run.workers.processes import WorkerFailed
from router.run.workers.supervisor import Supervisor, serve_workers
from router.run.workers.worker import for_worker, worker_main

__all__ = [
    "Supervisor",
    "WorkerFailed",
    "for_worker",
    "reserve_port",
    "serve_workers",
    "usable_cores",
    "worker_count",
    "worker_main",
]
