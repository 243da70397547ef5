"""A prometheus_client Collector that reads the newest usage snapshot at scrape.

No gauge is set and cleared by hand: each scrape yields exactly the replicas
of the snapshot, so a removed replica's series end with it, and a replica
without a stamp has no last-used sample at all (unknown is not idle).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.core.replicas import ReplicaState
from router.core.usage import UsageSnapshot

STATES = tuple(state.value for state in ReplicaState)


class PrometheusSink:
    """Holds the newest snapshot for the collector; publish() is all it does."""

    name = "prometheus"

    def __init__(self) -> None:
        self.snapshot: UsageSnapshot | None = None

    def publish(self, snapshot: UsageSnapshot) -> None:
        self.snapshot = snapshot


class UsageCollector(Collector):
    def __init__(
        self,
        sink: PrometheusSink,
        *,
        sink_failures: Callable[[], Mapping[str, int]],
        push_failures: Callable[[], int | None],
        tick_seconds: Callable[[], float],
    ) -> None:
        self._sink = sink
        self._sink_failures = sink_failures
        self._push_failures = push_failures
        self._tick_seconds = tick_seconds

    def describe(self) -> list[Metric]:
        # An empty describe() keeps registration from calling collect() early.
        return []

    def collect(self) -> Iterator[Metric]:
        snapshot = self._sink.snapshot
        sink_failures = CounterMetricFamily(
            "router_usage_sink_failures", "Usage exporters that raised while publishing.", labels=["sink"]
        )
        for name, count in sorted(self._sink_failures().items()):
            sink_failures.add_metric([name], count)
        yield sink_failures
        push = self._push_failures()
        if push is not None:
            yield CounterMetricFamily(
                "router_usage_push_failures", "Usage pushes that failed or timed out.", value=push
            )
        yield GaugeMetricFamily(
            "router_usage_tick_duration_seconds",
            "Time the last usage tick took (snapshot and every sink).",
            value=self._tick_seconds(),
        )
        if snapshot is None:
            return
        yield GaugeMetricFamily(
            "router_usage_snapshot_timestamp_seconds",
            "When the usage snapshot behind these figures was taken.",
            value=snapshot.generated_at,
        )
        yield GaugeMetricFamily(
            "router_started_timestamp_seconds",
            "When this router started watching (Unix seconds).",
            value=snapshot.started_at,
        )
        labels = ["replica", "model"]
        last_used = GaugeMetricFamily(
            "router_replica_last_used_timestamp_seconds",
            "Last time a request was sent to the replica; absent = unknown, not idle.",
            labels=labels,
        )
        watching = GaugeMetricFamily(
            "router_replica_watching_since_timestamp_seconds",
            "Since when this router has watched the replica (start or addition).",
            labels=labels,
        )
        quiet = GaugeMetricFamily(
            "router_replica_quiet_seconds",
            "Proven quiet: no request reached the replica through this router for at least this long, "
            "as of the snapshot (stamp or no stamp: since it was last used or watched from).",
            labels=labels,
        )
        proven = snapshot.quiet_for()
        in_flight = GaugeMetricFamily(
            "router_replica_in_flight_requests", "Requests in flight to the replica.", labels=labels
        )
        state = GaugeMetricFamily(
            "router_replica_state", "1 for the replica's current state, 0 for the others.", labels=[*labels, "state"]
        )
        ejections = CounterMetricFamily(
            "router_replica_ejections", "Times the replica was ejected for failing.", labels=labels
        )
        recoveries = CounterMetricFamily(
            "router_replica_recoveries", "Times an ejected replica came back into rotation.", labels=labels
        )
        requests = CounterMetricFamily(
            "router_requests",
            "Upstream answers by replica and status class.",
            labels=[*labels, "status_class"],
        )
        errors = CounterMetricFamily(
            "router_upstream_errors",
            "Upstream attempts that failed without a usable answer, by reason.",
            labels=[*labels, "reason"],
        )
        for r in snapshot.replicas:
            key = [r.id, r.model]
            if r.last_used is not None:
                last_used.add_metric(key, r.last_used)
            watching.add_metric(key, r.watching_since)
            quiet_for = proven.get(r.id)
            if quiet_for is not None:
                quiet.add_metric(key, quiet_for)
            in_flight.add_metric(key, r.in_flight)
            for name in STATES:
                state.add_metric([*key, name], 1.0 if name == r.state else 0.0)
            ejections.add_metric(key, r.ejections)
            recoveries.add_metric(key, r.recoveries)
            for status_class, count in sorted(r.responses.items()):
                requests.add_metric([*key, status_class], count)
            for reason, count in sorted(r.errors.items()):
                errors.add_metric([*key, reason], count)
        yield from (last_used, watching, quiet, in_flight, state, ejections, recoveries, requests, errors)
        yield _tallies(
            "router_retries",
            "Requests sent again to another replica before any byte reached the client.",
            ["model"],
            (((model,), n) for model, n in snapshot.retries.items()),
        )
        yield _tallies(
            "router_fallbacks",
            "Requests served by a fallback model.",
            ["model", "fallback"],
            snapshot.fallbacks.items(),
        )
        yield _tallies(
            "router_unserved_requests",
            "Requests for a model that no replica could serve: demand to place.",
            ["model"],
            (((model,), n) for model, n in snapshot.unserved.items()),
        )
        yield _tallies(
            "router_overloaded_requests",
            "Requests refused with 503 after waiting queue_timeout_seconds for a slot under the limits.",
            ["model"],
            (((model,), n) for model, n in snapshot.overloaded.items()),
        )
        yield _tallies(
            "router_hold_outcomes",
            "Requests held for a cold model, by how their wait ended: served, timeout, overflow, client_gone, ...",
            ["model", "outcome"],
            snapshot.hold_outcomes.items(),
        )
        yield _tallies(
            "router_hold_probes",
            "Tries of held requests on their cold model's replicas: refused (connection refused), "
            "loading (503), answered (anything else: the request's attempt). Not upstream errors.",
            ["model", "outcome"],
            snapshot.hold_probes.items(),
        )
        yield _tallies(
            "router_affinity",
            "Requests of models routed by session or prefix: hit (the key's own replica), "
            "spill (passed on for load), none (no key: least loaded).",
            ["model", "outcome"],
            snapshot.affinity.items(),
        )
        held = GaugeMetricFamily(
            "router_held_requests", "Requests held now, waiting for a replica of a cold model.", labels=["model"]
        )
        # Every model ever held keeps its series, at 0 when nothing is held: an empty queue is a fact.
        for model in sorted(set(snapshot.demand) | {model for model, _ in snapshot.hold_outcomes}):
            demand = snapshot.demand.get(model)
            held.add_metric([model], demand.held if demand is not None else 0)
        yield held
        yield _tallies(
            "router_client_write_stalls",
            "Streams cut off because the client read nothing for write_stall_timeout_seconds.",
            ["model"],
            (((model,), n) for model, n in snapshot.stalled.items()),
        )


def _tallies(
    name: str, documentation: str, labels: list[str], counts: Iterable[tuple[Sequence[str], int]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, count in sorted(counts):
        family.add_metric(list(values), count)
    return family
