"""The one benchmark command: every bench in one run, a markdown report.

    .venv/bin/python bench/run.py          (or: make bench)

Runs the acquire()+release() bench, the tick bench and the proxy bench
(straight to a fake replica vs through the router with 4 and 4,000 replicas
configured), and writes bench/results/latest.md. Ratios within the run are
what to compare: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, *extra: str) -> str:
    return subprocess.run(
        [sys.executable, str(HERE / script), *extra], capture_output=True, text=True, check=True, timeout=1800
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", default="5")
    parser.add_argument("--rounds", default="3")
    args = parser.parse_args()
    acquire = json.loads(run("acquire.py", "--json"))
    tick = json.loads(run("tick.py", "--json"))
    proxy_table = run("proxy.py", "--seconds", args.seconds, "--rounds", args.rounds, "--replicas", "4,4000")
    base = acquire["4"]
    lines = [
        "# Benchmark results",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, Python "
        f"{platform.python_version()}, command: `python bench/run.py --seconds {args.seconds} --rounds {args.rounds}`",
        "",
        "## acquire() + release(), one model, 4,000 replicas of other models beside it",
        "",
        "| replicas of the model | ns per pair | ratio to 4 |",
        "| --- | --- | --- |",
        *(f"| {n} | {ns:.0f} | {ns / base:.2f} |" for n, ns in acquire.items()),
        "",
        "## The usage tick (snapshot, usage body, Prometheus copy)",
        "",
        "| replicas | tick, quiet fleet | tick, every replica used since the last | /metrics render (off the loop) |",
        "| --- | --- | --- | --- |",
        *(
            f"| {n} | {t['quiet_tick_ms']:.2f} ms | {t['busy_tick_ms']:.2f} ms | {t['scrape_ms']:.1f} ms |"
            for n, t in tick.items()
        ),
        "",
        "## Through the router vs straight to a fake replica",
        "",
        "Tick every second and a poller reading /api/v1/usage twice a second, both routers running.",
        "",
        proxy_table.strip(),
        "",
    ]
    out = HERE / "results" / "latest.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
