"""The soak's short version (bench/soak.py --short): two minutes of mixed load leave nothing behind.

Leaks that grow with time (a connection left open per sweep, a label kept per
hostile request) pass every test of a few hundred requests; this one runs
long enough to see them, with the long run's checks and tighter bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_minutes_of_mixed_load_account_for_every_request_and_leak_nothing(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--short", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["failed"] == []
    # The load was real: thousands of requests, every hostile kind, replicas killed mid-answer.
    assert sum(result["outcomes"].values()) > 1000
    assert set(result["hostile"]) == {
        "slow_head",
        "stopped_body",
        "pipelined",
        "garbage",
        "smuggle",
        "left_mid_body",
        "huge_name",
    }
