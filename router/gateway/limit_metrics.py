"""The rate limits' counters and their Prometheus families: refusals, shadow refusals, Redis calls.

Counted on the event loop (a dict addition each), exported by a collector
that reads them when scraped; with `--workers` each worker's are summed by
the supervisor (router.run.worker_metrics). Tenants are the config's, which
bounds them; past MAX_TOKEN_TENANTS distinct ones the rest are one series
(`__other__`), as router_tokens_total's are.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from router.core.pool.tallies import MAX_TOKEN_TENANTS, OTHER_TENANTS

FAMILIES = (
    "router_rate_limited",
    "router_rate_limited_shadow",
    "router_rate_limit_redis_calls",
    "router_rate_limit_redis_errors",
    "router_rate_limit_unchecked",
)


class LimitCounters(Collector):
    """What the limits did: per (tenant, kind) refused and would-be refused; Redis's calls and failures."""

    def __init__(self) -> None:
        self.refused: dict[tuple[str, str], int] = {}
        self.shadow: dict[tuple[str, str], int] = {}
        # Round trips to Redis by what they were (admit, flush, load), and failures by reason.
        self.redis_calls: dict[str, int] = {}
        self.redis_errors: dict[str, int] = {}
        # Requests admitted or refused without a check, Redis being unavailable, by outcome.
        self.unchecked: dict[str, int] = {}
        self._tenants: set[str] = set()

    def _tenant(self, tenant: str) -> str:
        tenants = self._tenants
        if tenant not in tenants:
            if len(tenants) >= MAX_TOKEN_TENANTS:
                return OTHER_TENANTS
            tenants.add(tenant)
        return tenant

    def limited(self, tenant: str, kind: str, *, shadow: bool) -> None:
        counts = self.shadow if shadow else self.refused
        key = (self._tenant(tenant), kind)
        counts[key] = counts.get(key, 0) + 1

    def redis_call(self, what: str) -> None:
        self.redis_calls[what] = self.redis_calls.get(what, 0) + 1

    def redis_error(self, reason: str) -> None:
        self.redis_errors[reason] = self.redis_errors.get(reason, 0) + 1

    def unchecked_request(self, outcome: str) -> None:
        self.unchecked[outcome] = self.unchecked.get(outcome, 0) + 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, documentation, counts in (
            (
                "router_rate_limited",
                "Requests refused with 429 by their tenant's limit, by tenant and kind (requests, tokens).",
                self.refused,
            ),
            (
                "router_rate_limited_shadow",
                'Requests [limits] mode = "shadow" let through that the limit would have refused, by tenant and kind.',
                self.shadow,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["tenant", "kind"])
            for (tenant, kind), n in sorted(counts.items()):
                family.add_metric([tenant, kind], n)
            yield family
        for name, documentation, label, single in (
            (
                "router_rate_limit_redis_calls",
                "Round trips to the limits' Redis, by what they were: check (a request's), flush (settlements), "
                "load (the script).",
                "call",
                self.redis_calls,
            ),
            (
                "router_rate_limit_redis_errors",
                "Redis round trips that failed, by reason: timeout, connect, reset, protocol, error.",
                "reason",
                self.redis_errors,
            ),
            (
                "router_rate_limit_unchecked",
                "Requests of limited tenants not checked, Redis being unavailable, by outcome: admitted, refused "
                "([limits] redis_unavailable).",
                "outcome",
                self.unchecked,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=[label])
            for value, n in sorted(single.items()):
                family.add_metric([value], n)
            yield family
