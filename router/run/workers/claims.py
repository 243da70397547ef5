"""One wake call per replica across the workers of `--workers`: a lock file per replica in the runtime directory.

The worker whose request path first needs a sleeping replica takes its
claim (an exclusive, non-blocking flock) and makes the wake call; a worker
that finds the claim taken makes none and waits for the engine to say it is
awake (router.core.pool.sleep.until_awake). A worker that dies drops its
lock with its descriptors: a claim never outlives its holder.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable
from pathlib import Path


class WakeClaims:
    """The claims of the workers sharing `runtime` (router.core.pool.sleep.Claims)."""

    def __init__(self, runtime: Path) -> None:
        self._runtime = runtime

    def _path(self, replica_id: str) -> Path:
        # Hashed: a replica id is any string, a file name is not.
        return self._runtime / f"wake-{hashlib.sha256(replica_id.encode()).hexdigest()[:24]}.lock"

    def claim(self, replica_id: str) -> Callable[[], None] | None:
        fd = os.open(self._path(replica_id), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        return release

    def held(self, replica_id: str) -> bool:
        release = self.claim(replica_id)
        if release is None:
            return True
        release()
        return False
