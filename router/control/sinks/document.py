"""The usage map's document (GET /api/v1/usage, the push) as bytes, built once per snapshot.

The latest copy and the push share one `UsageDocument`: whichever publishes
a snapshot first builds its body, the other gets the same bytes. Built from
what changed: the maps (router.control.sinks.usage_maps) follow the changed records,
and each map is serialized again (by orjson, in C) only when one of its
values moved, so that a tick over a quiet fleet joins bytes it already has;
only the header (the snapshot's time) and the demand are new each tick.
"""

from __future__ import annotations

import orjson

from router.control.sinks.usage_maps import UsageMaps
from router.core.usage.snapshots import UsageSnapshot, demand_json

_MAPS = ("last_used", "watching_since", "model", "asleep")


class UsageDocument:
    """The body of GET /api/v1/usage and of the push, for the newest snapshot it was given."""

    def __init__(self, maps: UsageMaps | None = None) -> None:
        """`maps`: shared with the other exporters, which follow the same snapshots."""
        self._maps = maps if maps is not None else UsageMaps()
        self._step = 0
        # Each map as JSON (`"name":{...}`), until its values move.
        self._serialized: dict[str, bytes] = {}
        self._snapshot: UsageSnapshot | None = None
        self._body = b""

    def body(self, snapshot: UsageSnapshot) -> bytes:
        """`snapshot.usage_document()` as JSON bytes: equal to orjson's, key for key."""
        if snapshot is self._snapshot:
            return self._body
        maps = self._maps
        maps.follow(snapshot)
        serialized = self._serialized
        if maps.steps == self._step + 1:
            for name in maps.moved:
                serialized.pop(name, None)
        else:
            # A step missed: all anew.
            serialized.clear()
        self._step = maps.steps
        dumps = orjson.dumps
        for name in _MAPS:
            if name not in serialized:
                # In C, only when a value of the map moved: a quiet tick reuses every map's bytes.
                serialized[name] = b'"%s":%s' % (name.encode(), dumps(getattr(maps, name)))
        head = dumps(
            {
                "router": snapshot.router,
                "started_at": snapshot.started_at,
                "generated_at": snapshot.generated_at,
                "tick_seconds": snapshot.tick_seconds,
            }
        )
        demand = dumps(demand_json(snapshot.demand))
        self._body = b"".join(
            (head[:-1], b",", b",".join([serialized[name] for name in _MAPS]), b',"demand":', demand, b"}")
        )
        self._snapshot = snapshot
        return self._body
