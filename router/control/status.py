"""The fleet summary an operator reads first (GET /api/v1/status, router ctl status).

Derived from one usage snapshot, the same one the other views read, and
by the same rule as `router ctl idle` (UsageSnapshot.quiet_for: the proven
quiet bound), so that it cannot disagree with them. A replica is idle for
the window when no request reached it for that long, stamp or no stamp;
unknown when that cannot be proven (watched for less than the window);
an ejected one is neither busy nor idle.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from router.control.nodes import FabricStatus, NodeConflict, NoNode, Seen, freeable, whole_nodes
from router.core.usage.snapshots import ReplicaUsage, UsageSnapshot

BAR_WIDTH = 20
# No replica without a node: the summary's default.
NO_NODE = NoNode(0, 0)


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model's line of the fleet summary."""

    model: str
    ready: int
    total: int
    ejected: int
    draining: int
    in_flight: int
    requests_per_second: float
    # Requests waiting now for a slot under the limits.
    queued: int
    # "yes": a request within the idle window; "no": every replica known quiet
    # for longer; "unknown": neither can be said.
    asked: str


@dataclass(frozen=True, slots=True)
class GpuClassStatus:
    """One GPU class's line of the fleet summary: busy, idle, unknown, ejected."""

    gpu_class: str
    total: int
    busy: int
    idle: int
    unknown: int
    ejected: int
    bar: str


@dataclass(frozen=True, slots=True)
class Unasked:
    """A replica proven quiet for longer than the idle window: what could be stopped."""

    id: str
    model: str
    gpu_class: str
    gpus: int
    quiet_for_seconds: float


@dataclass(frozen=True, slots=True)
class HeldFor:
    """A model with requests held for it now: scaled to zero, or its replicas still loading."""

    model: str
    held: int
    # How long the oldest held request has waited, as of the snapshot.
    oldest_waited_seconds: float | None
    replicas: int


@dataclass(frozen=True, slots=True)
class QueuedFor:
    """A tenant's requests waiting now for a slot of a model under the limits, in one priority class."""

    model: str
    priority: str
    tenant: str
    queued: int
    # How long the oldest of them has waited, as of the snapshot.
    oldest_waited_seconds: float | None


@dataclass(frozen=True, slots=True)
class NotServing:
    """A replica whose /v1/models does not list the model the router sends it: each request there gets 404."""

    id: str
    model: str
    url: str


@dataclass(frozen=True, slots=True)
class TenantTokens:
    """A tenant's tokens since the router started, over every model, as its answers said them."""

    tenant: str
    prompt_tokens: int
    # Of the prompt tokens, those the engines read from their prefix cache (as far as they said).
    cached_tokens: int
    completion_tokens: int
    # Answers that said nothing readable of their tokens: not in the sums above.
    unknown_requests: int


def tenant_tokens(snapshot: UsageSnapshot) -> tuple[TenantTokens, ...]:
    """Per tenant, the snapshot's tokens and unknown answers summed over the models."""
    sums: dict[str, list[int]] = {}
    kinds = {"prompt": 0, "cached": 1, "completion": 2}
    for (_, tenant, kind), n in snapshot.tokens.items():
        sums.setdefault(tenant, [0, 0, 0, 0])[kinds[kind]] += n
    for (_, tenant), n in snapshot.usage_unknown.items():
        sums.setdefault(tenant, [0, 0, 0, 0])[3] += n
    return tuple(TenantTokens(tenant, *figures) for tenant, figures in sorted(sums.items()))


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """The fleet summary of GET /api/v1/status and router ctl status."""

    router: str
    generated_at: float
    watching_since: float
    idle_for_seconds: float
    models: tuple[ModelStatus, ...]
    gpus: tuple[GpuClassStatus, ...]
    unasked: tuple[Unasked, ...]
    unserved: Mapping[str, int]
    held: tuple[HeldFor, ...] = ()
    queue: tuple[QueuedFor, ...] = ()
    not_serving: tuple[NotServing, ...] = ()
    tenants: tuple[TenantTokens, ...] = ()
    # Per fabric, its nodes and the whole nodes that could be freed now (router/control/nodes.py).
    fabrics: tuple[FabricStatus, ...] = ()
    no_node: NoNode = NO_NODE
    node_conflicts: tuple[NodeConflict, ...] = ()

    def as_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["unserved"] = dict(self.unserved)
        return doc


def gpus_of(replica: ReplicaUsage) -> int:
    """The `gpus` label (checked as a positive integer where the replica set is read); 0 without one."""
    value = replica.labels.get("gpus", 0)
    if isinstance(value, str) and value.isdigit():
        # Kubernetes labels are strings (discovery's labels_from).
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return 0
    return int(value)


def usage_class(
    replica: ReplicaUsage, quiet_for: float | None, now: float, idle_for: float, wanted: Container[str] = ()
) -> str:
    """busy, idle, unknown or ejected: how a replica counts in the summary.

    `quiet_for` is the proven quiet bound (UsageSnapshot.quiet_for); `wanted`
    the models with requests held for them, whose replicas are never idle.
    """
    if replica.state == "ejected":
        return "ejected"
    if replica.in_flight > 0 or replica.model in wanted:
        return "busy"
    if quiet_for is not None and quiet_for >= idle_for:
        return "idle"
    if replica.last_used is not None and now - replica.last_used < idle_for:
        return "busy"
    # Watched for less than the window, and nothing seen meanwhile.
    return "unknown"


def bar(busy: int, idle: int, unknown: int, ejected: int, width: int = BAR_WIDTH) -> str:
    """'#' busy, '.' idle, '?' unknown, 'x' ejected, in proportion."""
    total = busy + idle + unknown + ejected
    if total == 0:
        return "[" + " " * width + "]"
    counts = [busy, idle, unknown, ejected]
    cells = [round(c * width / total) for c in counts]
    # Rounding must neither hide a non-zero part nor overflow the bar.
    for i, c in enumerate(counts):
        if c and not cells[i]:
            cells[i] = 1
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    while sum(cells) < width:
        cells[cells.index(max(cells))] += 1
    return "[" + "".join(ch * n for ch, n in zip("#.?x", cells, strict=True)) + "]"


def fleet_status(snapshot: UsageSnapshot, *, now: float, idle_for: float, rates: Mapping[str, float]) -> FleetStatus:
    quiet = snapshot.quiet_for()
    wanted = {model for model, d in snapshot.demand.items() if d.held > 0}
    # One pass over the replicas: each one's class once, counted by model and by GPU class.
    by_model: dict[str, _ModelTally] = {}
    per_class: dict[str, dict[str, int]] = {}
    unasked = []
    not_serving = []
    seen = []
    for r in snapshot.replicas:
        if r.serves_model is False:
            not_serving.append(NotServing(r.id, r.model, r.url))
        kind = usage_class(r, quiet.get(r.id), now, idle_for, wanted)
        seen.append(Seen(r, gpus_of(r), freeable(r, kind, r.model in wanted), kind == "ejected"))
        tally = by_model.get(r.model)
        if tally is None:
            tally = by_model[r.model] = _ModelTally()
        tally.count(r, kind)
        gpu_class = str(r.labels.get("gpu_class", "-"))
        held = gpus_of(r)
        counts = per_class.get(gpu_class)
        if counts is None:
            counts = per_class[gpu_class] = {"busy": 0, "idle": 0, "unknown": 0, "ejected": 0}
        counts[kind] += held
        if kind == "idle":
            quiet_for = quiet.get(r.id)
            assert quiet_for is not None
            unasked.append(Unasked(r.id, r.model, gpu_class, held, round(quiet_for, 1)))
    models = [
        ModelStatus(
            model=model,
            ready=tally.ready,
            total=tally.total,
            ejected=tally.ejected,
            draining=tally.draining,
            in_flight=tally.in_flight,
            requests_per_second=round(rates.get(model, 0.0), 3),
            queued=snapshot.queued.get(model, 0),
            asked=tally.asked(),
        )
        for model, tally in sorted(by_model.items())
    ]
    gpus = tuple(
        GpuClassStatus(
            gpu_class=c, total=sum(t.values()), bar=bar(t["busy"], t["idle"], t["unknown"], t["ejected"]), **t
        )
        for c, t in sorted(per_class.items())
    )
    nodes = whole_nodes(seen)
    return FleetStatus(
        router=snapshot.router,
        generated_at=snapshot.generated_at,
        watching_since=snapshot.started_at,
        idle_for_seconds=idle_for,
        models=tuple(models),
        gpus=gpus,
        unasked=tuple(sorted(unasked, key=lambda u: -u.quiet_for_seconds)),
        unserved=dict(sorted(snapshot.unserved.items())),
        held=tuple(
            HeldFor(
                model,
                d.held,
                None if d.oldest_held_since is None else round(max(0.0, now - d.oldest_held_since), 1),
                tally.total if (tally := by_model.get(model)) is not None else 0,
            )
            for model, d in sorted(snapshot.demand.items())
            if d.held > 0
        ),
        queue=tuple(
            QueuedFor(
                model,
                priority,
                tenant,
                q.queued,
                None if q.oldest_since is None else round(max(0.0, now - q.oldest_since), 1),
            )
            for (model, priority, tenant), q in sorted(snapshot.queues.items())
            if q.queued > 0
        ),
        not_serving=tuple(not_serving),
        tenants=tenant_tokens(snapshot),
        fabrics=nodes.fabrics,
        no_node=nodes.no_node,
        node_conflicts=nodes.node_conflicts,
    )


class _ModelTally:
    """One model's replicas as the summary counts them."""

    __slots__ = ("busy", "draining", "ejected", "idle", "in_flight", "ready", "total")

    def __init__(self) -> None:
        self.total = self.ready = self.ejected = self.draining = self.in_flight = self.busy = self.idle = 0

    def count(self, r: ReplicaUsage, kind: str) -> None:
        self.total += 1
        state = r.state
        if state == "ready":
            self.ready += 1
        elif state == "ejected":
            self.ejected += 1
        elif state in ("draining", "drained"):
            self.draining += 1
        self.in_flight += r.in_flight
        if kind == "busy":
            self.busy += 1
        elif kind == "idle":
            self.idle += 1

    def asked(self) -> str:
        """yes: one busy; no: every one idle; unknown: neither can be said."""
        if self.busy:
            return "yes"
        if self.total and self.idle == self.total:
            return "no"
        return "unknown"
