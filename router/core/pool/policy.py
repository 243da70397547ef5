"""What the pool asks of a model's picking policy (router.core.pool.picking, router.core.pool.learned)."""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T", bound=Hashable)


class Policy(Protocol[T]):
    """How one model's replica is chosen. The pool keeps it told of every candidate and load."""

    def __len__(self) -> int: ...

    # A reading of one of the model's engines has come: picks weigh the engines' loads.
    aware: bool

    def __contains__(self, item: object) -> bool: ...

    def __iter__(self) -> Iterator[T]: ...

    def add(self, item: T, load: int) -> None: ...

    def discard(self, item: T) -> None: ...

    def increment(self, item: T) -> None: ...

    def decrement(self, item: T) -> bool:
        """One request less on `item`; False when it is not a candidate (nothing counted)."""
        ...

    @property
    def lowest_load(self) -> int | None:
        """In flight on the least loaded candidate; None with no candidate."""
        ...

    @property
    def total_in_flight(self) -> int:
        """Requests in flight over every candidate."""
        ...

    # Requests sent to its candidates so far.
    picks: int

    def pick(self, key: Hashable | None = None) -> T | None:
        """The candidate for a first attempt; `key` is the request's (session, prefix) or None."""
        ...

    def pick_avoiding(self, avoid: T | None, exclude: Container[T], key: Hashable | None = None) -> T | None:
        """A retry's candidate: never one of `exclude`, and `avoid` only if nothing else is left."""
        ...

    def hold(self) -> None:
        """A batch of add() and discard() follows: lay out what depends on the whole set once, at settle()."""
        ...

    def settle(self) -> None:
        """The batch is over (no pick() may come between hold() and this)."""
        ...
