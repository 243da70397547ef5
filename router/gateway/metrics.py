"""The data path's histograms: two observed per request and two per stream, by model; the rest when one waits."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from types import FunctionType
from typing import Final

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric


def _bucket(bounds: list[float], value: float) -> int:
    """The bucket of `value`: the first bound it does not exceed (`le` is inclusive), else +Inf's."""
    at = 0
    for bound in bounds:
        if value <= bound:
            return at
        at += 1
    return at


# Compiled, _bucket is a loop of float compares in C (a few instructions a bound; the values
# observed mostly fall in the first buckets), where bisect compares boxed floats through the
# generic protocol: about 700 instructions an observation, four per stream. Pure, the loop is
# bytecode and bisect's C the cheaper. mypyc makes a module's functions built-in ones.
COMPILED: Final = type(_bucket) is not FunctionType


class _Series:
    """One model's counts: per bucket (not cumulative; the last is +Inf's own), and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.total = 0.0


class ModelHistogram:
    """A Prometheus histogram by model, observed on the event loop alone: a bucket found by
    bisection, two additions, no lock.

    A collector by its methods (prometheus_client's Collector is a protocol), not by a base
    class: compiled, a class with a base from outside is called through Python's attribute
    lookup, where this one's observe() is a direct call.

    prometheus_client's Histogram takes a lock per value and walks its buckets
    in Python: about 9,000 instructions per observation, and every request
    makes two (docs/performance.md, issue 29). What a scrape reads is the same:
    `_bucket{le}` cumulative, `_count`, `_sum` (tests/gateway/test_metrics.py
    compares them), without the `_created` sample, which no query here reads
    and the workers' merge leaves out. The scrape runs in a thread: it takes the models as a list
    first, since the loop may add one meanwhile.
    """

    def __init__(self, name: str, documentation: str, bounds: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in bounds)
        self._bound_list = list(self.bounds)
        # As prometheus_client writes a bound (its floatToGoString, for bounds below 10**6).
        self._les = [repr(b) for b in self.bounds] + ["+Inf"]
        self._series: dict[str, _Series] = {}
        registry.register(self)

    def observe(self, model: str, value: float) -> None:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = _Series(len(self.bounds) + 1)
        # `le` is inclusive: a value equal to a bound is in that bound's bucket.
        at = _bucket(self._bound_list, value) if COMPILED else bisect_left(self.bounds, value)
        counts = series.counts
        # Not `+=` on the item: compiled, that is the generic in-place add on an object; read
        # as an int and stored, the addition is mypyc's own.
        counts[at] = counts[at] + 1
        series.total += value

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model"])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        for model, series in list(self._series.items()):
            cumulative: list[tuple[str, float]] = []
            running = 0
            for le, count in zip(self._les, series.counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric([model], cumulative, series.total)
        yield family


class DataPathMetrics:
    """Histograms observed per request (duration and time to first byte), and those of waits."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = ModelHistogram(
            "router_request_duration_seconds",
            "Inference requests from arrival to the last byte sent, by model.",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry,
        )
        self.first_byte = ModelHistogram(
            "router_time_to_first_byte_seconds",
            "From arrival to the replica's response head, by model.",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry,
        )
        # A stream's first body bytes (vLLM's first chunk holds the first token) and the mean gap
        # between its tokens after that: vLLM's own request-level TTFT and TPOT, seen from the
        # router, so that they include its queueing and the network. One observation per stream
        # each, never per chunk: a per-chunk observation would cost more than the stream's bytes.
        self.first_token = ModelHistogram(
            "router_time_to_first_token_seconds",
            "Streams: from arrival to the first chunk of the answer, by model.",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry,
        )
        self.per_output_token = ModelHistogram(
            "router_time_per_output_token_seconds",
            "Streams whose answer said its completion tokens: from the first chunk to the last, "
            "over the tokens after the first, by model.",
            (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5),
            registry,
        )
        self.held = Histogram(
            "router_held_seconds",
            "How long requests held for a cold model waited before a replica answered, by model.",
            ["model"],
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.queue_wait = Histogram(
            "router_queue_wait_seconds",
            "How long requests waited for a slot under max_in_flight(_per_replica), served or refused after "
            "their class's queue timeout, by model and priority class.",
            ["model", "priority"],
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )

    def observe_held(self, model: str, seconds: float) -> None:
        self.held.labels(model).observe(seconds)

    def observe_queue_wait(self, model: str, priority: str, seconds: float) -> None:
        self.queue_wait.labels(model, priority).observe(seconds)
