"""The data path's histograms: per model, observed per request, their children bound once."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram


class DataPathMetrics:
    """Histograms observed per request; their children are bound once per model."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "router_request_duration_seconds",
            "Inference requests from arrival to the last byte sent, by model.",
            ["model"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.first_byte = Histogram(
            "router_time_to_first_byte_seconds",
            "From arrival to the replica's response head, by model.",
            ["model"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
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
        self._duration: dict[str, Any] = {}
        self._first_byte: dict[str, Any] = {}

    def observe_duration(self, model: str, seconds: float) -> None:
        child = self._duration.get(model)
        if child is None:
            child = self._duration[model] = self.duration.labels(model)
        child.observe(seconds)

    def observe_held(self, model: str, seconds: float) -> None:
        self.held.labels(model).observe(seconds)

    def observe_queue_wait(self, model: str, priority: str, seconds: float) -> None:
        self.queue_wait.labels(model, priority).observe(seconds)

    def observe_first_byte(self, model: str, seconds: float) -> None:
        child = self._first_byte.get(model)
        if child is None:
            child = self._first_byte[model] = self.first_byte.labels(model)
        child.observe(seconds)
