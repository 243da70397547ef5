"""The merge of several routers' usage maps into a proven lower bound of quiet time (router ctl idle).

Router i says that no request reached replica r between
max(last_used_i[r], watching_since_i[r]) and its snapshot's generated_at;
after that it says nothing. Every view of idleness reads this rule, over
several routers (`router ctl idle`, `router scaler`) or one (status,
/api/v1/replicas, /metrics: `quiet_bounds()`, the same rule for one
router, in one pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class RouterReport:
    """What one router said in GET /api/v1/usage, or None if it did not answer."""

    server: str
    last_used: Mapping[str, float]
    watching_since: Mapping[str, float]
    generated_at: float
    # Requests held now per model (a model with any is wanted: none of its replicas is idle).
    held: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica every router proves quiet for at least `quiet_for_seconds`."""

    id: str
    model: str | None
    quiet_for_seconds: float
    last_used: float | None


@dataclass(frozen=True, slots=True)
class MergedUsage:
    """Several routers' usage maps as one: the candidates, the unknown, and whether every router answered."""

    complete: bool
    candidates: tuple[Candidate, ...]
    unknown: tuple[str, ...]
    # Per replica: the proven quiet time, None where it cannot be proven.
    quiet_for: Mapping[str, float | None]
    last_used: Mapping[str, float | None]


def merge_reports(
    reports: Iterable[RouterReport | None],
    *,
    now: float,
    idle_for: float,
    models: Mapping[str, str] | None = None,
) -> MergedUsage:
    """Merge several routers' usage maps into a proven lower bound of quiet time.

    Router i says that no request reached replica r between
    max(last_used_i[r], watching_since_i[r]) and its snapshot's generated_at;
    after that it says nothing. So r has been quiet for at least the oldest
    snapshot's time minus the latest of those horizons (a tick less than
    `now - horizon` at worst: what arrived since a snapshot is not known).
    A replica that some router does not watch, or any router that did not
    answer (None), makes the bound unprovable: unknown.
    """
    answered: list[RouterReport] = []
    complete = True
    for report in reports:
        if report is None:
            complete = False
        else:
            answered.append(report)
    ids = sorted({rid for rep in answered for rid in (*rep.watching_since, *rep.last_used)})
    as_of = min([now, *(rep.generated_at for rep in answered)])
    quiet_for: dict[str, float | None] = {}
    newest: dict[str, float | None] = {}
    for rid in ids:
        stamps = [rep.last_used[rid] for rep in answered if rid in rep.last_used]
        newest[rid] = max(stamps) if stamps else None
        bound: float | None = None
        if complete and answered:
            horizons: list[float] = []
            for rep in answered:
                watching = rep.watching_since.get(rid)
                if watching is None:
                    horizons = []
                    break
                horizons.append(max(watching, rep.last_used.get(rid, watching)))
            if horizons:
                bound = max(0.0, as_of - max(horizons))
        quiet_for[rid] = bound
    # A model some router holds requests for is wanted now, however quiet its replicas look.
    wanted = {model for rep in answered for model, held in rep.held.items() if held > 0}
    candidates = tuple(
        Candidate(
            id=rid,
            model=(models or {}).get(rid),
            quiet_for_seconds=q,
            last_used=newest[rid],
        )
        for rid in ids
        if (q := quiet_for[rid]) is not None and q >= idle_for and (models or {}).get(rid) not in wanted
    )
    unknown = tuple(rid for rid in ids if quiet_for[rid] is None)
    return MergedUsage(
        complete=complete,
        candidates=candidates if complete else (),
        unknown=unknown,
        quiet_for=MappingProxyType(quiet_for),
        last_used=MappingProxyType(newest),
    )


def quiet_bounds(
    last_used: Mapping[str, float], watching_since: Mapping[str, float], generated_at: float
) -> dict[str, float]:
    """merge_reports() over one router's report, as of its snapshot: per replica, the proven quiet time.

    One router always proves a bound for what it watches: no request reached
    the replica after max(last_used, watching_since), and it said so at
    generated_at.
    """
    get = last_used.get
    out: dict[str, float] = {}
    for rid, watching in watching_since.items():
        stamp = get(rid, watching)
        quiet = generated_at - (stamp if stamp > watching else watching)
        out[rid] = quiet if quiet > 0.0 else 0.0
    return out
