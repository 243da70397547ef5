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

`BoundedHashRing` (routing = "session" or "prefix"): a request's key goes to
the same replica every time, so that the engine's prefix cache holds its
conversation, but never to one loaded above the bound; see its docstring.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Container, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from router.core.pool import ring
from router.core.pool.policy import Policy
from router.core.pool.ring import POINTS_PER_MEMBER, Layout

# A request's key as a point of the ring (router.core.pool.ring), found here beside the policies that read it.
affinity_key = ring.affinity_key

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Routing:
    """A model's policy as configured: its name in POLICIES, and the bound of the hashing ones."""

    policy: str = "least_loaded"
    balance_factor: float = 1.25
    # The replicas a prefix spreads over (0: the key alone; BoundedHashRing).
    prefix_replicas: int = 0
    # routing = "prefix": "ring" (a prefix's place on the ring) or "learned" (where it was first sent).
    prefix_placement: str = "ring"


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """What the pool tells a model's policy when it makes one."""

    model: str = ""
    # Bounded loads: no candidate above ceil(balance_factor x the mean in flight).
    balance_factor: float = 1.25
    # The pool's limit of requests in flight per replica (0: none): a key's
    # replica at the limit is passed over like one above the bound.
    per_replica: int = 0
    # A candidate's name on the ring: the same on every router, every run.
    name_of: Callable[[Any], str] = str
    # Where first picks are counted: [hit, spill, none] (AFFINITY_OUTCOMES), kept by the
    # pool for the model, so that the counts outlive a policy made anew.
    outcomes: list[int] = field(default_factory=lambda: [0, 0, 0])
    # The engine-aware score of a candidate (router.core.pool.loads.EngineView.judge: lower
    # first, math.inf when its engine is saturated), used once a reading of the model's
    # engines has come (`aware`); None: engine metrics are off, and loads alone decide.
    judge: Callable[[Any], float] | None = None
    # The judge's pick over candidates in one pass (EngineView.least): least-loaded's, once aware.
    least: Callable[[Iterable[Any], Any, Container[Any], random.Random], Any] | None = None
    # Whether a fresh reading says a candidate's engine takes requests in as they come
    # (EngineView.holds: nothing waiting, no large prompt still prefilling).
    holds: Callable[[Any], bool] | None = None
    # routing = "session": once aware, a key stays on its home while its engine holds, whatever
    # the bounded loads say (BoundedHashRing's docstring).
    sticky: bool = False
    # prefix_replicas: how many candidates' worth of the ring a prefix spreads over, from its
    # place: a session's one of them (routing = "session", BoundedHashRing._start), or the
    # least loaded of them for each request (routing = "prefix", BoundedHashRing._nearest_from).
    spread: int = 0
    # routing = "prefix": the key is a prompt prefix's, shared by every client that sends it.
    by_prefix: bool = False
    # Whether a fresh reading says nothing waits in a candidate's engine (EngineView.takes).
    takes: Callable[[Any], bool] | None = None


# What a session or prefix policy's first pick was: the key's own replica, one
# further along the ring (its own was full), or the least loaded (no key).
AFFINITY_OUTCOMES = ("hit", "spill", "none")
_HIT, _SPILL, _NONE = range(3)


class LeastLoaded(Generic[T]):
    """Picks the candidate with the fewest requests in flight (a random one among equals), in O(1).

    Candidates sit in buckets by their load; a pick reads the lowest
    non-empty bucket, and a request's start or end moves its candidate one
    bucket over. The bookkeeping of loads that the hashing policies share.
    """

    __slots__ = ("_buckets", "_judge", "_least", "_slots", "_lowest", "_rng", "_total", "aware", "picks")

    def __init__(self, rng: random.Random | None = None, settings: PolicySettings | None = None) -> None:
        # _buckets[n] holds the candidates with n requests in flight.
        self._buckets: list[list[T]] = [[]]
        # Per candidate, [load, index in its bucket]: one lookup per move,
        # where separate dicts for each took five on every acquire().
        self._slots: dict[T, list[int]] = {}
        self._lowest = 0
        self._rng = rng or random.Random()
        # Requests in flight over all candidates (the bounded loads' average reads it).
        self._total = 0
        self._judge = settings.judge if settings is not None else None
        self._least = settings.least if settings is not None else None
        # A reading of an engine of this model has come: picks are by `_judge` from now on.
        self.aware = False
        # Requests sent to its candidates so far (what tells a busy model from a quiet one).
        self.picks = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, item: object) -> bool:
        return item in self._slots

    def __iter__(self) -> Iterator[T]:
        return iter(self._slots)

    def add(self, item: T, load: int) -> None:
        if item in self._slots:
            raise ValueError(f"{item!r} is already a candidate")
        slot = self._slots[item] = [load, 0]
        self._place(item, slot, load)
        self._total += load
        if load < self._lowest or len(self._slots) == 1:
            self._lowest = load

    def discard(self, item: T) -> None:
        slot = self._slots.pop(item, None)
        if slot is None:
            return
        load = slot[0]
        self._total -= load
        self._unplace(slot)
        if load == self._lowest:
            self._settle_lowest()

    @property
    def lowest_load(self) -> int | None:
        """In flight on the least loaded candidate; None with no candidate."""
        return self._lowest if self._slots else None

    @property
    def total_in_flight(self) -> int:
        return self._total

    def pick(self, key: Hashable | None = None) -> T | None:
        """The least loaded candidate (a random one among equals), or None; the key plays no part.

        Once the model's engines report their load, the least loaded by their
        view (EngineView.judge), over every candidate: None if all are saturated.
        """
        if self.aware and self._least is not None:
            return self._least(self._slots, None, (), self._rng)  # type: ignore[no-any-return]
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
        if self.aware and self._least is not None:
            least: T | None = self._least(self._slots, avoid, exclude, self._rng)
            return least
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
        self._total += 1
        self.picks += 1
        load = slot[0]
        self._unplace(slot)
        self._place(item, slot, load + 1)
        if load == self._lowest and not self._buckets[load]:
            self._lowest = load + 1

    def decrement(self, item: T) -> bool:
        slot = self._slots.get(item)
        if slot is None:
            return False
        load = slot[0]
        if load == 0:
            return True
        self._total -= 1
        self._unplace(slot)
        self._place(item, slot, load - 1)
        self._lowest = min(self._lowest, load - 1)
        return True

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

    def load_of(self, item: T) -> int:
        return self._slots[item][0]

    def hold(self) -> None:
        """Nothing here depends on the whole set: each change is whole as it is made."""

    def settle(self) -> None:
        """As hold()."""


class BoundedLoads(LeastLoaded[T]):
    """LeastLoaded's bookkeeping, and the bound of consistent hashing with bounded loads.

    A candidate takes a key's request only while its requests in flight are below
    ceil(balance_factor x (in flight over all candidates + 1) / candidates), the average
    counting the request being placed, and never at the pool's per-replica limit. What the
    policies that keep a key on its replicas share: the ring (BoundedHashRing) and the
    learned placement (router.core.pool.learned).
    """

    __slots__ = ("_factor", "_outcomes", "_per_replica", "_scale")

    def __init__(self, rng: random.Random | None = None, settings: PolicySettings | None = None) -> None:
        super().__init__(rng, settings)
        settings = settings or PolicySettings()
        self._factor = settings.balance_factor
        self._per_replica = settings.per_replica
        self._outcomes = settings.outcomes
        # balance_factor / the number of candidates: capacity is ceil(_scale x (in flight + 1)).
        self._scale = 0.0

    def add(self, item: T, load: int) -> None:
        super().add(item, load)
        self._scale = self._factor / len(self._slots)

    def discard(self, item: T) -> None:
        if item not in self._slots:
            return
        super().discard(item)
        self._scale = self._factor / len(self._slots) if self._slots else 0.0

    def capacity(self) -> int:
        """In flight a candidate may have and still take a key: it takes one while below this."""
        bound = math.ceil(self._scale * (self._total + 1))
        if self._per_replica and self._per_replica < bound:
            return self._per_replica
        return bound


# Points per candidate on the ring (router.core.pool.ring).
POINTS_PER_CANDIDATE = POINTS_PER_MEMBER


class BoundedHashRing(BoundedLoads[T]):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018).

    Each candidate has POINTS_PER_CANDIDATE points on a ring of 64-bit
    hashes of its name; a key belongs to the candidate of the first point at
    or after it (its home). A candidate may take a key only while its
    requests in flight are below ceil(c x average), the average counting
    the request being placed: (in flight over all candidates + 1) / N. A key
    whose home is full walks on along the ring to the first candidate that
    is not (a spill), so no candidate is ever above the bound, and one
    always has room (the least loaded is below the average). Adding or
    removing a candidate moves only the keys of the ring's arcs it gains or
    loses, about 1/N of them. A request without a key goes to the least
    loaded candidate, as with least_loaded, whose bookkeeping of loads (and
    of the total in flight) this reuses whole.

    Once the model's engines are read (`aware`), a candidate whose engine
    is saturated is passed over as a full one is. Session routing
    (`sticky`) goes further: a session's home is kept, above the bound or
    not, while a fresh reading says its engine takes requests in as they
    come (nothing waiting, no large prompt still prefilling). A session is
    one conversation, a request at a time, spread over the ring by its
    hash: what puts its home above the bound is the other sessions'
    requests of the moment, which such an engine's batch takes in
    (continuous batching), and spilling it there costs the whole
    conversation's prefix cache for no wait saved. Once the engine queues,
    a request there waits, and the bound and the saturation decide, as
    before. A prefix key is not so: many clients share it (a popular
    system prompt), and only the bound keeps its home from taking them all.
    With `spread` (prefix_replicas), a prefix key's requests share the
    first `spread` candidates along the ring from its point, each to the
    least loaded of them (_nearest_from), and spill on from there only when
    all of them are full.
    """

    __slots__ = (
        "_held",
        "_holds",
        "_joining",
        "_layout",
        "_nearest",
        "_name_of",
        "_owners",
        "_points",
        "_salts",
        "_spread",
        "_sticky",
    )

    def __init__(self, rng: random.Random | None = None, settings: PolicySettings | None = None) -> None:
        super().__init__(rng, settings)
        settings = settings or PolicySettings()
        # Session routing's keep-home rule, once aware: only with the engines' readings to go by.
        self._holds = settings.holds
        self._sticky = settings.sticky and settings.holds is not None
        # prefix_replicas, routing = "session": a prefix's sessions spread over this many candidates
        # (_start), each candidate ranked for a session by its name's key (the same on every router).
        self._spread = 0 if settings.by_prefix else settings.spread
        # prefix_replicas, routing = "prefix": each request to the least loaded of its prefix's nearest.
        self._nearest = settings.spread if settings.by_prefix else 0
        self._salts: dict[T, int] = {}
        self._name_of = settings.name_of
        # The ring (router.core.pool.ring): sorted points, and the member of each,
        # read here as the layout last made them. A member that is not a
        # candidate (it rests there, ejected or gone) is passed over.
        self._layout: Layout[T] = Layout(settings.name_of)
        self._points: list[bytes] = []
        self._owners: list[T] = []
        # Between hold() and settle(): the candidates still to put on the ring.
        self._held = False
        self._joining: dict[T, None] = {}

    @property
    def builds(self) -> int:
        """Times the ring was laid out anew: at most once per change, and once per batch of them."""
        return self._layout.builds

    def add(self, item: T, load: int) -> None:
        super().add(item, load)
        if self._spread:
            self._salts[item] = int.from_bytes(affinity_key(self._name_of(item).encode()), "big")
        self._joining[item] = None
        if not self._held:
            self.settle()

    def discard(self, item: T) -> None:
        if item not in self._slots:
            return
        super().discard(item)
        self._salts.pop(item, None)
        # Its points rest on the ring: nothing to lay out, unless resting ones grow too many.
        self._joining.pop(item, None)
        if not self._held:
            self.settle()

    def hold(self) -> None:
        """Changes from here on are laid out together at settle()."""
        self._held = True

    def settle(self) -> None:
        """Lay out the ring once for every change since hold() (or the one just made)."""
        self._held = False
        layout = self._layout
        layout.update(self._slots, self._joining)
        self._joining.clear()
        self._points = layout.points
        self._owners = layout.owners

    def _first_candidates(self, start: int, count: int) -> list[int]:
        """The ring positions of the first `count` distinct candidates at or after `start` (all, if fewer).

        (A member's candidates can only be found by walking the ring: each has many points.)
        """
        owners, slots = self._owners, self._slots
        seen: set[T] = set()
        found: list[int] = []
        index = start
        last = len(owners) - 1
        for _ in range(last + 1):
            if index >= last:
                # END is the first point's too: on from the start.
                index = 0
            owner = owners[index]
            if owner in slots and owner not in seen:
                seen.add(owner)
                found.append(index)
                if len(found) == count:
                    break
            index += 1
        return found

    def _start(self, key: bytes) -> int:
        """Where a key of a prompt prefix and a session (the two keys, 16 bytes) starts on the ring: the
        point of one of the first `spread` candidates from the prefix's point, the one the session
        ranks highest (rendezvous hashing).

        The sessions of one system prompt then meet on a few replicas, whose prefix caches hold it
        for each one's first turn, and a session keeps its one of them while that one stays: a
        candidate joining or leaving the few moves only the sessions it wins or held.
        """
        start = bisect.bisect_left(self._points, key[:8])
        if self._spread < 2 or len(self._slots) < 2:
            return start
        owners, salts = self._owners, self._salts
        session = int.from_bytes(key[8:16], "big")
        best = -1
        chosen = start
        for index in self._first_candidates(start, self._spread):
            rank = ring.mixed(session ^ salts[owners[index]])
            if rank > best:
                best, chosen = rank, index
        return chosen

    def _nearest_from(self, start: int, capacity: int) -> int:
        """The ring position of the least loaded of the `_nearest` candidates from `start` (their
        engines' view once read, else their requests in flight), the nearest among equals; `start`
        itself when none of them has room, so that the spill walks on from there.

        A prefix's requests then share the few replicas whose caches hold it, in proportion to what
        each can take: a popular system prompt is served by all of them, where one home took it
        to the bound and spilled the rest to replicas that had never seen it.
        """
        owners, slots = self._owners, self._slots
        judge = self._judge if self.aware else None
        best = math.inf
        chosen = start
        for index in self._first_candidates(start, self._nearest):
            owner = owners[index]
            load = slots[owner][0]
            if load < capacity:
                score = judge(owner) if judge is not None else float(load)
                if score < best:
                    best, chosen = score, index
        return chosen

    def home(self, key: bytes) -> T | None:
        """The candidate `key` belongs to, whatever the loads."""
        if not self._slots:
            return None
        start = self._start(key) if len(key) > 8 else bisect.bisect_left(self._points, key)
        return self._owners[self._candidate_from(start)]

    def _candidate_from(self, index: int) -> int:
        """The ring position of the first candidate's point at or after `index` (past resting members)."""
        owners, slots = self._owners, self._slots
        last = len(owners) - 1
        for _ in range(last + 1):
            if index >= last:
                # END is the first point's too: on from the start.
                index = 0
            if owners[index] in slots:
                return index
            index += 1
        raise AssertionError("a candidate without points on the ring")

    def pick(self, key: Any = None) -> T | None:
        """The key's home, or the next candidate along the ring with room; least loaded without a key."""
        if key is None or not self._slots:
            if key is None:
                self._outcomes[_NONE] += 1
            return super().pick()
        # (The ring ends with a point above every key, so the search never runs off its end.)
        start = self._start(key) if len(key) > 8 else bisect.bisect_left(self._points, key)
        home = self._owners[start]
        # capacity(), written out: this runs on every request.
        capacity = math.ceil(self._scale * (self._total + 1))
        if self._per_replica and self._per_replica < capacity:
            capacity = self._per_replica
        slot = self._slots.get(home)
        if slot is None:
            # A resting member's point: the key's home is the next candidate along.
            start = self._candidate_from(start)
            home = self._owners[start]
            slot = self._slots[home]
        if self._nearest > 1:
            start = self._nearest_from(start, capacity)
            home = self._owners[start]
            slot = self._slots[home]
        judge = self._judge if self.aware else None
        holds = self._holds if judge is not None and self._sticky else None
        if holds is not None and holds(home):
            # A session: its home while its engine takes requests in as they come (under the per-replica limit).
            kept = not (self._per_replica and slot[0] >= self._per_replica)
        else:
            kept = slot[0] < capacity and (judge is None or judge(home) != math.inf)
        if kept:
            self._outcomes[_HIT] += 1
            return home
        self._outcomes[_SPILL] += 1
        found = self._walk(start, capacity, home, ())
        # Only with a per-replica limit, or every engine saturated, can every candidate be
        # full: the least loaded is the pool's to refuse (it waits, or answers 503).
        return found if found is not None else super().pick()

    def pick_avoiding(self, avoid: T | None, exclude: Container[T], key: Hashable | None = None) -> T | None:
        """A retry's candidate: along the ring from the key's home, never one of `exclude`, `avoid` last."""
        if key is None or not self._points:
            return super().pick_avoiding(avoid, exclude)
        point = cast(bytes, key)
        start = self._start(point) if len(point) > 8 else bisect.bisect_left(self._points, point)
        found = self._walk(start - 1, self.capacity(), avoid, exclude)
        # Every candidate with room is excluded or avoided: least-loaded's rules decide.
        return found if found is not None else super().pick_avoiding(avoid, exclude)

    def _walk(self, before: int, capacity: int, passed: T | None, exclude: Container[T]) -> T | None:
        """The first candidate with room after ring position `before`, other than `passed` and `exclude`."""
        owners = self._owners
        slots = self._slots
        count = len(owners)
        # A candidate whose engine is saturated is passed over as a full one is.
        judge = self._judge if self.aware else None
        seen: set[T | None] = {passed}
        left = len(slots) - (passed in slots)
        if not left:
            return None
        index = before
        for _ in range(count):
            index += 1
            if index == count:
                index = 0
            owner = owners[index]
            if owner in seen:
                continue
            slot = slots.get(owner)
            if slot is None:
                # Resting on the ring, not a candidate.
                seen.add(owner)
                continue
            if slot[0] < capacity and owner not in exclude and (judge is None or judge(owner) != math.inf):
                return owner
            seen.add(owner)
            left -= 1
            if not left:
                break
        return None


# The policies a model's `routing` may name. Each is built with the pool's
# random source, so that a seeded pool picks the same way every run.
POLICIES: dict[str, Callable[[random.Random, PolicySettings], Policy[Any]]] = {
    "least_loaded": LeastLoaded,
    "session": BoundedHashRing,
    "prefix": BoundedHashRing,
}
