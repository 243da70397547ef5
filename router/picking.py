"""Pure choice among candidates: the picking policies, one per model.

A policy sees one model's candidates with their load (requests in flight)
and, where the request has one, a key (a session, a prefix); the pool tells
it who is a candidate and every change of load, and asks it to choose. No
clock and no I/O here: the pool decides who is a candidate (ready, under the
limits), a policy only chooses.

`LeastLoaded`, the default: candidates sit in buckets by how many requests
they have in flight, so that finding the least loaded one costs the same
with 4 candidates as with 400: no scan, no heap. A quiet fleet (every
candidate at 0) still spreads, because the pick within the lowest bucket is
random.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Hashable
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T", bound=Hashable)


class Policy(Protocol[T]):
    """How one model's replica is chosen. The pool keeps it told of every candidate and load."""

    def __len__(self) -> int: ...

    def __contains__(self, item: object) -> bool: ...

    def add(self, item: T, load: int) -> None: ...

    def discard(self, item: T) -> None: ...

    def increment(self, item: T) -> None: ...

    def decrement(self, item: T) -> None: ...

    @property
    def lowest_load(self) -> int | None:
        """In flight on the least loaded candidate; None with no candidate."""
        ...

    def pick(self, key: Hashable | None = None) -> T | None:
        """The candidate for a first attempt; `key` is the request's (session, prefix) or None."""
        ...

    def pick_avoiding(self, avoid: T | None, exclude: Container[T], key: Hashable | None = None) -> T | None:
        """A retry's candidate: never one of `exclude`, and `avoid` only if nothing else is left."""
        ...


class LeastLoaded(Generic[T]):
    __slots__ = ("_buckets", "_slots", "_lowest", "_rng")

    def __init__(self, rng: random.Random | None = None) -> None:
        # _buckets[n] holds the candidates with n requests in flight.
        self._buckets: list[list[T]] = [[]]
        # Per candidate, [load, index in its bucket]: one lookup per move,
        # where separate dicts for each took five on every acquire().
        self._slots: dict[T, list[int]] = {}
        self._lowest = 0
        self._rng = rng or random.Random()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, item: object) -> bool:
        return item in self._slots

    def add(self, item: T, load: int) -> None:
        if item in self._slots:
            raise ValueError(f"{item!r} is already a candidate")
        slot = self._slots[item] = [load, 0]
        self._place(item, slot, load)
        if load < self._lowest or len(self._slots) == 1:
            self._lowest = load

    def discard(self, item: T) -> None:
        slot = self._slots.pop(item, None)
        if slot is None:
            return
        load = slot[0]
        self._unplace(slot)
        if load == self._lowest:
            self._settle_lowest()

    @property
    def lowest_load(self) -> int | None:
        """In flight on the least loaded candidate; None with no candidate."""
        return self._lowest if self._slots else None

    def pick(self, key: Hashable | None = None) -> T | None:
        """The least loaded candidate (a random one among equals), or None; the key plays no part."""
        if not self._slots:
            return None
        bucket = self._buckets[self._lowest]
        if len(bucket) == 1:
            return bucket[0]
        return bucket[self._rng.randrange(len(bucket))]

    def pick_avoiding(self, avoid: T | None, exclude: Container[T], key: Hashable | None = None) -> T | None:
        """Like pick(), but never one of `exclude`, and `avoid` only if nothing else is left.

        Used only on retries, so a scan is fine here.
        """
        fallback: T | None = None
        avoid_slot = self._slots.get(avoid) if avoid is not None else None
        for load in range(self._lowest, len(self._buckets)):
            others = [item for item in self._buckets[load] if item is not avoid and item not in exclude]
            if others:
                return others[0] if len(others) == 1 else others[self._rng.randrange(len(others))]
            if fallback is None and avoid_slot is not None and avoid_slot[0] == load and avoid not in exclude:
                fallback = avoid
        return fallback

    def increment(self, item: T) -> None:
        slot = self._slots.get(item)
        if slot is None:
            return
        load = slot[0]
        self._unplace(slot)
        self._place(item, slot, load + 1)
        if load == self._lowest and not self._buckets[load]:
            self._lowest = load + 1

    def decrement(self, item: T) -> None:
        slot = self._slots.get(item)
        if slot is None or slot[0] == 0:
            return
        load = slot[0]
        self._unplace(slot)
        self._place(item, slot, load - 1)
        self._lowest = min(self._lowest, load - 1)

    def _place(self, item: T, slot: list[int], load: int) -> None:
        buckets = self._buckets
        while len(buckets) <= load:
            buckets.append([])
        bucket = buckets[load]
        slot[0] = load
        slot[1] = len(bucket)
        bucket.append(item)

    def _unplace(self, slot: list[int]) -> None:
        # Swap with the last so that removal is O(1) and indexes stay valid.
        bucket = self._buckets[slot[0]]
        index = slot[1]
        last = bucket.pop()
        if index < len(bucket):
            bucket[index] = last
            self._slots[last][1] = index

    def _settle_lowest(self) -> None:
        if not self._slots:
            self._lowest = 0
            return
        load = self._lowest
        while not self._buckets[load]:
            load += 1
        self._lowest = load


# The policies a model's `routing` may name. Each is built with the pool's
# random source, so that a seeded pool picks the same way every run.
POLICIES: dict[str, Callable[[random.Random], Policy[Any]]] = {"least_loaded": LeastLoaded}
DEFAULT_POLICY = "least_loaded"
