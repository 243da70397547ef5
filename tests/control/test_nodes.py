"""router/control/nodes.py: the one rule for a freeable replica, and the whole nodes per fabric, pure."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from router.control.nodes import FREEABLE_STATES, Seen, freeable, whole_nodes
from router.core.usage.snapshots import ReplicaUsage

NOW = 1_800_000_000.0


def record(rid: str, *, node: str | None = None, fabric: str | None = None, **fields: Any) -> ReplicaUsage:
    base: dict[str, Any] = {
        "id": rid,
        "model": "m",
        "url": "http://10.0.0.1:8000",
        "state": "ready",
        "in_flight": 0,
        "requests": 1,
        "last_used": NOW - 60,
        "watching_since": NOW - 3600,
        "labels": MappingProxyType({}),
        "responses": MappingProxyType({}),
        "errors": MappingProxyType({}),
        "ejections": 0,
    }
    return ReplicaUsage(**{**base, **fields, "node": node, "fabric": fabric})


def test_the_sleep_tiers_asleep_is_freeable_as_drained_is() -> None:
    """The sleep branch adds the state "asleep": this rule already frees its node."""
    assert {"asleep", "drained"} <= FREEABLE_STATES
    for state in ("asleep", "drained"):
        assert freeable(record("r", state=state), "busy", wanted=False)


@pytest.mark.parametrize(
    ("fields", "kind", "wanted"),
    [
        ({"last_used": None, "state": "drained"}, "unknown", False),  # never stamped: unknown, never idle
        ({"last_used": None}, "idle", False),
        ({"in_flight": 1, "state": "draining"}, "busy", False),
        ({"state": "asleep"}, "busy", True),  # its model has requests held: it is about to be woken
        ({"state": "ejected"}, "ejected", False),  # neither used nor free
        ({"state": "waking"}, "busy", False),
        ({}, "busy", False),  # ready, used within the window
        ({}, "unknown", False),
    ],
)
def test_these_replicas_hold_their_node_back(fields: dict[str, Any], kind: str, wanted: bool) -> None:
    assert not freeable(record("r", **fields), kind, wanted)


def test_a_ready_replica_proven_idle_with_a_stamp_is_freeable() -> None:
    assert freeable(record("r"), "idle", wanted=False)


def seen(r: ReplicaUsage, gpus: int, free: bool) -> Seen:
    return Seen(r, gpus, free, r.state == "ejected")


def test_a_node_is_free_only_when_every_replica_on_it_is() -> None:
    summary = whole_nodes(
        [
            seen(record("a1", node="n1", fabric="ib-a"), 4, True),
            seen(record("a2", node="n1", fabric="ib-a"), 4, True),
            seen(record("b1", node="n2", fabric="ib-a"), 4, True),
            seen(record("b2", node="n2", fabric="ib-a"), 4, False),
            seen(record("c1", node="n3", fabric="ib-b", state="ejected"), 8, False),
        ]
    )
    a, b = summary.fabrics
    assert (a.fabric, a.nodes, a.gpus, a.free_gpus, a.ejected_gpus) == ("ib-a", 2, 16, 8, 0)
    assert [(f.node, f.gpus, f.replicas) for f in a.free_nodes] == [("n1", 8, ("a1", "a2"))]
    # An ejected replica's GPUs: counted apart, and its node not free.
    assert (b.fabric, b.nodes, b.gpus, b.free_gpus, b.ejected_gpus, b.free_nodes) == ("ib-b", 1, 8, 0, 8, ())
    assert summary.no_node.replicas == 0 and summary.node_conflicts == ()


def test_no_node_is_counted_apart_and_a_node_on_two_fabrics_on_neither() -> None:
    summary = whole_nodes(
        [
            seen(record("x"), 2, True),
            seen(record("y"), 1, False),
            seen(record("p", node="n9", fabric="ib-a"), 4, True),
            seen(record("q", node="n9", fabric="ib-b"), 4, True),
            # A node some replicas name no fabric for: the one named stands, no conflict.
            seen(record("s", node="n5", fabric="ib-a"), 4, True),
            seen(record("t", node="n5"), 4, True),
            # Nodes of no fabric at all: under fabric None, after the named ones.
            seen(record("u", node="n7"), 8, True),
        ]
    )
    assert (summary.no_node.replicas, summary.no_node.gpus) == (2, 3)
    ((conflict),) = summary.node_conflicts
    assert (conflict.node, conflict.fabrics, conflict.replicas) == ("n9", ("ib-a", "ib-b"), ("p", "q"))
    assert [(f.fabric, f.nodes, f.free_gpus) for f in summary.fabrics] == [("ib-a", 1, 8), (None, 1, 8)]


def test_nothing_with_a_node_makes_no_fabric() -> None:
    summary = whole_nodes([seen(record("x"), 2, True)])
    assert summary.fabrics == () and summary.node_conflicts == ()
