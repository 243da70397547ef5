"""The usage snapshot on /metrics: per-replica series rendered when they change, the rest read at scrape.

No gauge is set and cleared by hand: each scrape yields exactly the replicas
of the newest snapshot, so a removed replica's series end with it, and a
replica without a stamp has no last-used sample at all (unknown is not idle).

The per-replica series (about ten lines a replica) are most of a scrape of
a large fleet: `PrometheusSink` renders a replica's lines once per change
of its record (at the first scrape after it; only the families whose
field moved), and a scrape joins lines it already has, as GET
/api/v1/usage serves bytes made at the tick. Nothing is rendered for a
router that nobody scrapes. Only the quiet time, which grows with every
snapshot, is written out per snapshot (at its first scrape). The text is
the one prometheus_client writes for the same samples (a test holds them
equal). The rest (the tallies per model, the exporters'
health) is a prometheus_client Collector, read fresh at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import cast

from prometheus_client import utils
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.control.sinks.usage_maps import UsageMaps
from router.control.sinks.waiting import WaitingNow, waiting_of
from router.core.pool.replicas import ReplicaState
from router.core.usage.snapshots import ReplicaUsage, UsageSnapshot

STATES = tuple(state.value for state in ReplicaState)
# Go's float format, as prometheus_client writes every sample (untyped there).
_go_float = cast(Callable[[float], str], utils.floatToGoString)

# The per-replica families, in the order of the text: (name as written, type, help).
_LAST_USED = (
    "router_replica_last_used_timestamp_seconds",
    "gauge",
    "Last time a request was sent to the replica; absent = unknown, not idle.",
)
_WATCHING = (
    "router_replica_watching_since_timestamp_seconds",
    "gauge",
    "Since when this router has watched the replica (start or addition).",
)
_QUIET = (
    "router_replica_quiet_seconds",
    "gauge",
    "Proven quiet: no request reached the replica through this router for at least this long, "
    "as of the snapshot (stamp or no stamp: since it was last used or watched from).",
)
_IN_FLIGHT = ("router_replica_in_flight_requests", "gauge", "Requests in flight to the replica.")
_STATE = ("router_replica_state", "gauge", "1 for the replica's current state, 0 for the others.")
_EJECTIONS = ("router_replica_ejections_total", "counter", "Times the replica was ejected for failing.")
_RECOVERIES = ("router_replica_recoveries_total", "counter", "Times an ejected replica came back into rotation.")
_REQUESTS = ("router_requests_total", "counter", "Upstream answers by replica and status class.")
_ERRORS = (
    "router_upstream_errors_total",
    "counter",
    "Upstream attempts that failed without a usable answer, by reason.",
)
# Rendered per record when it changes; the quiet time (between watching and in-flight) per snapshot.
_RECORD_FAMILIES = (_LAST_USED, _WATCHING, _IN_FLIGHT, _STATE, _EJECTIONS, _RECOVERIES, _REQUESTS, _ERRORS)


def _head(family: tuple[str, str, str]) -> str:
    name, kind, documentation = family
    return f"# HELP {name} {documentation}\n# TYPE {name} {kind}\n"


def _escape(value: str) -> str:
    """A label value as prometheus_client writes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    """A sample's value as prometheus_client writes it (Go's float format: utils.floatToGoString)."""
    value = float(value)
    if 0.0 <= value < 1e6:
        # Python's repr is Go's already: no exponent to move.
        return repr(value)
    if 1e6 <= value < 1e16:
        # A Unix time: floatToGoString's own steps, without its checks for what cannot be here.
        text = repr(value)
        dot = text.find(".")
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return _go_float(value)


class _Labels:
    """One record's label values, escaped once (a record's id and model never change)."""

    __slots__ = ("id", "model", "model_name", "pair", "quiet", "replica", "requests")

    def __init__(self, r: ReplicaUsage) -> None:
        self.id = r.id
        self.model_name = r.model
        self.model = _escape(r.model)
        self.replica = _escape(r.id)
        # Sorted by name, as prometheus_client writes them.
        self.pair = f'model="{self.model}",replica="{self.replica}"'
        self.quiet = f"router_replica_quiet_seconds{{{self.pair}}} "
        # Per status class: the start of its requests line.
        self.requests: dict[str, str] = {}


def _last_used(labels: _Labels, value: object) -> str:
    if value is None:
        return ""
    return f"router_replica_last_used_timestamp_seconds{{{labels.pair}}} {_number(cast(float, value))}\n"


def _watching(labels: _Labels, value: object) -> str:
    return f"router_replica_watching_since_timestamp_seconds{{{labels.pair}}} {_number(cast(float, value))}\n"


def _in_flight(labels: _Labels, value: object) -> str:
    return f"router_replica_in_flight_requests{{{labels.pair}}} {_number(cast(int, value))}\n"


def _state(labels: _Labels, value: object) -> str:
    return "".join(
        f'router_replica_state{{{labels.pair},state="{name}"}} {"1.0" if name == value else "0.0"}\n' for name in STATES
    )


def _ejections(labels: _Labels, value: object) -> str:
    return f"router_replica_ejections_total{{{labels.pair}}} {_number(cast(int, value))}\n"


def _recoveries(labels: _Labels, value: object) -> str:
    return f"router_replica_recoveries_total{{{labels.pair}}} {_number(cast(int, value))}\n"


def _requests(labels: _Labels, value: object) -> str:
    starts = labels.requests
    counts = cast(Mapping[str, int], value)
    if len(counts) == 1:
        # The usual case: every answer 2xx.
        ((status_class, count),) = counts.items()
        start = starts.get(status_class)
        if start is not None:
            return f"{start}{_number(count)}\n"
    lines = []
    for status_class, count in sorted(cast(Mapping[str, int], value).items()):
        start = starts.get(status_class)
        if start is None:
            start = starts[status_class] = (
                f'router_requests_total{{{labels.pair},status_class="{_escape(status_class)}"}} '
            )
        lines.append(f"{start}{_number(count)}\n")
    return "".join(lines)


def _errors(labels: _Labels, value: object) -> str:
    return "".join(
        f'router_upstream_errors_total{{model="{labels.model}",reason="{_escape(reason)}",replica="{labels.replica}"}} '
        f"{_number(count)}\n"
        for reason, count in sorted(cast(Mapping[str, int], value).items())
    )


# The record's fields each family of _RECORD_FAMILIES shows, by place.
_LAST_USED_AT = ReplicaUsage._fields.index("last_used")
_WATCHING_AT = ReplicaUsage._fields.index("watching_since")
_IN_FLIGHT_AT = ReplicaUsage._fields.index("in_flight")
_STATE_AT = ReplicaUsage._fields.index("state")
_EJECTIONS_AT = ReplicaUsage._fields.index("ejections")
_RECOVERIES_AT = ReplicaUsage._fields.index("recoveries")
_RESPONSES_AT = ReplicaUsage._fields.index("responses")
_ERRORS_AT = ReplicaUsage._fields.index("errors")


class PrometheusSink:
    """Holds the newest snapshot for the collector, and its replicas' lines, rendered as they change."""

    name = "prometheus"

    def __init__(self, maps: UsageMaps | None = None) -> None:
        """`maps`: shared with the other exporters, which follow the same snapshots."""
        self.snapshot: UsageSnapshot | None = None
        # The requests waiting now, read at the latest scrape (waiting.py); None: never read.
        self.waiting: WaitingNow | None = None
        self._maps = maps if maps is not None else UsageMaps()
        self._step = 0
        # Records changed since their lines were last rendered: rendered at the next scrape.
        self._dirty: set[Hashable] = set()
        # Per record's key: the record its lines show, and its labels.
        self._rendered: dict[Hashable, ReplicaUsage] = {}
        self._labels: dict[Hashable, _Labels] = {}
        # Per family of _RECORD_FAMILIES, per record's key: its lines.
        self._lines: list[dict[Hashable, str]] = [{} for _ in _RECORD_FAMILIES]
        # The text for `snapshot`, once a scrape asked for it.
        self._text: tuple[UsageSnapshot, bytes] | None = None

    @property
    def records(self) -> Iterable[ReplicaUsage]:
        """Every replica's record as of the newest snapshot (a snapshot itself may carry only those that changed)."""
        return self._maps.records.values()

    def read_waiting(self, waiting: WaitingNow) -> None:
        """The requests waiting as read at this scrape: newer than the snapshot, so shown instead."""
        self.waiting = waiting

    def publish(self, snapshot: UsageSnapshot) -> None:
        maps = self._maps
        changes = maps.follow(snapshot)
        if maps.steps == self._step + 1:
            dirty, rendered = self._dirty, self._rendered
            for key, _, after in changes:
                if after is not None or key in rendered:
                    dirty.add(key)
                else:
                    # Gone before any scrape showed it: nothing to take out (and, with no
                    # scraper, nothing kept of replicas long gone).
                    dirty.discard(key)
        else:
            # A step missed: compare every record with the one its lines show.
            self._dirty = {*maps.records, *self._rendered}
        self._step = maps.steps
        self.snapshot = snapshot

    def _render(self) -> None:
        """The lines of every record changed since the last render: only the families whose field moved."""
        records = self._maps.records
        rendered, labels_of, all_lines = self._rendered, self._labels, self._lines
        for key in self._dirty:
            record = records.get(key)
            before = rendered.get(key)
            if record is None:
                if before is not None:
                    for lines in all_lines:
                        del lines[key]
                    del rendered[key]
                    del labels_of[key]
                continue
            if record is before:
                continue
            labels = labels_of.get(key)
            if labels is None or labels.id != record.id or labels.model_name != record.model:
                # New, or (a key come back naming another replica) new again.
                labels = labels_of[key] = _Labels(record)
                before = None
            # Only the families whose field moved (a busy replica's stamp and counts, mostly),
            # written out: thousands of records may have changed since the last scrape.
            last_used, watching, in_flight, state, ejections, recoveries, requests, errors = all_lines
            if before is None or before[_LAST_USED_AT] != record[_LAST_USED_AT]:
                last_used[key] = _last_used(labels, record[_LAST_USED_AT])
            if before is None or before[_WATCHING_AT] != record[_WATCHING_AT]:
                watching[key] = _watching(labels, record[_WATCHING_AT])
            if before is None or before[_IN_FLIGHT_AT] != record[_IN_FLIGHT_AT]:
                in_flight[key] = _in_flight(labels, record[_IN_FLIGHT_AT])
            if before is None or before[_STATE_AT] != record[_STATE_AT]:
                state[key] = _state(labels, record[_STATE_AT])
            if before is None or before[_EJECTIONS_AT] != record[_EJECTIONS_AT]:
                ejections[key] = _ejections(labels, record[_EJECTIONS_AT])
            if before is None or before[_RECOVERIES_AT] != record[_RECOVERIES_AT]:
                recoveries[key] = _recoveries(labels, record[_RECOVERIES_AT])
            if before is None or before[_RESPONSES_AT] != record[_RESPONSES_AT]:
                requests[key] = _requests(labels, record[_RESPONSES_AT])
            if before is None or before[_ERRORS_AT] != record[_ERRORS_AT]:
                errors[key] = _errors(labels, record[_ERRORS_AT])
            rendered[key] = record
        self._dirty.clear()

    def exposition(self) -> bytes:
        """The per-replica families of the newest snapshot, as Prometheus text (b"" before the first)."""
        snapshot = self.snapshot
        if snapshot is None:
            return b""
        if self._text is not None and self._text[0] is snapshot:
            return self._text[1]
        self._render()
        generated_at = snapshot.generated_at
        horizon = self._maps.horizon
        quiet_parts: list[str] = []
        append = quiet_parts.append
        for labels in self._labels.values():
            quiet = generated_at - horizon[labels.id]
            # _number(), written out: a line per replica per snapshot.
            if quiet <= 0.0:
                append(f"{labels.quiet}0.0\n")
            elif quiet < 1e6:
                append(f"{labels.quiet}{quiet!r}\n")
            else:
                append(f"{labels.quiet}{_number(quiet)}\n")
        quiet_lines = "".join(quiet_parts)
        parts: list[str] = []
        for index, (family, family_lines) in enumerate(zip(_RECORD_FAMILIES, self._lines, strict=True)):
            parts.append(_head(family))
            parts.append("".join(family_lines.values()))
            if index == 1:
                parts.append(_head(_QUIET))
                parts.append(quiet_lines)
        text = "".join(parts).encode()
        self._text = (snapshot, text)
        return text


class UsageCollector(Collector):
    """The usage map's series for /metrics, read from the latest snapshot at each scrape."""

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
        yield _tallies(
            "router_tokens",
            "Tokens the answers said they took (their usage), by model, tenant and kind: prompt, cached "
            "(of the prompt, read from the engine's prefix cache), completion.",
            ["model", "tenant", "kind"],
            snapshot.tokens.items(),
        )
        yield _tallies(
            "router_tokens_unknown_requests",
            "Answers that said nothing readable of their tokens (a stream whose client did not ask for "
            "usage, a broken or odd usage): unknown, not counted as 0.",
            ["model", "tenant"],
            snapshot.usage_unknown.items(),
        )
        # The newer of the two: what was read at this scrape, or the snapshot.
        waiting = self._sink.waiting
        if waiting is None or waiting.taken_at < snapshot.generated_at:
            waiting = waiting_of(snapshot)
        held = GaugeMetricFamily(
            "router_held_requests", "Requests held now, waiting for a replica of a cold model.", labels=["model"]
        )
        # Every model ever held keeps its series, at 0 when nothing is held: an empty queue is a fact.
        for model, count in sorted(waiting.held.items()):
            held.add_metric([model], count)
        yield held
        queued = GaugeMetricFamily(
            "router_queued_requests",
            "Requests waiting now for a slot under the limits, by model, priority class and tenant.",
            labels=["model", "priority", "tenant"],
        )
        # Every (model, class, tenant) that ever queued keeps its series, at 0 once empty.
        for (model, priority, tenant), count in sorted(waiting.queued.items()):
            queued.add_metric([model, priority, tenant], count)
        yield queued
        if snapshot.saturation:
            saturation = GaugeMetricFamily(
                "router_model_saturation",
                "Share of the model's ready replicas whose engines are at their bounds (1: requests wait in the "
                "router); only models whose engines report their load.",
                labels=["model"],
            )
            for model, share in sorted(snapshot.saturation.items()):
                saturation.add_metric([model], share)
            yield saturation
        yield _not_serving(self._sink.records)
        yield _tallies(
            "router_client_write_stalls",
            "Streams cut off because the client read nothing for write_stall_timeout_seconds.",
            ["model"],
            (((model,), n) for model, n in snapshot.stalled.items()),
        )


def _not_serving(records: Iterable[ReplicaUsage]) -> GaugeMetricFamily:
    """Per model, its replicas whose /v1/models does not list it: each request sent there gets 404."""
    family = GaugeMetricFamily(
        "router_replicas_not_serving_model",
        "Replicas whose /v1/models does not list the model the router sends them (their engine answers 404), "
        "by model; only models with a replica whose listing was read.",
        labels=["model"],
    )
    counts: dict[str, int] = {}
    for r in records:
        if r.serves_model is not None:
            counts[r.model] = counts.get(r.model, 0) + (not r.serves_model)
    for model, count in sorted(counts.items()):
        family.add_metric([model], count)
    return family


def _tallies(
    name: str, documentation: str, labels: list[str], counts: Iterable[tuple[Sequence[str], int]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, count in sorted(counts):
        family.add_metric(list(values), count)
    return family
