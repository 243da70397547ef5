"""Draw deploy/grafana/router.json's main panels from a real Prometheus' answers, as a PNG.

Grafana cannot be installed here, so the picture of the dashboard (README, docs/operations.md) is
drawn with matplotlib from the answers Prometheus gave to the dashboard's own
queries in tests/deploy/observability/test_prometheus.py (a real Prometheus scraping
real routers under a short mixed load), which writes them when asked:

    ROUTER_DASHBOARD_CAPTURE=/tmp/dashboard.json .venv/bin/pytest tests/deploy/observability/test_prometheus.py
    .venv/bin/python bench/dashboard_picture.py /tmp/dashboard.json docs/dashboard.png

(matplotlib comes with the `bench` extra: `pip install -e '.[bench]'`.)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "router.json"

# The panels drawn, in this order: the ones an operator reads first.
PANELS = [
    "Requests by model and status",
    "Upstream errors by model and reason",
    "Request duration",
    "Time to first byte",
    "In flight per replica",
    "Quiet time per replica (idle candidates stand out)",
    "Queue waits under the limits",
    "Held requests",
    "Hold outcomes",
    "Affinity: hits and spills",
    "Retries and fallbacks",
    "What each ScaledObject was told",
]
IDLE_SECONDS = 1800


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip() or str(labels)


def draw(capture: dict[str, Any], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    by_title = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    start = capture["start"]
    answers = capture["panels"]
    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows))
    for ax, title in zip(axes.flat, PANELS, strict=True):
        panel = by_title[title]
        ax.set_title(title, fontsize=10, loc="left")
        if panel["type"] == "bargauge":
            (target_,) = panel["targets"]
            answer = answers[f"{title} / {target_['refId']}"]
            names, values = [], []
            for series in answer["result"]["result"]:
                finite = [float(v) for _, v in series["values"] if math.isfinite(float(v))]
                if finite:
                    names.append(legend(target_["legendFormat"], series["metric"]))
                    values.append(finite[-1])
            colors = ["#ff9830" if v >= IDLE_SECONDS else "#73bf69" for v in values]
            ax.barh(names, values, color=colors)
            ax.invert_yaxis()
            ax.set_xlabel("seconds proven quiet (orange from 30 min)", fontsize=8)
            ax.tick_params(labelsize=7)
            continue
        for target_ in panel["targets"]:
            answer = answers[f"{title} / {target_['refId']}"]
            for series in answer["result"]["result"]:
                points = [(t - start, float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, linewidth=1.2, label=legend(target_["legendFormat"], series["metric"]))
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.set_ylabel(panel["fieldConfig"]["defaults"].get("unit", ""), fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.6)
    fig.suptitle(
        "deploy/grafana/router.json's queries, answered by a real Prometheus over a real fleet "
        "(drawn with matplotlib: Grafana is not installed here)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(target, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture", type=Path, help="the JSON test_prometheus.py wrote (ROUTER_DASHBOARD_CAPTURE)")
    parser.add_argument("target", type=Path, nargs="?", default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("dashboard_picture: matplotlib is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    draw(json.loads(args.capture.read_text()), args.target)
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
