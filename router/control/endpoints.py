"""PUT /api/v1/endpoints bodies read from what changed since the last one.

A push is the whole desired set, every time: 10,000 replicas are 1.4 MB of
JSON, of which a push usually changes one entry. Parsing and validating it
all took 150 ms. `PushedSets` keeps each entry of the last push it read, as
its bytes and the replica they made, and reads a new push by cutting its
array at the separator found between its first two entries: an entry whose
bytes it knows (compared with the one at the same place last time, else
looked for among them all) is that replica again (the same object, which
the pool then takes for unchanged at a glance); only the others are parsed
and validated.

Why a cut is safe though a string may hold the separator: an entry is
known only if `{` + its bytes + `}` was once parsed as one JSON object,
alone; and a new one must parse so now. Read from an entry's start, JSON's
syntax decides where the object ends, whatever follows: so if every piece
between two cuts parses as one object, every cut lies between two entries.
A body of another shape, a piece that does not parse (a cut inside a
string, a separator written another way), and any push that is wrong (an
invalid entry, a duplicate id) are read whole, by one parse of it all, as
every push was before: the same replicas, the same first error.
"""

from __future__ import annotations

import itertools
import operator
import re
from typing import cast

import orjson

from router.core.config.settings import ReplicaConfig, parse_replica, parse_replicas, replicas_where
from router.core.errors import ConfigError

# `{"replicas": [` ... `]}`: JSON's own whitespace only (orjson refuses any other).
_WS = rb"[ \t\n\r]*"
_START = re.compile(rb"\A" + _WS + rb"\{" + _WS + rb'"replicas"' + _WS + rb":" + _WS + rb"\[" + _WS + rb"\{")
_END = re.compile(rb"\}" + _WS + rb"\]" + _WS + rb"\}" + _WS + rb"\Z")
# Between two entries: `}`, a comma, `{`, and whatever whitespace the writer puts there.
_BETWEEN = re.compile(rb"\}" + _WS + rb"," + _WS + rb"\{")


class BadPush(Exception):
    """A pushed body that cannot be applied; the message names the problem (a 400)."""


class PushedSets:
    """Reads pushed replica sets; remembers the last one's entries to read the next from what changed."""

    def __init__(self) -> None:
        # The last push read: each entry's bytes within its braces, and its replica, in order.
        self._pieces: list[bytes] = []
        self._configs: list[ReplicaConfig] = []

    def read(self, body: bytes) -> tuple[ReplicaConfig, ...]:
        """The replica set `body` pushes; BadPush naming the problem if it cannot be applied."""
        pieces = _pieces(body)
        configs = self._from_pieces(pieces) if pieces is not None else None
        if configs is None:
            self._pieces, self._configs = [], []
            return _whole(body)
        assert pieces is not None
        self._pieces, self._configs = pieces, configs
        return tuple(configs)

    def _from_pieces(self, pieces: list[bytes]) -> list[ReplicaConfig] | None:
        """The set from the pieces of a push; None to read the whole body instead.

        Also None for a push that is wrong anywhere (a piece that is not one
        object, an entry that is not valid, a duplicate id): the whole read
        then says what is wrong, the first thing in the order it reads.
        """
        old_pieces, old_configs = self._pieces, self._configs
        # In place: compared byte for byte with the entry at the same place last time (no hashing).
        same = list(map(operator.eq, pieces, old_pieces))
        same += [False] * (len(pieces) - len(same))
        moved = list(itertools.compress(itertools.count(), map(operator.not_, same)))
        found: list[ReplicaConfig | None] = [*old_configs[: len(pieces)], *[None] * (len(pieces) - len(old_configs))]
        if not moved:
            return cast(list[ReplicaConfig], found)
        # Moved, or new: looked up among all of last time's, else parsed and validated.
        earlier = dict(zip(old_pieces, old_configs, strict=True)) if len(moved) > 8 or len(pieces) < 64 else None
        where = replicas_where("PUT /api/v1/endpoints")
        for index in moved:
            piece = pieces[index]
            config = earlier.get(piece) if earlier is not None else _find(piece, old_pieces, old_configs)
            if config is None:
                try:
                    config = parse_replica(where, "replicas", index, orjson.loads(b"{" + piece + b"}"), {})
                except (orjson.JSONDecodeError, ConfigError):
                    return None
            found[index] = config
        configs = cast(list[ReplicaConfig], found)
        # Those in place have the ids they had, unique then: a duplicate involves a moved one.
        ids: set[str] = set()
        at: dict[str, int] | None = None
        for index in moved:
            rid = configs[index].id
            if rid in ids:
                return None
            ids.add(rid)
            if index < len(old_configs) and old_configs[index].id == rid:
                # The same replica changed in place: its id was nowhere else last time.
                continue
            if at is None:
                at = {config.id: i for i, config in enumerate(old_configs)}
            first = at.get(rid)
            if first is not None and first != index and first < len(same) and same[first]:
                return None
        return configs


def _find(piece: bytes, pieces: list[bytes], configs: list[ReplicaConfig]) -> ReplicaConfig | None:
    """`piece`'s replica among last time's, by a scan (for a few moved entries, cheaper than hashing all)."""
    try:
        return configs[pieces.index(piece)]
    except ValueError:
        return None


def _pieces(body: bytes) -> list[bytes] | None:
    """The bytes of each entry of `{"replicas": [...]}` within its braces, cut at the first separator.

    None when the body is not of that shape.
    """
    start = _START.match(body)
    # Looked for in the body's last bytes only (more whitespace than that: read whole).
    end = _END.search(body, max(0, len(body) - 256))
    if start is None or end is None or end.start() < start.end() - 1:
        return None
    # From the first entry's `{` to the last one's `}`.
    entries = body[start.end() - 1 : end.start() + 1]
    between = _BETWEEN.search(entries)
    if between is None:
        return [entries[1:-1]]
    pieces = entries.split(between.group())
    pieces[0] = pieces[0][1:]
    pieces[-1] = pieces[-1][:-1]
    return pieces


def _whole(body: bytes) -> tuple[ReplicaConfig, ...]:
    """The body read whole, as every push was before: one parse, then every entry validated."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadPush(f"The body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadPush('The body must be a JSON object: {"replicas": [...]}.')
    for key in doc:
        if key != "replicas":
            raise BadPush(f"{key}: unknown field")
    if "replicas" not in doc:
        raise BadPush("replicas: is required")
    try:
        return parse_replicas(replicas_where("PUT /api/v1/endpoints"), "replicas", doc["replicas"])
    except ConfigError as exc:
        raise BadPush(str(exc)) from exc
