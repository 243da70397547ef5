"""How many workers `--workers auto` means: the cores this process may use."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


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
