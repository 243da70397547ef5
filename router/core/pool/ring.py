"""The hash ring of the session and prefix policies: its points in order, and who owns each.

Each member has POINTS_PER_MEMBER points, the BLAKE2b hashes of
`"{name}#{i}"`: the same on every router and every run. They are hashed
once, when the member joins; the ring is then laid out from the members'
points, never hashed again. A few new members are merged into the ring in
one pass over it, in C; many (the first layout) are sorted once with the
rest. A member that stops being a candidate rests on the ring until resting
points are a quarter of it. Read past its resting members, the ring is the
one sorting every candidate's points would make: by point, and among equal
points (two 64-bit hashes that collide, which no real fleet will see) by the
order in which their members joined.

Laid out once per batch of changes (the policy holds its changes while a
whole replica set is applied): a set of 800 replicas is one sort of 128,000
points, not 800 sorts of a growing ring.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

# Points per member on the ring: enough that each one's share of the keys
# is within a few percent of 1/N (ketama's figure).
POINTS_PER_MEMBER = 160

# The last point, above every key (keys are 8 bytes), owned by the first
# point's member: past the last real point, the ring wraps, and a search
# for a key never runs off the end.
END = b"\xff" * 9

# New and resting points above this share of the ring: every candidate's
# points are sorted anew (resting ones dropped); fewer new ones are merged in
# one pass.
_RELAY_SHARE = 0.25


def affinity_key(data: bytes) -> bytes:
    """A request's key as a point of the ring: the same on every router and every run.

    (Python's own hash() of a string differs from process to process, so
    two routers, or two workers, would send one session to two replicas.)
    Eight bytes of BLAKE2b, compared as bytes: big-endian, so the order is
    the number's.
    """
    return hashlib.blake2b(data, digest_size=8).digest()


def member_points(name: str) -> list[bytes]:
    """A member's points, in order."""
    return sorted(affinity_key(f"{name}#{i}".encode()) for i in range(POINTS_PER_MEMBER))


class Layout(Generic[T]):
    """The ring: `points` in order (END last), `owners[i]` the member of `points[i]`.

    A member that stops being a candidate (ejected, drained, removed) keeps
    its points for a while, resting: the policy reads past them as if they
    were not there, so taking a replica out, or putting it back, costs
    nothing here. Once resting points are more than a quarter of the ring,
    they are dropped in one pass.
    """

    __slots__ = ("builds", "owners", "points", "_hashed", "_name_of")

    def __init__(self, name_of: Callable[[T], str]) -> None:
        self._name_of = name_of
        self.points: list[bytes] = []
        self.owners: list[T] = []
        # Each member's points, hashed when it joined: the candidates', and the resting ones'.
        self._hashed: dict[T, list[bytes]] = {}
        # Times the ring was laid out anew: at most once per change, and once per batch of them.
        self.builds = 0

    def __contains__(self, item: object) -> bool:
        """Whether `item` has points on the ring."""
        return item in self._hashed

    def update(self, candidates: Collection[T], joining: Iterable[T]) -> None:
        """The ring for `candidates` (in the order they joined), of which `joining` are new since the last.

        Every candidate has its points on the ring after this; those of members
        that are no longer candidates may stay, resting.
        """
        hashed = self._hashed
        new = [item for item in joining if item not in hashed]
        for item in new:
            hashed[item] = member_points(self._name_of(item))
        bound = _RELAY_SHARE * len(self.points)
        many_new = POINTS_PER_MEMBER * len(new) > bound
        many_resting = POINTS_PER_MEMBER * (len(hashed) - len(candidates)) > bound
        if not (new or many_resting):
            return
        if many_new or many_resting:
            # Laid out for the candidates alone: the resting ones' points go.
            for item in [item for item in hashed if item not in candidates]:
                del hashed[item]
        if many_new:
            # (The first layout, or a large batch): every candidate's points sorted once.
            self._sort(candidates)
        else:
            if many_resting:
                self._compact(candidates)
            if new:
                self._merge(new)
        self.builds += 1

    def _sort(self, candidates: Iterable[T]) -> None:
        hashed = self._hashed
        flat: list[bytes] = []
        flat_owners: list[T] = []
        for item in candidates:
            points = hashed[item]
            flat += points
            flat_owners += [item] * len(points)
        # A stable sort of positions by point: equal points keep the members' order.
        order = sorted(range(len(flat)), key=flat.__getitem__)
        self._finish([flat[i] for i in order], [flat_owners[i] for i in order])

    def _compact(self, candidates: Collection[T]) -> None:
        """Drop the resting members' points, in one pass in C."""
        end = max(0, len(self.points) - 1)
        keep = list(map(candidates.__contains__, itertools.islice(self.owners, end)))
        self._finish(list(itertools.compress(self.points, keep)), list(itertools.compress(self.owners, keep)))

    def _merge(self, joining: Sequence[T]) -> None:
        """One pass over the ring: runs of it copied whole, the new points between them."""
        points, owners = self.points, self.owners
        # The old ring without its END (the lists themselves: no copy).
        end = max(0, len(points) - 1)
        # (position in the old ring to put the point before, point, order, member)
        inserts: list[tuple[int, bytes, int, T]] = []
        order = 0
        for item in joining:
            for point in self._hashed[item]:
                # After equal points already there: those members joined first.
                inserts.append((bisect.bisect_right(points, point, 0, end), point, order, item))
                order += 1
        inserts.sort(key=_insert_order)
        new_points: list[bytes] = []
        new_owners: list[T] = []
        copied = 0
        for at, point, _, item in inserts:
            if at > copied:
                new_points += points[copied:at]
                new_owners += owners[copied:at]
                copied = at
            new_points.append(point)
            new_owners.append(item)
        new_points += points[copied:end]
        new_owners += owners[copied:end]
        self._finish(new_points, new_owners)

    def _finish(self, points: list[bytes], owners: list[T]) -> None:
        if points:
            points.append(END)
            owners.append(owners[0])
        self.points = points
        self.owners = owners


def _insert_order(insert: tuple[int, bytes, int, object]) -> tuple[int, bytes, int]:
    # Never the member: members need not be orderable.
    return insert[0], insert[1], insert[2]


_WORD = (1 << 64) - 1


def mixed(value: int) -> int:
    """A 64-bit number's bits mixed (splitmix64's finaliser): a session's rank of a candidate."""
    value = (value + 0x9E3779B97F4A7C15) & _WORD
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _WORD
    return value ^ (value >> 31)
