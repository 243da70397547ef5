"""The suite runs on the loop the product runs on, and a test that hangs on it fails at its timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import uvloop

from tests.support.loops import ASYNCIO_LOOP_TIERS

ROOT = Path(__file__).resolve().parent.parent


async def test_a_test_runs_on_uvloop_as_router_serve_does() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


def test_only_the_scaler_tier_keeps_asyncios_loop() -> None:
    """`router scaler` alone runs on asyncio's loop (router/scaler/main.py); its tests with it."""
    assert ASYNCIO_LOOP_TIERS == ("tests/scaler/",)
    main = (ROOT / "router" / "scaler" / "main.py").read_text()
    assert "uvloop" not in main.replace("uvloop gains nothing", "")


def test_a_hanging_async_test_fails_at_its_timeout_and_the_run_goes_on(tmp_path: Path) -> None:
    """pytest-timeout's signal cannot interrupt uvloop: the loop's own deadline must, test by test."""
    (tmp_path / "test_hang.py").write_text(
        "import asyncio, uvloop\n"
        "import pytest\n"
        "@pytest.mark.timeout(2)\n"
        "async def test_hangs():\n"
        "    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)\n"
        "    await asyncio.Event().wait()\n"
        "async def test_after():\n"
        "    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)\n"
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
        "timeout = 60\ntimeout_method = thread\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.loops", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "ran over 1 s on its loop" in done.stdout
