"""deploy/prometheus/alerts.yml's rules on made-up series at exact times (alerts_test.yml), by promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.programs import program

HERE = Path(__file__).resolve().parent


def test_the_alerting_rules_pass_their_unit_tests() -> None:
    """Idle after 30 quiet minutes (not while ejected, held or a router is down), ejected after 5, and the rest."""
    result = subprocess.run(
        [program("promtool"), "test", "rules", "alerts_test.yml"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
