"""Pure choice among candidates: least requests in flight, ties at random.

Candidates sit in buckets by how many requests they have in flight, so that
finding the least loaded one costs the same with 4 candidates as with 400: no
scan, no heap. A quiet fleet (every candidate at 0) still spreads, because the
pick within the lowest bucket is random. No clock and no I/O here: the pool
decides who is a candidate, this module only chooses.
"""

from __future__ import annotations

import random
from collections.abc import Container, Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class LeastLoaded(Generic[T]):
    __slots__ = ("_buckets", "_load", "_index", "_lowest", "_rng")

    def __init__(self, rng: random.Random | None = None) -> None:
        # _buckets[n] holds the candidates with n requests in flight.
        self._buckets: list[list[T]] = [[]]
        self._load: dict[T, int] = {}
        self._index: dict[T, int] = {}
        self._lowest = 0
        self._rng = rng or random.Random()

    def __len__(self) -> int:
        return len(self._load)

    def __contains__(self, item: object) -> bool:
        return item in self._load

    def add(self, item: T, load: int) -> None:
        if item in self._load:
            raise ValueError(f"{item!r} is already a candidate")
        self._place(item, load)
        if load < self._lowest or len(self._load) == 1:
            self._lowest = load

    def discard(self, item: T) -> None:
        load = self._load.pop(item, None)
        if load is None:
            return
        self._unplace(item, load)
        if load == self._lowest:
            self._settle_lowest()

    @property
    def lowest_load(self) -> int | None:
        """In flight on the least loaded candidate; None with no candidate."""
        return self._lowest if self._load else None

    def pick(self) -> T | None:
        """The least loaded candidate (a random one among equals), or None."""
        if not self._load:
            return None
        bucket = self._buckets[self._lowest]
        if len(bucket) == 1:
            return bucket[0]
        return bucket[self._rng.randrange(len(bucket))]

    def pick_avoiding(self, avoid: T | None, exclude: Container[T]) -> T | None:
        """Like pick(), but never one of `exclude`, and `avoid` only if nothing else is left.

        Used only on retries, so a scan is fine here.
        """
        fallback: T | None = None
        for load in range(self._lowest, len(self._buckets)):
            others = [item for item in self._buckets[load] if item is not avoid and item not in exclude]
            if others:
                return others[0] if len(others) == 1 else others[self._rng.randrange(len(others))]
            if fallback is None and avoid is not None and self._load.get(avoid) == load and avoid not in exclude:
                fallback = avoid
        return fallback

    def increment(self, item: T) -> None:
        load = self._load.get(item)
        if load is None:
            return
        self._unplace(item, load)
        self._place(item, load + 1)
        if load == self._lowest and not self._buckets[load]:
            self._lowest = load + 1

    def decrement(self, item: T) -> None:
        load = self._load.get(item)
        if load is None or load == 0:
            return
        self._unplace(item, load)
        self._place(item, load - 1)
        self._lowest = min(self._lowest, load - 1)

    def _place(self, item: T, load: int) -> None:
        while len(self._buckets) <= load:
            self._buckets.append([])
        bucket = self._buckets[load]
        self._index[item] = len(bucket)
        bucket.append(item)
        self._load[item] = load

    def _unplace(self, item: T, load: int) -> None:
        # Swap with the last so that removal is O(1) and indexes stay valid.
        bucket = self._buckets[load]
        index = self._index.pop(item)
        last = bucket.pop()
        if last is not item:
            bucket[index] = last
            self._index[last] = index

    def _settle_lowest(self) -> None:
        if not self._load:
            self._lowest = 0
            return
        load = self._lowest
        while not self._buckets[load]:
            load += 1
        self._lowest = load
