"""The supervisor's runtime directory: each worker's socket and final report, and the state file.

The state file holds the current replica set and drains: a (re)starting
worker loads it before its client port opens, so that no worker ever serves
a set older than an acknowledged push.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from router.core.config import ReplicaConfig, parse_replicas, replicas_where
from router.run.app import RouterServer


@dataclass(frozen=True)
class Paths:
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


def write_state(runtime: Path, desired: Iterable[ReplicaConfig], draining: Iterable[str]) -> None:
    path = runtime / "state.json"
    partial = path.with_suffix(".partial")
    doc = {"replicas": [c.as_json() for c in desired], "draining": sorted(draining)}
    partial.write_bytes(orjson.dumps(doc))
    # Atomic: a starting worker reads the old state or the new, never half of one.
    partial.rename(path)


def load_state(server: RouterServer, state: Path) -> None:
    """The supervisor's current replica set and drains, newer than the config file's."""
    try:
        doc = orjson.loads(state.read_bytes())
    except FileNotFoundError:
        return
    configs = parse_replicas(replicas_where(str(state)), "replicas", doc["replicas"])
    server.pool.set_replicas(configs)
    for replica_id in doc["draining"]:
        server.pool.set_draining(replica_id, True)
