"""Usage snapshots that cost what changed: a tick looks at the replicas touched since the last one, and no other."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.usage.quiet import RouterReport, merge_reports, quiet_bounds
from router.core.usage.snapshots import ReplicaUsage, Ticker, UsageSnapshot
from tests.support.clock import FakeClock

WALL = 1_764_000_000.0


def fleet(n: int, *, machine: str | None = None, **labels: Any) -> list[ReplicaConfig]:
    """`n` replicas; with `machine`, each on node MACHINE-(i % 2) of fabric MACHINE (changed in place by a push)."""
    return [
        ReplicaConfig(
            f"r{i}",
            f"m{i % 3}",
            f"http://127.0.0.1:{9000 + i}",
            labels,
            node=None if machine is None else f"{machine}-{i % 2}",
            fabric=machine,
        )
        for i in range(n)
    ]


def ticker_of(pool: Pool, clock: FakeClock) -> Ticker:
    # Wall and monotonic clocks a constant apart: every conversion of a stamp is exact.
    return Ticker(
        pool, [], router="r", started_at=WALL, tick_seconds=1.0, wall=lambda: clock.now() + WALL, mono=clock.now
    )


def expected(replica: Replica, started_at: float = WALL) -> tuple[object, ...]:
    """A replica's record, read whole from the pool as a snapshot of every replica would."""
    return (
        replica.id,
        replica.model,
        replica.base_url,
        replica.state.value,
        replica.in_flight,
        replica.requests,
        None if replica.last_used is None else replica.last_used + WALL,
        max(replica.added_at + WALL, started_at),
        dict(replica.config.labels),
        dict(replica.responses),
        dict(replica.errors),
        replica.ejections,
        replica.recoveries,
        replica.connects_failed,
        # The engine and its reading: none read in these pools (engine metrics off).
        replica.engine,
        None,
        False,
        # Whether its /v1/models lists its model: no card read in these pools.
        replica.serves_model,
        replica.config.node,
        replica.config.fabric,
    )


def plain(record: ReplicaUsage) -> tuple[object, ...]:
    return (*record[:8], dict(record.labels), dict(record.responses), dict(record.errors), *record[11:])


def test_a_tick_looks_only_at_the_replicas_touched_since_the_last() -> None:
    clock = FakeClock(0.0)
    pool = Pool(fleet(1000), clock=clock)
    ticker = ticker_of(pool, clock)
    first = ticker.tick()
    assert ticker.snapshotter.looked_at == 1000
    assert len(first.replicas) == 1000
    quiet = ticker.tick()
    assert ticker.snapshotter.looked_at == 0
    assert quiet.changes is not None and quiet.changes.changed == () and quiet.changes.gone == ()
    # The records of a quiet tick are the same objects as before: nothing was rebuilt.
    assert all(a is b for a, b in zip(first.replicas, quiet.replicas, strict=True))
    served = []
    for model in ("m0", "m1", "m2"):
        replica = pool.acquire(model)
        assert replica is not None
        served.append(replica)
    pool.release(served[0])
    busy = ticker.tick()
    assert ticker.snapshotter.looked_at == 3
    assert busy.changes is not None
    assert sorted(r.id for _, r in busy.changes.changed) == sorted(r.id for r in served)
    # Two are still in flight: looked at again at the next tick (their stamps move to it), no other.
    clock.advance(1.0)
    ticker.tick()
    assert ticker.snapshotter.looked_at == 2
    pool.set_draining("r500", True)
    ticker.tick()
    assert ticker.snapshotter.looked_at == 3


def test_what_changed_reaches_back_to_any_earlier_snapshot() -> None:
    clock = FakeClock(0.0)
    pool = Pool(fleet(50), clock=clock)
    ticker = ticker_of(pool, clock)
    start = ticker.tick()
    # Not m1: the replica removed below (r49) is m1's, and the pick among idle replicas is random.
    for model in ("m0", "m2"):
        replica = pool.acquire(model)
        assert replica is not None
        pool.release(replica)
        ticker.tick()
    pool.set_replicas(fleet(49))
    now = ticker.snapshot(since=start.seq)
    assert now.changes is not None and now.changes.since == start.seq
    assert len(now.changes.changed) == 2
    assert now.changes.gone == (start.keys[49],)
    assert ticker.snapshot(since=now.seq + 5).changes is None


Op = tuple[str, int]
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["acquire", "release", "respond", "fail", "eject", "readmit", "drain", "undrain", "push", "tick"]
        ),
        st.integers(0, 11),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_a_snapshot_made_from_what_changed_equals_one_read_whole(ops: list[Op]) -> None:
    clock = FakeClock(0.0)
    pool = Pool(fleet(8, node="a", machine="x"), clock=clock)
    ticker = ticker_of(pool, clock)
    held: list[Replica] = []
    members = 8
    for op, n in ops:
        clock.advance(0.5)
        replicas = list(pool)
        replica = replicas[n % len(replicas)] if replicas else None
        if op == "acquire":
            got = pool.acquire(f"m{n % 3}")
            if got is not None:
                held.append(got)
        elif op == "release" and held:
            pool.release(held.pop(n % len(held)))
        elif op == "respond" and held:
            # The gateway counts a request once connected, as the replica would.
            held[n % len(held)].requests += 1
            pool.count_response(held[n % len(held)], 200 + 100 * (n % 4))
        elif op == "fail" and held:
            reason = ("reset", "timeout", "connect")[n % 3]
            if reason == "connect":
                held[n % len(held)].connects_failed += 1
            pool.count_failure(held[n % len(held)], reason)
        elif op == "eject" and replica is not None and not replica.removed:
            pool.ejections.eject(replica, 5.0)
        elif op == "readmit" and replica is not None:
            pool.ejections.readmit(replica)
        elif op in ("drain", "undrain") and replica is not None and not replica.removed:
            pool.set_draining(replica.id, op == "drain")
        elif op == "push":
            # Some go, some come, one moves to another URL, labels change.
            members = 4 + n % 8
            configs = fleet(members, node="b" if n % 2 else "a", machine=("x", "y", None)[n % 3])
            if n % 3 == 0:
                configs[0] = ReplicaConfig("r0", "m0", f"http://127.0.0.2:{n}")
            pool.set_replicas(configs)
        elif op == "tick":
            ticker.tick()
        snapshot = ticker.snapshot()
        assert sorted(map(plain, snapshot.replicas), key=repr) == sorted(map(expected, pool), key=repr)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 5000), min_size=1),
    st.data(),
)
def test_one_routers_quiet_bounds_are_the_merge_of_its_report(watching: dict[str, float], data: st.DataObject) -> None:
    last_used = {
        rid: data.draw(st.floats(w, 6000)) for rid, w in watching.items() if data.draw(st.booleans(), label=rid)
    }
    generated_at = data.draw(st.floats(0, 7000))
    report = RouterReport(server="r", last_used=last_used, watching_since=watching, generated_at=generated_at)
    merged = merge_reports([report], now=generated_at, idle_for=math.inf)
    assert quiet_bounds(last_used, watching, generated_at) == dict(merged.quiet_for)


def test_a_snapshot_by_hand_is_read_whole() -> None:
    record = ReplicaUsage("a", "m", "http://x", "ready", 0, 0, None, 1.0, {}, {}, {}, 0)
    snapshot = UsageSnapshot(router="r", started_at=0.0, generated_at=1.0, tick_seconds=1.0, replicas=(record,))
    assert list(snapshot.keyed()) == [(("a", "http://x", "m"), record)]
    assert snapshot.changes is None
