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


def test_the_summary_says_what_the_slowest_percent_were() -> None:
    from bench.routing import Results, Sent

    results = Results()
    # 200 requests: the two slowest (the slowest 1%) were sent in the first engine second, one
    # of them cold; every later one found its prompt cached.
    results.requests = [Sent(0.5, 0.0, True, 0.2), Sent(0.4, 0.9, True, 0.7)]
    results.requests += [Sent(0.1 + i / 10_000, 0.9, i < 20, 1.0 + i / 10) for i in range(198)]
    summary = results.summary(seconds=20.0, scale=1.0)
    assert summary["tail_cold_prefill"] == 0.5
    assert summary["tail_in_warmup"] == 1.0
    assert summary["tail_by_second"] == [(0, 2)]
    # Of the 178 sent after the warm-up, the slowest one: cached.
    assert summary["warm_tail_cold_prefill"] == 0.0
