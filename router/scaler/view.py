"""One poll round's facts per model, and what KEDA is told from them.

No I/O and no clock here (times are passed in), so that each rule can be
tested on its own. The quiet bounds are `router.core.usage.snapshots.merge_reports`'s, the
merge of `router ctl idle`, never a second one: a router that did not answer
makes the round incomplete, and a replica that some router does not watch
is unknown.

A model is active (KEDA keeps or brings up its Deployment) when

- no round has finished yet, or the last one is incomplete (a router did not
  answer: unknown is never idle, so a missed router never scales to zero);
- a router holds a request for it (or told the scaler so on POST /wake), or
  a request for it found no replica within `idleAfter`;
- a router has a request in flight on one of its replicas;
- one of its replicas is unknown to the merge;
- or its replicas' proven quiet time is below `idleAfter`.

A model with no replica anywhere and no request for it is inactive: that is
the state scaled to zero, and nothing there can be unknown.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from router.core.usage.snapshots import RouterReport, merge_reports

DEFAULT_IDLE_AFTER = 300.0
DEFAULT_TARGET_IN_FLIGHT = 8.0
METADATA_KEYS = ("model", "modelFromEnv", "idleAfter", "targetInFlight", "sleepAfter")


@dataclass(frozen=True, slots=True)
class RouterPoll:
    """What one router answered in a round: its usage map, its replicas, its demand."""

    server: str
    router: str
    report: RouterReport
    # (replica id, model, requests in flight)
    replicas: tuple[tuple[str, str, int], ...]
    # model -> (requests held now, Unix seconds of the last request no replica could serve, or None)
    demand: Mapping[str, tuple[int, float | None]]
    # replica id -> its state at this router (ready, draining, drained, ejected, asleep, waking).
    states: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def requests(self) -> dict[str, int]:
        """Per model, requests in flight on its replicas plus requests held, at this router (none: absent)."""
        counts: dict[str, int] = {}
        for _, model, in_flight in self.replicas:
            if in_flight:
                counts[model] = counts.get(model, 0) + in_flight
        for model, (held, _) in self.demand.items():
            if held:
                counts[model] = counts.get(model, 0) + held
        return counts


class BadAnswer(ValueError):
    """A router's admin API answered something that is not the usage map or the replica list."""


def _number(doc: Mapping[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadAnswer(f"{where}: {key} is not a number")
    return float(value)


def _stamps(doc: Mapping[str, Any], key: str) -> dict[str, float]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise BadAnswer(f"/api/v1/usage: {key} is not an object")
    for rid, stamp in value.items():
        if isinstance(stamp, bool) or not isinstance(stamp, int | float):
            raise BadAnswer(f"/api/v1/usage: {key}[{rid!r}] is not a number")
    return value


def parse_poll(server: str, usage: object, replicas: object) -> RouterPoll:
    """One router's GET /api/v1/usage and GET /api/v1/replicas; BadAnswer names what is wrong."""
    if not isinstance(usage, dict):
        raise BadAnswer("/api/v1/usage is not a JSON object")
    if not isinstance(replicas, list):
        raise BadAnswer("/api/v1/replicas is not a JSON array")
    router = usage.get("router")
    if not isinstance(router, str):
        raise BadAnswer("/api/v1/usage: router is not a string")
    raw_demand = usage.get("demand", {})
    if not isinstance(raw_demand, dict):
        raise BadAnswer("/api/v1/usage: demand is not an object")
    demand: dict[str, tuple[int, float | None]] = {}
    for model, d in raw_demand.items():
        held = d.get("held", 0) if isinstance(d, dict) else None
        asked = d.get("last_asked") if isinstance(d, dict) else None
        if not isinstance(held, int) or isinstance(held, bool) or not (asked is None or isinstance(asked, int | float)):
            raise BadAnswer(f"/api/v1/usage: demand[{model!r}] is not {{held, last_asked}}")
        demand[model] = (held, None if asked is None else float(asked))
    rows: list[tuple[str, str, int]] = []
    states: dict[str, str] = {}
    for i, row in enumerate(replicas):
        try:
            rid, model, in_flight = row["id"], row["model"], row["in_flight"]
        except (TypeError, KeyError):
            raise BadAnswer(f"/api/v1/replicas[{i}] lacks id, model or in_flight") from None
        if not isinstance(rid, str) or not isinstance(model, str) or not isinstance(in_flight, int):
            raise BadAnswer(f"/api/v1/replicas[{i}]: id, model or in_flight of the wrong type")
        rows.append((rid, model, in_flight))
        state = row.get("state")
        if isinstance(state, str):
            states[rid] = state
    report = RouterReport(
        server=server,
        last_used=_stamps(usage, "last_used"),
        watching_since=_stamps(usage, "watching_since"),
        generated_at=_number(usage, "generated_at", "/api/v1/usage"),
        held=MappingProxyType({model: held for model, (held, _) in demand.items()}),
    )
    return RouterPoll(server, router, report, tuple(rows), MappingProxyType(demand), MappingProxyType(states))


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """One model across every router that answered."""

    replicas: int = 0
    # Replicas whose quiet time the merge cannot prove (some router does not watch them).
    unknown: int = 0
    in_flight: int = 0
    held: int = 0
    # In flight + held at routers that did not answer this round, as they last answered.
    carried: int = 0
    # The least proven quiet time over its replicas; None with no replica or with one unknown.
    quiet_for: float | None = None
    # Unix seconds of the newest request for it that found no replica; None if none is known.
    last_asked: float | None = None
    # Replicas asleep or waking at some router (the sleep tier): never in use, never unknown.
    asleep: int = 0

    @property
    def requests(self) -> int:
        """What the HPA sizes the Deployment on: requests in flight plus requests held, carried ones included."""
        return self.in_flight + self.held + self.carried


NO_FACTS = ModelFacts()


@dataclass(frozen=True, slots=True)
class FleetView:
    """The merged usage as the scaler judges it: active or not, and how many replicas, per model."""

    complete: bool
    # Unix seconds the quiet bounds hold as of: the oldest snapshot of the round.
    as_of: float
    models: Mapping[str, ModelFacts] = field(default_factory=lambda: MappingProxyType({}))
    # Router name -> the time of its snapshot in this round (the oldest if two share a name).
    snapshots: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # Routers whose figures the request counts hold: those that answered, and those carried.
    reporting: int = 0
    # Per replica: its model, its proven quiet time (None: unknown), and its states over the routers.
    replicas: Mapping[str, tuple[str, float | None, frozenset[str]]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def facts(self, model: str) -> ModelFacts:
        return self.models.get(model, NO_FACTS)


def build_view(
    polls: Sequence[RouterPoll | None],
    *,
    now: float,
    asked: Mapping[str, float],
    carried: Sequence[RouterPoll] = (),
) -> FleetView:
    """Merge one round: `polls` has None for each router that did not answer.

    `asked`: the newest `last_asked` per model seen in earlier rounds (a
    router shows it for one tick only; the poller remembers it).
    `carried`: the last answers of routers that did not answer this round.
    They count in the requests only (the HPA's metric), since leaving them
    out would read a missed poll as requests ended and let the HPA shrink
    a Deployment they are using; they prove nothing quiet, and the round
    stays incomplete.
    """
    answered = [p for p in polls if p is not None]
    complete = len(answered) == len(polls) and bool(polls)
    merged = merge_reports((p.report if p is not None else None for p in polls), now=now, idle_for=math.inf)
    quiet = merged.quiet_for
    as_of = min([now, *(p.report.generated_at for p in answered)])
    ids: dict[str, set[str]] = {}
    states: dict[str, set[str]] = {}
    in_flight: dict[str, int] = {}
    held: dict[str, int] = {}
    last_asked: dict[str, float] = dict(asked)
    snapshots: dict[str, float] = {}
    stale: dict[str, int] = {}
    for poll in carried:
        for model, count in poll.requests().items():
            stale[model] = stale.get(model, 0) + count
    for poll in answered:
        for rid, model, count in poll.replicas:
            ids.setdefault(model, set()).add(rid)
            states.setdefault(rid, set()).add(poll.states.get(rid, "unknown"))
            if count:
                in_flight[model] = in_flight.get(model, 0) + count
        for model, (count, asked_at) in poll.demand.items():
            if count:
                held[model] = held.get(model, 0) + count
            if asked_at is not None and asked_at > last_asked.get(model, -math.inf):
                last_asked[model] = asked_at
        generated = poll.report.generated_at
        if generated < snapshots.get(poll.router, math.inf):
            snapshots[poll.router] = generated
    models: dict[str, ModelFacts] = {}
    for model in ids.keys() | held.keys() | last_asked.keys() | stale.keys():
        replica_ids = ids.get(model, ())
        unknown = 0
        least: float | None = None
        for rid in replica_ids:
            # A replica listed by /replicas but absent from the (older) usage map is unknown too.
            q = quiet.get(rid)
            if q is None:
                unknown += 1
            elif least is None or q < least:
                least = q
        models[model] = ModelFacts(
            replicas=len(replica_ids),
            unknown=unknown,
            in_flight=in_flight.get(model, 0),
            held=held.get(model, 0),
            carried=stale.get(model, 0),
            quiet_for=None if unknown else least,
            last_asked=last_asked.get(model),
            asleep=sum(1 for rid in replica_ids if states.get(rid, set()) & _ASLEEP),
        )
    replicas = {
        rid: (model, quiet.get(rid), frozenset(states.get(rid, ()))) for model, rids in ids.items() for rid in rids
    }
    return FleetView(
        complete,
        as_of,
        MappingProxyType(models),
        MappingProxyType(snapshots),
        len(answered) + len(carried),
        MappingProxyType(replicas),
    )


_ASLEEP = frozenset({"asleep", "waking"})


def due_to_sleep(view: FleetView, sleep_after: Mapping[str, float]) -> list[str]:
    """The replicas to put to sleep now: of a model with `sleepAfter`, ready at every router, with nothing
    in flight or held for their model, and proven quiet for at least that long. Only on a complete round:
    a router that did not answer may be sending them requests."""
    if not view.complete:
        return []
    due = []
    for rid, (model, quiet_for, states) in view.replicas.items():
        after = sleep_after.get(model)
        if after is None or quiet_for is None or quiet_for < after or states != _READY:
            continue
        facts = view.facts(model)
        if facts.in_flight == 0 and facts.held == 0:
            due.append(rid)
    return sorted(due)


_READY = frozenset({"ready"})


# What a ScaledObject asks: its trigger's metadata ---------------------------------


class BadMetadata(ValueError):
    """The trigger's metadata cannot be used; the message names the key (gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class Query:
    """What KEDA asks of a scaled object: its model and its rules."""

    model: str
    idle_after: float = DEFAULT_IDLE_AFTER
    target_in_flight: float = DEFAULT_TARGET_IN_FLIGHT
    # Put its replicas to sleep once proven quiet this long (below idle_after); None: never.
    sleep_after: float | None = None


def _seconds(metadata: Mapping[str, str], key: str, default: float, *, positive: bool) -> float:
    raw = metadata.get(key)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise BadMetadata(f"scalerMetadata.{key}: must be a number {bound}, got {raw!r}")
    return value


def parse_metadata(metadata: Mapping[str, str]) -> Query:
    """The ScaledObject's trigger metadata: `model` or `modelFromEnv` (required), `idleAfter` (s), `targetInFlight`.

    Other keys are KEDA's own (scalerAddress, TLS settings) and pass; one
    that differs from ours only in case is a typo, refused.
    """
    for key in metadata:
        for known in METADATA_KEYS:
            if key != known and key.lower() == known.lower():
                raise BadMetadata(f"scalerMetadata.{key}: unknown key; did you mean {known}?")
    # KEDA resolves a `*FromEnv` key from the scale target's environment and sends the value
    # under the same key (external_scaler.go); an unresolved one it leaves out.
    model = metadata.get("model", "").strip() or metadata.get("modelFromEnv", "").strip()
    if not model:
        raise BadMetadata(
            "scalerMetadata.model: is required (the model name clients ask for; or modelFromEnv, "
            "an environment variable of the scale target that KEDA resolves)"
        )
    idle_after = _seconds(metadata, "idleAfter", DEFAULT_IDLE_AFTER, positive=False)
    sleep_after: float | None = None
    if "sleepAfter" in metadata:
        sleep_after = _seconds(metadata, "sleepAfter", 0.0, positive=False)
        if sleep_after >= idle_after:
            raise BadMetadata(
                f"scalerMetadata.sleepAfter: must be below idleAfter ({idle_after:g} s): a replica sleeps "
                f"before its model scales to zero, got {metadata['sleepAfter']!r}"
            )
    return Query(
        model=model,
        idle_after=idle_after,
        target_in_flight=_seconds(metadata, "targetInFlight", DEFAULT_TARGET_IN_FLIGHT, positive=True),
        sleep_after=sleep_after,
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """The scaler's answer for one query: active, the metric's value, and why."""

    active: bool
    # Why, in words for the log and /healthz.
    reason: str


def _requests(count: int) -> str:
    return "1 request" if count == 1 else f"{count} requests"


def decide(view: FleetView | None, query: Query, *, woken: bool = False) -> Decision:
    """IsActive for `query` on the newest round; `woken`: a router told us it holds a request for the model."""
    if view is None:
        return Decision(True, "no poll round has finished yet")
    if not view.complete:
        return Decision(True, "a router did not answer the last round")
    facts = view.facts(query.model)
    if facts.held:
        return Decision(True, f"{_requests(facts.held)} held")
    if woken:
        return Decision(True, "a router called to say it holds a request")
    if facts.in_flight:
        return Decision(True, f"{_requests(facts.in_flight)} in flight")
    if facts.unknown:
        unknown = f"{facts.unknown} of {facts.replicas} {'replica' if facts.replicas == 1 else 'replicas'} unknown"
        return Decision(True, f"{unknown} (not watched by every router)")
    if facts.last_asked is not None and view.as_of - facts.last_asked < query.idle_after:
        return Decision(True, f"asked for {view.as_of - facts.last_asked:.1f} s ago with no replica to serve it")
    if facts.quiet_for is not None and facts.quiet_for < query.idle_after:
        # A sleeping model is active but idle: kept (asleep) until idleAfter, then scaled to zero.
        asleep = f", {facts.asleep} asleep" if facts.asleep else ""
        return Decision(True, f"quiet for {facts.quiet_for:.1f} s{asleep}, under idleAfter {query.idle_after:g} s")
    if facts.quiet_for is None:
        # Also what a model name no router knows looks like: say so, for it scales a Deployment to zero.
        return Decision(
            False,
            "no router lists a replica of it or a request for it: scaled to zero, or scalerMetadata.model"
            " is not the name the routers list (a typo, an alias)",
        )
    return Decision(False, f"quiet for at least {facts.quiet_for:.1f} s (idleAfter {query.idle_after:g} s)")


_NOT_NAME = re.compile(r"[^a-z0-9]+")


def metric_name(model: str) -> str:
    """The model's metric for the HPA: lowercase letters, digits and dashes, distinct per model.

    A model name holds characters a metric name may not (dots, slashes,
    capitals); when any was replaced, a short hash of the exact name keeps
    two models from sharing a metric.
    """
    slug = _NOT_NAME.sub("-", model.lower()).strip("-")[:48].rstrip("-")
    name = f"router-requests-{slug}" if slug else "router-requests"
    if slug != model:
        name += "-" + hashlib.sha256(model.encode()).hexdigest()[:8]
    return name
