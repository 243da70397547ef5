"""The usage tick's own cost at 4, 400 and 4,000 replicas.

A tick snapshots every replica and hands the snapshot to the latest-copy and
Prometheus sinks (the usage body is serialized there, once). Half of the
replicas carry a stamp and some counters. Reports the best of several ticks
over a quiet fleet (frozen records reused) and over one where every replica
took a request since the last tick, and a /metrics render for scale.
"""

from __future__ import annotations

import argparse
import json
import time

from prometheus_client import CollectorRegistry, generate_latest

from router.control.sinks.latest import LatestSink
from router.control.sinks.prometheus import PrometheusSink, UsageCollector
from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool
from router.core.usage.snapshots import Ticker

SIZES = (4, 400, 4000)


def ticker_for(n: int) -> tuple[Ticker, CollectorRegistry]:
    configs = [ReplicaConfig(f"r-{i}", f"model-{i % 20}", f"http://127.0.0.1:{10000 + i % 50000}") for i in range(n)]
    pool = Pool(configs)
    for i, replica in enumerate(list(pool)):
        if i % 2 == 0:
            got = pool.acquire(replica.model)
            assert got is not None
            got.responses["2xx"] = 10
            pool.release(got)
    prometheus = PrometheusSink()
    ticker = Ticker(pool, [LatestSink(), prometheus], router="bench", started_at=time.time(), tick_seconds=5.0)
    registry = CollectorRegistry()
    registry.register(
        UsageCollector(prometheus, sink_failures=dict, push_failures=lambda: None, tick_seconds=lambda: 0.0)
    )
    return ticker, registry


def measure(n: int, rounds: int = 20) -> tuple[float, float, float]:
    """Best tick with a quiet fleet, best tick with every replica used since the last, one render."""
    ticker, registry = ticker_for(n)
    replicas = list(ticker.pool)
    quiet = busy = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        ticker.tick()
        quiet = min(quiet, time.perf_counter() - began)
    for _ in range(rounds):
        for replica in replicas:
            got = ticker.pool.acquire(replica.model)
            assert got is not None
            ticker.pool.release(got)
        began = time.perf_counter()
        ticker.tick()
        busy = min(busy, time.perf_counter() - began)
    prometheus = ticker.sinks[1]
    assert isinstance(prometheus, PrometheusSink)
    began = time.perf_counter()
    generate_latest(registry)
    prometheus.exposition()
    return quiet, busy, time.perf_counter() - began


def main() -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    for n in SIZES:
        quiet, busy, scrape = measure(n)
        results[str(n)] = {"quiet_tick_ms": quiet * 1000, "busy_tick_ms": busy * 1000, "scrape_ms": scrape * 1000}
    if args.json:
        print(json.dumps(results))
    else:
        for size, figures in results.items():
            print(
                f"{size:>5} replicas: tick {figures['quiet_tick_ms']:6.2f} ms quiet, {figures['busy_tick_ms']:6.2f} ms "
                f"with every replica used since the last tick; /metrics render {figures['scrape_ms']:6.1f} ms"
            )
    return results


if __name__ == "__main__":
    main()
