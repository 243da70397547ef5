"""The exporters updated from what changed: the same bytes as those made whole, after any change."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import aiohttp
import orjson
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.control.sinks.document import UsageDocument
from router.control.sinks.latest import LatestSink
from router.control.sinks.prometheus import STATES, PrometheusSink
from router.control.sinks.push import PushSink
from router.control.sinks.rates import RateSink, requests_by_model
from router.control.sinks.usage_maps import UsageMaps
from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.usage.snapshots import Ticker, UsageSnapshot
from tests.support.clock import FakeClock

WALL = 1_764_000_000.0


class Whole(Collector):
    """The per-replica series as prometheus_client writes them from a whole snapshot (the oracle)."""

    def __init__(self, snapshot: UsageSnapshot) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        labels = ["replica", "model"]
        last_used = GaugeMetricFamily("router_replica_last_used_timestamp_seconds", "", labels=labels)
        watching = GaugeMetricFamily("router_replica_watching_since_timestamp_seconds", "", labels=labels)
        quiet = GaugeMetricFamily("router_replica_quiet_seconds", "", labels=labels)
        in_flight = GaugeMetricFamily("router_replica_in_flight_requests", "", labels=labels)
        state = GaugeMetricFamily("router_replica_state", "", labels=[*labels, "state"])
        ejections = CounterMetricFamily("router_replica_ejections", "", labels=labels)
        recoveries = CounterMetricFamily("router_replica_recoveries", "", labels=labels)
        requests = CounterMetricFamily("router_requests", "", labels=[*labels, "status_class"])
        errors = CounterMetricFamily("router_upstream_errors", "", labels=[*labels, "reason"])
        proven = snapshot.quiet_for()
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


def samples_of(text: bytes) -> list[tuple[str, str]]:
    """Each sample line with the family it is written under (the help texts are the sink's own).

    Sorted: the order of a family's series is nobody's concern.
    """
    family = ""
    out = []
    for line in text.decode().splitlines():
        if line.startswith("# TYPE "):
            family = line.split()[2]
        elif not line.startswith("#"):
            out.append((family, line))
    return sorted(out)


def whole_text(snapshot: UsageSnapshot) -> bytes:
    registry = CollectorRegistry()
    registry.register(Whole(snapshot))
    return generate_latest(registry)


def fleet(n: int, url_salt: int = 0, node: str = "a") -> list[ReplicaConfig]:
    # Ids and models that need escaping in Prometheus text and in JSON.
    return [
        ReplicaConfig(
            f'r{i}-"q"\\' if i % 4 == 0 else f"r{i}",
            # r2 moves between models with the salt: replaced while the old one drains.
            f"m{i % 3}\n" if i % 5 == 0 else f"m{(i + url_salt * (i == 2)) % 3}",
            f"http://127.0.0.1:{9000 + i + (url_salt if i == 1 else 0)}",
            {"node": node, "gpus": i},
        )
        for i in range(n)
    ]


def churn(pool: Pool, clock: FakeClock, held: list[Replica], rng: random.Random) -> None:
    """One random change of the kinds a running router sees."""
    clock.advance(rng.choice((0.25, 1.0, 1e6)))
    replicas = list(pool)
    op = rng.randrange(9)
    if op < 3:
        got = pool.acquire(f"m{rng.randrange(3)}") or pool.acquire(f"m{rng.randrange(3)}\n")
        if got is not None:
            held.append(got)
            pool.count_response(got, rng.choice((200, 404, 503)))
            if rng.random() < 0.3:
                pool.count_failure(got, rng.choice(("reset", "timeout")))
    elif op < 5 and held:
        pool.release(held.pop(rng.randrange(len(held))))
    elif op == 5 and replicas:
        replica = rng.choice(replicas)
        if replica.ejected_until is None and not replica.removed:
            pool.ejections.eject(replica, 10.0)
        else:
            pool.ejections.readmit(replica)
    elif op == 6 and replicas:
        replica = rng.choice(replicas)
        if not replica.removed:
            pool.set_draining(replica.id, not replica.draining)
    else:
        pool.set_replicas(fleet(rng.randrange(3, 9), rng.randrange(3), rng.choice("ab")))


def ticker_of(pool: Pool, clock: FakeClock, *sinks: object) -> Ticker:
    return Ticker(
        pool,
        list(sinks),  # type: ignore[arg-type]
        router="r",
        started_at=WALL,
        tick_seconds=1.0,
        wall=lambda: clock.now() + WALL,
        mono=clock.now,
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 40))
def test_the_exporters_built_from_changes_say_what_a_whole_snapshot_says(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    pool = Pool(fleet(6), clock=clock)
    # As a router has them: following the snapshots through one UsageMaps.
    maps = UsageMaps()
    latest, prometheus, rates = LatestSink(UsageDocument(maps)), PrometheusSink(maps), RateSink(1e9, maps)
    ticker = ticker_of(pool, clock, latest, prometheus, rates)
    # Some that see only every third snapshot catch up from the whole: with
    # maps of their own, or with the shared ones, whose steps they missed.
    late = [(UsageDocument(), PrometheusSink()), (UsageDocument(maps), PrometheusSink(maps))]
    # And one fed snapshots without keys or changes (as combined by hand): it keys records by id, URL and model.
    keyless = (UsageDocument(), PrometheusSink())
    held: list[Replica] = []
    first: UsageSnapshot | None = None
    for step in range(steps):
        churn(pool, clock, held, rng)
        snapshot = ticker.tick()
        first = first or snapshot
        assert latest.usage_body is not None
        assert orjson.loads(latest.usage_body) == snapshot.usage_document()
        assert samples_of(prometheus.exposition()) == samples_of(whole_text(snapshot))
        bare = replace(snapshot, keys=(), book=0, seq=0, changes=None)
        assert orjson.loads(keyless[0].body(bare)) == snapshot.usage_document()
        keyless[1].publish(bare)
        assert samples_of(keyless[1].exposition()) == samples_of(whole_text(snapshot))
        if step % 3 == 2:
            for late_document, late_prometheus in late:
                assert orjson.loads(late_document.body(snapshot)) == snapshot.usage_document()
                late_prometheus.publish(snapshot)
                assert samples_of(late_prometheus.exposition()) == samples_of(whole_text(snapshot))
    # The rates' oldest point is the first tick's totals: the rate since then is whole.
    assert first is not None
    clock.advance(1.0)
    now = ticker.snapshot()
    span = now.generated_at - first.generated_at
    then = requests_by_model(first)
    assert rates.per_second(now) == {
        model: max(0, total - then.get(model, 0)) / span for model, total in requests_by_model(now).items()
    }


def test_a_scrape_between_two_ticks_serves_the_same_bytes() -> None:
    clock = FakeClock(0.0)
    pool = Pool(fleet(5), clock=clock)
    prometheus = PrometheusSink()
    ticker = ticker_of(pool, clock, prometheus)
    ticker.tick()
    first = prometheus.exposition()
    assert prometheus.exposition() is first
    clock.advance(2.0)
    ticker.tick()
    # Quiet time grows with each snapshot: new text, though no replica changed.
    assert prometheus.exposition() != first


def test_a_router_nobody_scrapes_keeps_nothing_of_replicas_gone() -> None:
    clock = FakeClock(0.0)
    pool = Pool(fleet(4), clock=clock)
    prometheus = PrometheusSink()
    ticker = ticker_of(pool, clock, prometheus)
    for generation in range(50):
        # Discovery's churn: every replica replaced by a new one, and no scrape meanwhile.
        pool.set_replicas([ReplicaConfig(f"g{generation}-{i}", "m", f"http://127.0.0.1:{9000 + i}") for i in range(4)])
        ticker.tick()
    assert len(prometheus._dirty) == 4
    # Per replica: five series, and one router_replica_state line per state (ready ... asleep, waking).
    assert len(samples_of(prometheus.exposition())) == 4 * 11


async def test_the_push_sends_the_body_the_latest_copy_holds() -> None:
    received: list[bytes] = []

    async def take(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/usage", take)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    clock = FakeClock(0.0)
    pool = Pool(fleet(4), clock=clock)
    document = UsageDocument()
    latest = LatestSink(document)
    try:
        async with aiohttp.ClientSession() as session:
            push = PushSink(session, f"http://127.0.0.1:{port}/usage", timeout_seconds=5, document=document)
            ticker = ticker_of(pool, clock, latest, push)
            snapshot = ticker.tick()
            # The tick's push, then the final one of a shutdown: the same body both times.
            assert await push.flush(snapshot)
    finally:
        await runner.cleanup()
    assert received == [latest.usage_body, latest.usage_body]
    # Built once: asked again for the same snapshot, the document gives the same bytes object.
    assert document.body(snapshot) is latest.usage_body
