"""Whole nodes, per fabric: the nodes whose every replica could be let go now, and their GPUs.

A multi-node replica lands only where whole nodes are free on one fabric
(the interconnect its nodes share), so the number that decides it is not
the free GPUs but the free *nodes* per fabric. The router sees it from the
other side: each replica may say its `node` and `fabric` (config, push, or
discovery's pods mode: spec.nodeName and `fabric_label`), and a node could
be freed now when every replica on it is freeable (`freeable()`, the one
predicate).

Pure: records of one usage snapshot in, the summary out (GET /api/v1/status
`fabrics`, `no_node`, `node_conflicts`; `router ctl status`). What it will
not guess:

- a replica with no node is counted apart (`no_node`), never on a node;
- a node that replicas place on two fabrics is reported (`node_conflicts`)
  and counted on neither: which of them is right cannot be known here;
- a replica that never had a request stamped is never freeable (unknown
  is never idle), whatever its state;
- an ejected replica's GPUs are neither in use nor free (as in the GPU
  table): its node is not freeable, and its GPUs are counted apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from router.core.usage.snapshots import ReplicaUsage

# States in which a replica holds no request and takes none: `asleep` is the sleep tier's
# (vLLM's sleep mode), named here already so that adding it needs no change in this module.
FREEABLE_STATES = frozenset({"asleep", "drained"})


def freeable(replica: ReplicaUsage, kind: str, wanted: bool) -> bool:
    """Whether `replica` lets its node go: asleep or drained, or ready and proven idle.

    `kind` is its class in the summary (status.usage_class: "idle" is proven
    quiet for the window); `wanted`: its model has requests held for it (a
    replica of it will be asked for at once). Nothing in flight, and a usage
    stamp: a replica never seen used is unknown, and unknown is never idle.
    """
    if replica.last_used is None or replica.in_flight > 0 or wanted:
        return False
    if replica.state in FREEABLE_STATES:
        return True
    return replica.state == "ready" and kind == "idle"


@dataclass(frozen=True, slots=True)
class Seen:
    """One replica as the summary saw it: its record, its GPUs, whether it is freeable, whether ejected."""

    replica: ReplicaUsage
    gpus: int
    freeable: bool
    ejected: bool


@dataclass(frozen=True, slots=True)
class FreeNode:
    """A node whose every replica is freeable: the whole node could be freed now."""

    node: str
    gpus: int
    replicas: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FabricStatus:
    """One fabric's nodes; `fabric` None: nodes whose replicas name no fabric."""

    fabric: str | None
    nodes: int
    gpus: int
    # The GPUs of its ejected replicas: neither in use nor free.
    ejected_gpus: int
    free_nodes: tuple[FreeNode, ...]
    free_gpus: int


@dataclass(frozen=True, slots=True)
class NoNode:
    """Replicas that name no node: counted apart, on no node."""

    replicas: int
    gpus: int


@dataclass(frozen=True, slots=True)
class NodeConflict:
    """A node that replicas place on more than one fabric: on none of them in `fabrics`."""

    node: str
    fabrics: tuple[str, ...]
    replicas: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WholeNodes:
    """The nodes per fabric, with those that could be freed now; what has no node; the conflicts."""

    fabrics: tuple[FabricStatus, ...]
    no_node: NoNode
    node_conflicts: tuple[NodeConflict, ...]


class _Node:
    """One node's replicas as they are gathered."""

    __slots__ = ("ejected_gpus", "fabrics", "free", "gpus", "replicas")

    def __init__(self) -> None:
        self.fabrics: set[str] = set()
        # In the order met; listed sorted by id, as the workers' merge may meet them in any order.
        self.replicas: list[str] = []
        self.gpus = self.ejected_gpus = 0
        self.free = True


def whole_nodes(seen: Iterable[Seen]) -> WholeNodes:
    """The fabrics' nodes from the replicas of one snapshot."""
    nodes: dict[str, _Node] = {}
    apart = [0, 0]
    for s in seen:
        r = s.replica
        if r.node is None:
            apart[0] += 1
            apart[1] += s.gpus
            continue
        node = nodes.get(r.node)
        if node is None:
            node = nodes[r.node] = _Node()
        if r.fabric is not None:
            node.fabrics.add(r.fabric)
        node.replicas.append(r.id)
        node.gpus += s.gpus
        if s.ejected:
            node.ejected_gpus += s.gpus
        node.free = node.free and s.freeable
    conflicts = []
    by_fabric: dict[str | None, list[tuple[str, _Node]]] = {}
    for name, node in sorted(nodes.items()):
        if len(node.fabrics) > 1:
            conflicts.append(NodeConflict(name, tuple(sorted(node.fabrics)), tuple(sorted(node.replicas))))
            continue
        fabric = next(iter(node.fabrics), None)
        by_fabric.setdefault(fabric, []).append((name, node))
    fabrics = []
    # Named fabrics by name, then the nodes of no fabric.
    for fabric in sorted(by_fabric, key=lambda f: (f is None, f or "")):
        members = by_fabric[fabric]
        free = tuple(FreeNode(name, n.gpus, tuple(sorted(n.replicas))) for name, n in members if n.free)
        fabrics.append(
            FabricStatus(
                fabric=fabric,
                nodes=len(members),
                gpus=sum(n.gpus for _, n in members),
                ejected_gpus=sum(n.ejected_gpus for _, n in members),
                free_nodes=free,
                free_gpus=sum(f.gpus for f in free),
            )
        )
    return WholeNodes(tuple(fabrics), NoNode(apart[0], apart[1]), tuple(conflicts))
