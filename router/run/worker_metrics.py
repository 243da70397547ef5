"""A worker's data-path metrics, reported to its supervisor and merged by a declared mode.

Each worker of `--workers` observes its own histograms and counters; the
supervisor exports one set of series. Which families cross, and how they
combine, is declared once here (as prometheus_client's multiprocess mode
does): `sum` for counters and histograms (a dead worker's last figures stay
in the sum, so that no counter ever goes down), `max` and `latest` for
gauges (live workers only: the highest, or the newest report's). A worker
reports its families as JSON on its private socket; nothing is re-parsed
from exposition text.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

Mode = Literal["sum", "max", "latest"]

# The families a worker observes and the supervisor exports, by merge mode.
MODES: dict[str, Mode] = {
    "router_request_duration_seconds": "sum",
    "router_time_to_first_byte_seconds": "sum",
    "router_time_to_first_token_seconds": "sum",
    "router_time_per_output_token_seconds": "sum",
    "router_client_protocol_errors": "sum",
    "router_upstream_protocol_errors": "sum",
    "router_held_seconds": "sum",
    "router_queue_wait_seconds": "sum",
    "router_wake_calls": "sum",
    # The tenants' rate limits (router.gateway.limit_metrics).
    "router_rate_limited": "sum",
    "router_rate_limited_shadow": "sum",
    "router_rate_limit_redis_calls": "sum",
    "router_rate_limit_redis_errors": "sum",
    "router_rate_limit_unchecked": "sum",
    "router_sleep_calls": "sum",
}

# On a worker's private socket only.
METRICS_PATH = "/internal/v1/metrics"

# (family, sample name, labels): one series.
SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]


def report(registry: CollectorRegistry, modes: Mapping[str, Mode] = MODES) -> dict[str, Any]:
    """A worker's families named in `modes`, as JSON: their identity and samples."""
    families = []
    for family in registry.collect():
        if family.name not in modes:
            continue
        samples = [
            [sample.name, sample.labels, sample.value]
            for sample in family.samples
            # A creation time is not a count: meaningless merged.
            if not sample.name.endswith("_created")
        ]
        families.append({"name": family.name, "help": family.documentation, "type": family.type, "samples": samples})
    return {"families": families}


class Report:
    """One worker's report, read back: its families' identity and each series' value."""

    __slots__ = ("families", "samples")

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.families: dict[str, tuple[str, str]] = {}
        self.samples: dict[SampleKey, float] = {}
        for family in doc["families"]:
            name = family["name"]
            self.families[name] = (family["help"], family["type"])
            for sample_name, labels, value in family["samples"]:
                self.samples[(name, sample_name, tuple(sorted(labels.items())))] = float(value)


def merge(
    live: Iterable[Report], retired: Mapping[SampleKey, float], modes: Mapping[str, Mode] = MODES
) -> dict[SampleKey, float]:
    """The supervisor's series: `live` reports (oldest first) merged by mode, `retired` added to the sums."""
    merged: dict[SampleKey, float] = {key: value for key, value in retired.items() if modes.get(key[0]) == "sum"}
    for report_ in live:
        for key, value in report_.samples.items():
            mode = modes.get(key[0])
            if mode == "sum":
                merged[key] = merged.get(key, 0.0) + value
            elif mode == "max":
                merged[key] = max(merged.get(key, value), value)
            elif mode == "latest":
                merged[key] = value
    return merged


def retire(retired: dict[SampleKey, float], last: Report | None) -> None:
    """A worker died: its last counts stay in the sums for good."""
    if last is None:
        return
    for key, value in last.samples.items():
        retired[key] = retired.get(key, 0.0) + value


class MergedCollector(Collector):
    """Exports merged series with the families' identity as the workers reported it."""

    def __init__(self, families: Mapping[str, tuple[str, str]], samples: Mapping[SampleKey, float]) -> None:
        self.families = families
        self.samples = samples

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        out: dict[str, Metric] = {}
        for (family, name, labels), value in sorted(self.samples.items()):
            metric = out.get(family)
            if metric is None:
                documentation, type_ = self.families.get(family, ("", "untyped"))
                metric = out[family] = Metric(family, documentation, type_)
            metric.add_sample(name, dict(labels), value)
        yield from out.values()
