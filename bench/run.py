"""The one benchmark command: every bench in one run, one markdown report.

    make bench            (= .venv/bin/python bench/run.py, after bench/peers)

Runs the acquire()+release() bench, the usage-tick bench, instructions per
request under callgrind (bench/instructions.py, when valgrind is installed) and bench/compare.py
(router against the floor proxy and the peers, 4 and 4,000 replicas, 10,000
open streams), and writes bench/results/latest.md. Ratios within the run are
what to compare: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, *extra: str) -> str:
    return subprocess.run(
        [sys.executable, str(HERE / script), *extra], capture_output=True, text=True, check=True, timeout=3600
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", default="5", help="per measurement of bench/compare.py")
    parser.add_argument("--rounds", default="2")
    parser.add_argument("--hold", default="10000", help="open streams to hold (0: skip)")
    args = parser.parse_args()
    acquire = json.loads(run("acquire.py", "--json"))
    tick = json.loads(run("tick.py", "--json"))
    # Instructions per request: the CPU budget's figure, steady on a noisy machine.
    instructions = json.loads(run("instructions.py", "--json")) if shutil.which("valgrind") else None
    subprocess.run(
        [
            sys.executable,
            str(HERE / "compare.py"),
            *("--seconds", args.seconds, "--rounds", args.rounds, "--hold", args.hold),
        ],
        check=True,
        timeout=3600,
        stdout=subprocess.DEVNULL,
    )
    compared = (HERE / "results" / "compare.md").read_text()
    base = acquire["4"]
    lines = [
        "# Benchmark results",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, Python "
        f"{platform.python_version()}, command: `python bench/run.py --seconds {args.seconds} "
        f"--rounds {args.rounds} --hold {args.hold}`",
        "",
        "## acquire() + release(), one model, 4,000 replicas of other models beside it",
        "",
        "| replicas of the model | ns per pair | ratio to 4 |",
        "| --- | --- | --- |",
        *(f"| {n} | {ns:.0f} | {ns / base:.2f} |" for n, ns in acquire.items()),
        "",
        *(
            [
                "## Instructions per request (callgrind; bench/instructions.py)",
                "",
                "| short request | 64-chunk stream |",
                "| --- | --- |",
                f"| {instructions['router']['short']:,.0f} | {instructions['router']['stream']:,.0f} |",
                "",
            ]
            if instructions is not None
            else []
        ),
        "## The usage tick (snapshot, usage body, Prometheus copy)",
        "",
        "| replicas | tick, quiet fleet | tick, every replica used since the last | /metrics render (off the loop) |",
        "| --- | --- | --- | --- |",
        *(
            f"| {n} | {t['quiet_tick_ms']:.2f} ms | {t['busy_tick_ms']:.2f} ms | {t['scrape_ms']:.1f} ms |"
            for n, t in tick.items()
        ),
        "",
        # The comparison's own report, one heading level down.
        compared.replace("\n## ", "\n### ").replace("# router against", "## router against", 1),
    ]
    out = HERE / "results" / "latest.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
