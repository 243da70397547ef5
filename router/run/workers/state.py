"""The supervisor's runtime directory: each worker's socket and final report, and the state file.

The state file holds the current replica set and drains: a (re)starting
worker loads it before its client port opens, so that no worker ever serves
a set older than an acknowledged push.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson

from router.core.config.settings import parse_replicas, replicas_where
from router.core.errors import ConfigError
from router.run.app import RouterServer


def make_runtime(environ: Mapping[str, str]) -> Path:
    """A new directory, private to this user, for the workers' sockets, reports and the state file.

    Under systemd's `RuntimeDirectory=` it is made in `$RUNTIME_DIRECTORY`
    (removed by systemd at stop, whatever happened); elsewhere in the
    temporary directory, as Python's tempfile finds it: `$TMPDIR`, else
    /tmp, /var/tmp, /usr/tmp, the working directory. A read-only root with
    none of them writable (a container without a /tmp volume) is a mistake
    of the deployment, said in one line rather than as a traceback.
    """
    # systemd passes a colon-separated list when a unit names several directories.
    given = environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
    try:
        # mkdtemp makes it 0700: only this user reaches the workers' sockets.
        return Path(tempfile.mkdtemp(prefix="router-workers-", dir=given))
    except OSError as exc:
        found = (
            f"$RUNTIME_DIRECTORY ({given}) is not one ({exc.strerror})"
            if given
            else "none of $TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory is one"
        )
        raise ConfigError(
            f"--workers needs a writable directory for its workers' sockets and state, and {found}: "
            "set TMPDIR to a writable directory, or mount one at /tmp (with a read-only root: an emptyDir or a tmpfs)"
        ) from exc


@dataclass(frozen=True)
class Paths:
    """The runtime directory of --workers: its state file and each worker's admin socket."""

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


def set_json(entries: Iterable[bytes]) -> bytes:
    """`{"replicas": [...]}` from its entries, each already JSON: what a push to a worker carries."""
    return b'{"replicas":[' + b",".join(entries) + b"]}"


def write_state(
    runtime: Path, entries: Iterable[bytes], draining: Iterable[str], asleep: Mapping[str, int] | None = None
) -> None:
    """The set (its entries, each already JSON), the drains and the replicas put to sleep, for a starting worker."""
    path = runtime / "state.json"
    partial = path.with_suffix(".partial")
    tail = b',"draining":' + orjson.dumps(sorted(draining)) + b',"asleep":' + orjson.dumps(dict(asleep or {}))
    partial.write_bytes(set_json(entries)[:-1] + tail + b"}")
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
    # Asleep as the supervisor last put it (a worker's own wake since is found by /is_sleeping on the next).
    for replica_id, level in doc.get("asleep", {}).items():
        replica = server.pool.get(replica_id)
        if replica is not None:
            server.pool.set_sleep(replica, level)
