"""deploy/grafana/router.json read as Grafana reads it: its panels, their queries, its variables."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "router.json"

# The variables Grafana itself defines that a Prometheus query may use.
BUILT_IN = ("$__rate_interval", "$__interval", "$__range")


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str
    legend: str
    instant: bool


def panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but the rows, those inside collapsed rows included."""
    for panel in doc["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(doc: dict[str, Any]) -> list[Query]:
    return [
        Query(p["title"], t["refId"], t["expr"], t.get("legendFormat", ""), bool(t.get("instant", False)))
        for p in panels(doc)
        for t in p["targets"]
    ]


def substitute(expr: str, *, models: Sequence[str], rate_interval: str) -> str:
    """`expr` as Grafana sends it: $model with every value selected, the built-in intervals given.

    A multi-value variable inside a regex matcher becomes `(a|b)` with each
    value regex-escaped, as Grafana formats it for Prometheus.
    """
    alternation = "(" + "|".join(re.escape(m) for m in models) + ")"
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__interval", rate_interval)
        .replace("$__range", rate_interval)
        .replace("${model}", alternation)
        .replace("$model", alternation)
    )
