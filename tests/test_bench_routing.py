"""bench/routing.py's processes: a peer's output goes to a file, so that no pipe left unread stops it.

vLLM's router at INFO logs a line of some 270 bytes for every request its
power_of_two policy routes; piped and unread, its output filled the pipe
after a few hundred requests and the router answered nothing from then on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.routing import launch

LINES = 4096
# About 1 MiB, more than a pipe holds (64 KiB on Linux): what that router writes in a few thousand requests.
CHATTY = f"import sys\nfor i in range({LINES}):\n    sys.stdout.write(f'line {{i}} ' + 'x' * 250 + '\\n')\n"


def finish(process: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_process_launched_with_a_log_prints_more_than_a_pipe_holds_and_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    process = launch([sys.executable, "-c", CHATTY], log=log)
    assert finish(process, timeout=30) == 0
    assert process.stdout is None
    assert log.read_text().count("\n") == LINES
