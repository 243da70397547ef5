"""Records that change a few at a time, and what changed between two looks at them.

A usage snapshot holds one record per replica: thousands, of which a tick
finds a handful changed. `RecordBook` keeps the records by key and, per
key, the seq (the snapshot's number) at which it last changed, in the order
of the changes; so what changed since any earlier seq is found by walking
back from the newest change, in time proportional to the changes, never to
the fleet. A consumer that follows the snapshots (an exporter, the
supervisor of `--workers`) keeps its own copy in a `Follower` and applies
each snapshot's `Changes`; when it cannot (it missed one, or the book has
forgotten that far back), it compares the whole set, once.
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")
Key = Hashable

# Keys gone from the book are remembered (so that a consumer learns they are
# gone) until there are this many, or as many as live records if more: then
# they are forgotten at once, and a consumer behind that point compares all.
_GONE_KEPT = 1024


def _book_number() -> int:
    """A number for a new book, unlike any other's, in this process or another (a worker's).

    Changes since a seq make sense only against the book that counted it.
    """
    return secrets.randbits(62) + 1


@dataclass(frozen=True, slots=True)
class Changes(Generic[R]):
    """What changed in a book after seq `since`: new or changed records by key, and keys gone."""

    book: int
    since: int
    changed: tuple[tuple[Key, R], ...]
    gone: tuple[Key, ...]


class RecordBook(Generic[R]):
    """Records by key, in the order their keys first came, and the order in which they changed."""

    __slots__ = ("number", "records", "seq", "_changed", "_forgotten", "_gone")

    def __init__(self) -> None:
        self.number = _book_number()
        self.records: dict[Key, R] = {}
        # The seq that changes made now belong to; advance() moves it on.
        self.seq = 0
        # Per key, the seq of its last change (a put or a removal), oldest change first.
        self._changed: dict[Key, int] = {}
        self._gone = 0
        # Changes up to this seq may have been forgotten: none can be told from before it.
        self._forgotten = 0

    def advance(self) -> int:
        """A new seq: changes from now on belong to it."""
        self.seq += 1
        return self.seq

    def put(self, key: Key, record: R) -> bool:
        """Store `record` under `key`; False (and nothing noted) when it equals the one there."""
        records = self.records
        old = records.get(key)
        if old is not None and (old is record or old == record):
            return False
        records[key] = record
        changed = self._changed
        changed.pop(key, None)
        changed[key] = self.seq
        return True

    def remove(self, key: Key) -> bool:
        if self.records.pop(key, None) is None:
            return False
        changed = self._changed
        changed.pop(key, None)
        changed[key] = self.seq
        self._gone += 1
        if self._gone > _GONE_KEPT and self._gone > len(self.records):
            # Forget the gone keys (one pass, once per as many removals as there are records).
            records = self.records
            self._changed = {k: seq for k, seq in changed.items() if k in records}
            self._gone = 0
            self._forgotten = self.seq
        return True

    def changes_since(self, since: int) -> Changes[R] | None:
        """What changed after seq `since` (up to now), or None when that cannot be told."""
        if since < self._forgotten or since > self.seq:
            return None
        records = self.records
        changed: list[tuple[Key, R]] = []
        gone: list[Key] = []
        for key, seq in reversed(self._changed.items()):
            if seq <= since:
                break
            record = records.get(key)
            if record is None:
                gone.append(key)
            else:
                changed.append((key, record))
        changed.reverse()
        return Changes(self.number, since, tuple(changed), tuple(gone))


class Follower(Generic[R]):
    """A consumer's copy of a book's records, kept current from each look's changes."""

    __slots__ = ("book", "records", "seq")

    def __init__(self) -> None:
        self.records: dict[Key, R] = {}
        self.book = 0
        self.seq = -1

    def follow(
        self, book: int, seq: int, changes: Changes[R] | None, whole: Iterable[tuple[Key, R]]
    ) -> list[tuple[Key, R | None, R | None]]:
        """Take the book's state at `seq`; returns (key, before, after) for each record that changed.

        `before` is None for a new key and `after` None for one gone. From
        `changes` when they start where this copy stands; else from `whole`,
        every (key, record) of the book at `seq`, compared by identity.
        """
        records = self.records
        out: list[tuple[Key, R | None, R | None]] = []
        if changes is not None and changes.book == self.book and changes.since == self.seq:
            for key, record in changes.changed:
                old = records.get(key)
                if old is not record:
                    records[key] = record
                    out.append((key, old, record))
            for key in changes.gone:
                old = records.pop(key, None)
                if old is not None:
                    out.append((key, old, None))
        else:
            fresh = dict(whole)
            out = [(key, old, None) for key, old in records.items() if key not in fresh]
            for key, record in fresh.items():
                old = records.get(key)
                if old is not record:
                    out.append((key, old, record))
            self.records = fresh
        self.book = book
        self.seq = seq
        return out
