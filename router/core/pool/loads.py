"""What the engines say of their load, blended with what this router knows now: the pick's view of a replica.

A replica's engine reports (router.control.engines reads it, or vLLM's ORCA
header on an answer) its requests waiting and running and how full its KV
cache is. That reading lags: it is as old as the last read, and this router
has sent and finished requests since. So a reading keeps what this router
had in flight on the replica when it was taken (`sent_then`), and the view
of the replica now is the reading moved by the difference:

    queue now   = waiting + max(0, in flight now - in flight then)
    engine now  = running + waiting + (in flight now - in flight then)

The engine's own counts include requests of other routers and of clients
that reach it directly: a replica loaded by someone else shows its load.
What no reading can say yet, a prompt sent a moment ago that the engine is
still prefilling, this router knows itself: a large prompt is remembered
with when its prefill should be done (at `prefill_tokens_per_second`), and
its tokens not prefilled yet weigh in the pick, `TOKENS_PER_REQUEST` of them
as much as one request.

A reading older than `stale_after` says nothing (None): the replica is then
picked by this router's counts alone, as with no engine metrics, and is
never saturated by a reading no one renews. A replica is saturated when its
queue now or its KV use reaches its model's bounds; when every replica of a
model is, requests wait in the router's queue (router.core.pool.queues), by
class and tenant, until one falls below them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

# A prompt of at least this many tokens (estimated at four bytes each) is remembered while its
# prefill runs: shorter ones are prefilled within a step or two and change no pick.
LARGE_PROMPT_TOKENS = 2048
# How many prompt tokens still to prefill weigh as much as one request in flight.
TOKENS_PER_REQUEST = 1000
# How much a full KV cache adds to a replica's load, in requests (a tie-breaker below the bound).
KV_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class Bounds:
    """When a replica is saturated: its engine's queue (requests waiting) or its KV cache use (0..1)."""

    waiting: float = 10.0
    kv: float = 0.8


class EngineLoad:
    """One reading of a replica's engine load, and what this router had in flight there when it was taken.

    What of blended() depends on the reading alone is worked out once, here
    (`offset`, `queues`), rather than in every pick that reads it: with the
    router's requests in flight now `f`, a replica's load is `f + offset`,
    plus `f - sent_then` when the engine was queueing (`queues`) and `f`
    is above what it had then.
    """

    __slots__ = ("at", "kv", "offset", "queues", "running", "sent_then", "source", "waiting")

    def __init__(  # noqa: PLR0917 (a value object: its fields in order)
        self, waiting: float, running: float | None, kv: float | None, at: float, sent_then: int, source: str
    ) -> None:
        self.waiting = waiting
        # None: this reading did not say (vLLM's ORCA header carries the queue and the KV cache only).
        self.running = running
        self.kv = kv
        # When it was taken (the pool's clock), and this router's requests in flight on the replica then.
        self.at = at
        self.sent_then = sent_then
        # How it was read: "metrics", "loads" (SGLang's /v1/loads) or "orca" (an answer's header).
        self.source = source
        # The engine was queueing: each request sent since waits behind the queue (queue_now()).
        self.queues = waiting > 0
        # blended() less what moves with the requests in flight now: the engine's requests beyond
        # this router's then (never below none), the queue read, and the KV cache's fullness.
        beyond = (running if running is not None else sent_then) + waiting - sent_then
        self.offset = (beyond if beyond > 0 else 0.0) + waiting + (KV_WEIGHT * kv if kv is not None else 0.0)

    def __repr__(self) -> str:
        return f"EngineLoad(waiting={self.waiting}, running={self.running}, kv={self.kv}, source={self.source!r})"


class Prefills:
    """A replica's large prompts still being prefilled, as this router sent them: (done at, tokens)."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[float, float, int]] = []

    def add(self, now: float, tokens: int, rate: float) -> None:
        self.entries.append((now, now + tokens / rate, tokens))

    def left(self, now: float) -> float:
        """Tokens of them not prefilled yet, by now; those done are forgotten."""
        entries = self.entries
        if entries and entries[0][1] <= now:
            self.entries = entries = [e for e in entries if e[1] > now]
        total = 0.0
        for began, done, tokens in entries:
            total += tokens * (done - now) / (done - began)
        return total


def queue_now(load: EngineLoad, in_flight: int) -> float:
    """The engine's queue as it likely is now: as read, and what this router sent since (never less)
    when the engine was queueing already. An engine with room in its batch takes what comes into it
    (continuous batching) until its batch or its KV cache is full, which its next reading says:
    counting each request sent since as queued would call a replica saturated that is running them,
    and send a prefix's requests away from the replica whose cache holds it."""
    if load.waiting <= 0:
        return load.waiting
    sent = in_flight - load.sent_then
    return load.waiting + sent if sent > 0 else load.waiting


def pressure(load: EngineLoad, in_flight: int, bounds: Bounds) -> float:
    """How near its bounds the replica is: 1 or more is saturated (the endpoint picker's roofline)."""
    queue = queue_now(load, in_flight) / bounds.waiting
    # A full KV cache with nothing waiting is an engine at work, not one that turns requests away
    # (vLLM runs with its cache near full by design, its prefix cache filling the rest): only when
    # requests wait does it mean that the cache is why.
    kv = load.kv / bounds.kv if load.kv is not None and load.waiting > 0 else 0.0
    return queue if queue > kv else kv


def blended(load: EngineLoad | None, in_flight: int, prefilling: float) -> float:
    """A replica's load for the pick, lowest first: requests at the engine now (this router's and
    everyone's), the queue counted twice, the KV cache's fullness, and the prompts still prefilling."""
    score = in_flight + prefilling / TOKENS_PER_REQUEST
    if load is None:
        return score
    moved = in_flight - load.sent_then
    engine = (load.running if load.running is not None else load.sent_then) + load.waiting + moved
    queue = queue_now(load, in_flight)
    kv = load.kv if load.kv is not None else 0.0
    return (engine if engine > in_flight else in_flight) + queue + KV_WEIGHT * kv + prefilling / TOKENS_PER_REQUEST


class Engined(Protocol):
    """A replica as the view reads it (router.core.pool.replicas.Replica)."""

    model: str
    in_flight: int
    load: EngineLoad | None
    prefills: Prefills | None


E = TypeVar("E", bound=Engined)


class EngineView:
    """The pool's view of its replicas' engines: their readings, their freshness, and who is saturated.

    `judge(replica)` is the pick's score of a replica (lower first), math.inf
    when saturated; `saturated(replica)` says whether a fresh reading puts it
    at its model's bounds.
    """

    __slots__ = ("_bounds", "_default", "_now", "fresh_for", "prefill_rate", "stale_after")

    def __init__(
        self,
        now: Callable[[], float],
        *,
        stale_after: float,
        bounds: Mapping[str, Bounds] | None = None,
        default: Bounds = Bounds(),
        prefill_rate: float = 10_000.0,
        fresh_for: float = 0.5,
    ) -> None:
        self._now = now
        # A reading younger than this needs no other (the engines' reader's interval).
        self.fresh_for = fresh_for
        # A reading older than this says nothing.
        self.stale_after = stale_after
        self._bounds = dict(bounds or {})
        self._default = default
        # Prompt tokens an engine prefills a second, for the large prompts this router sent (Prefills).
        self.prefill_rate = prefill_rate

    def bounds(self, model: str) -> Bounds:
        return self._bounds.get(model, self._default)

    def fresh(self, replica: Engined) -> EngineLoad | None:
        """The replica's reading, if it is fresh enough to say anything."""
        load = replica.load
        if load is None or self._now() - load.at > self.stale_after:
            return None
        return load

    def saturated(self, replica: Engined) -> bool:
        load = self.fresh(replica)
        return load is not None and pressure(load, replica.in_flight, self.bounds(replica.model)) >= 1.0

    def judge(self, replica: Engined) -> float:
        """The pick's score of a replica, lowest first: blended(), or math.inf where pressure() >= 1."""
        return self._score(replica, self._now())

    def least(self, items: Iterable[E], avoid: E | None, exclude: Container[E], rng: random.Random) -> E | None:
        """The item judge() scores lowest (a random one among equals), never one of `exclude`, `avoid`
        only if nothing else is left; None when every one is saturated. One pass, the clock read once,
        and _score() written out in it: this runs over every candidate of every pick."""
        now = self._now()
        oldest = now - self.stale_after
        best: E | None = None
        ties: list[E] | None = None
        lowest = math.inf
        for item in items:
            if item is avoid or item in exclude:
                continue
            load = item.load
            if load is None or load.at < oldest:
                figure = float(item.in_flight)
            elif load.queues:
                figure = self._queued(item, load)
                if figure == math.inf:
                    continue
            else:
                figure = item.in_flight + load.offset
            prefills = item.prefills
            if prefills is not None:
                figure += prefills.left(now) / TOKENS_PER_REQUEST
            if figure < lowest:
                lowest = figure
                best = item
                ties = None
            elif figure == lowest:
                if ties is None:
                    ties = [best, item]  # type: ignore[list-item]
                else:
                    ties.append(item)
        if best is None:
            if avoid is not None and avoid not in exclude and self._score(avoid, now) != math.inf:
                return avoid
            return None
        return best if ties is None else ties[rng.randrange(len(ties))]

    def _queued(self, replica: Engined, load: EngineLoad) -> float:
        """The score of a replica whose engine was queueing at its (fresh) reading, less its prefills:
        math.inf where its queue now or its KV use reaches its model's bounds."""
        in_flight = replica.in_flight
        bounds = self._bounds.get(replica.model, self._default) if self._bounds else self._default
        sent = in_flight - load.sent_then if in_flight > load.sent_then else 0
        kv = load.kv
        if load.waiting + sent >= bounds.waiting or (kv is not None and kv >= bounds.kv):
            return math.inf
        return in_flight + load.offset + sent

    def _score(self, replica: Engined, now: float) -> float:
        """judge() at `now`: pressure(), queue_now() and blended() in one call, from the reading's own
        offset (tests/core/test_loads.py holds it equal to them)."""
        load = replica.load
        if load is None or now - load.at > self.stale_after:
            figure = float(replica.in_flight)
        elif load.queues:
            figure = self._queued(replica, load)
            if figure == math.inf:
                return figure
        else:
            figure = replica.in_flight + load.offset
        prefills = replica.prefills
        if prefills is not None:
            figure += prefills.left(now) / TOKENS_PER_REQUEST
        return figure

    def holds(self, replica: Engined) -> bool:
        """Whether a fresh reading says the replica's engine takes requests in as they come: nothing
        waiting there (as read, and never counting this router's since), and no large prompt of this
        router's still prefilling. Session routing keeps a session's replica on this (picking.py)."""
        load = replica.load
        now = self._now()
        if load is None or load.queues or now - load.at > self.stale_after:
            return False
        prefills = replica.prefills
        return prefills is None or prefills.left(now) <= 0

    def takes(self, replica: Engined) -> bool:
        """Whether a fresh reading says nothing waits in the replica's engine: its batch takes a request
        in at its next step. A learned prefix stays on its replicas on this (router.core.pool.learned),
        whose caches hold the prompt that a large-prompt estimate would count as prefilling."""
        load = replica.load
        return load is not None and not load.queues and self._now() - load.at <= self.stale_after

    def wants(self, replica: Engined) -> bool:
        """Whether the replica's reading is old enough to be renewed (an answer's ORCA header)."""
        load = replica.load
        return load is None or self._now() - load.at >= self.fresh_for

    def sent(self, replica: Engined, tokens: int) -> None:
        """A request of about `tokens` prompt tokens went to `replica`: a large one is remembered while it prefills."""
        if tokens >= LARGE_PROMPT_TOKENS:
            prefills = replica.prefills
            if prefills is None:
                prefills = replica.prefills = Prefills()
            prefills.add(self._now(), tokens, self.prefill_rate)

    def expires(self, replica: Engined) -> float | None:
        """When the replica's reading stops saying anything (the pool's clock), if it says something now."""
        load = replica.load
        return None if load is None else load.at + self.stale_after
