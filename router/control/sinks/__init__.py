"""Usage exporters: one `UsageSink` per module (latest copy, Prometheus, rates, HTTP push).

The latest copy and the push share the usage document's body (document.py),
built once per snapshot.

`build_sinks()` is the one place that decides which exporters a router has,
for a single process (app.py) and for the supervisor of `--workers` alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import aiohttp
from prometheus_client import CollectorRegistry

from router.control.sinks.document import UsageDocument
from router.control.sinks.latest import LatestSink
from router.control.sinks.prometheus import PrometheusSink, UsageCollector
from router.control.sinks.push import PushSink
from router.control.sinks.rates import RateSink
from router.control.sinks.usage_maps import UsageMaps
from router.core.config.settings import Config
from router.core.usage.snapshots import UsageSink


class Sinks:
    """Every exporter of one router, following the snapshots through one `UsageMaps`."""

    def __init__(self) -> None:
        # What every exporter keeps of the snapshots, updated once per snapshot for all.
        self.maps = UsageMaps()
        # The usage document's body, built once per snapshot for the latest copy and the push.
        self.document = UsageDocument(self.maps)
        self.latest = LatestSink(self.document)
        self.prometheus = PrometheusSink(self.maps)
        self.rates = RateSink(maps=self.maps)
        self.push: PushSink | None = None

    @property
    def all(self) -> list[UsageSink]:
        sinks: list[UsageSink] = [self.latest, self.prometheus, self.rates]
        if self.push is not None:
            sinks.append(self.push)
        return sinks

    def exposition(self) -> bytes:
        """The per-replica series of /metrics, as text; the rest is on the registry (register())."""
        return self.prometheus.exposition()

    def register(
        self,
        registry: CollectorRegistry,
        *,
        sink_failures: Callable[[], Mapping[str, int]],
        tick_seconds: Callable[[], float],
    ) -> None:
        """Export the usage snapshots (and the exporters' own health) on `registry`."""
        push = self.push
        registry.register(
            UsageCollector(
                self.prometheus,
                sink_failures=sink_failures,
                push_failures=(lambda: push.failures) if push is not None else (lambda: None),
                tick_seconds=tick_seconds,
            )
        )


def build_sinks(config: Config, session: aiohttp.ClientSession | None) -> Sinks:
    """The exporters `config` asks for; `session` carries the push (None: no push, as in a worker)."""
    sinks = Sinks()
    if config.usage_push_url and session is not None:
        sinks.push = PushSink.every_tick(session, config.usage_push_url, config.tick_seconds, sinks.document)
    return sinks
