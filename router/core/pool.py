"""The live replica set: acquire()/release(), last-used stamps, draining, ejection.

Everything that the data path touches per request happens in `acquire()` and
`release()`, which are synchronous: on one event loop a function without an
`await` is a critical section, so choosing the replica, counting it in flight
and stamping its last use cannot interleave with another request or with the
usage tick. Everything else (views, snapshots, pushes) reads from here and
runs per tick or per admin call, never per request.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from router.core.config import ReplicaConfig
from router.core.origin import Origin
from router.core.picking import POLICIES, Policy, PolicySettings, Routing

Clock = Callable[[], float]
log = logging.getLogger("router.core.pool")

# Demand for model names that nobody serves comes from clients and is unbounded;
# past this many distinct names the rest are tallied under one label value.
MAX_UNSERVED_NAMES = 100
# ... and so is each name's size: a name is kept (a label, a tally, a row of
# `ctl status`) only when it could name a model: printable and at most this
# many bytes. Hugging Face repo ids stop at 96 characters; a local path may
# run longer, and 256 bytes covers both. Entries times bytes bounds the tally.
MAX_NAME_BYTES = 256
_STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
OTHER_MODELS = "__other__"


def keepable_name(name: str) -> bool:
    """Whether a name a client sent may be kept and shown: printable, at most MAX_NAME_BYTES in UTF-8."""
    # isprintable() first: it refuses lone surrogates, which cannot be encoded.
    return len(name) <= MAX_NAME_BYTES and name.isprintable() and len(name.encode()) <= MAX_NAME_BYTES


class ReplicaState(enum.Enum):
    READY = "ready"
    EJECTED = "ejected"
    DRAINING = "draining"
    DRAINED = "drained"


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    consecutive_failures: int = 5
    base_seconds: float = 10.0
    max_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class Limits:
    """Concurrency limits; 0 = none. Beyond them requests wait in a bounded queue."""

    per_replica: int = 0
    total: int = 0


class Replica:
    """One replica as the data path sees it. Mutated only by the Pool."""

    __slots__ = (
        "config",
        "id",
        "model",
        "base_url",
        "origin",
        "in_flight",
        "requests",
        "last_used",
        "added_at",
        "draining",
        "removed",
        "ejected_until",
        "failures_in_row",
        "ejections_in_row",
        "ejections",
        "recoveries",
        "responses",
        "errors",
    )

    def __init__(self, config: ReplicaConfig, added_at: float) -> None:
        self.config = config
        self.id = config.id
        self.model = config.model
        self.base_url = config.url
        self.origin = Origin.parse(config.url)
        self.in_flight = 0
        self.requests = 0
        # Monotonic time of the last request sent here; None until the first one.
        self.last_used: float | None = None
        self.added_at = added_at
        self.draining = False
        # Gone from the desired set; forgotten once nothing is in flight.
        self.removed = False
        self.ejected_until: float | None = None
        self.failures_in_row = 0
        self.ejections_in_row = 0
        self.ejections = 0
        self.recoveries = 0
        # Upstream answers by status class ("2xx", ...) and failures by reason.
        self.responses: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    @property
    def state(self) -> ReplicaState:
        if self.draining or self.removed:
            return ReplicaState.DRAINING if self.in_flight else ReplicaState.DRAINED
        if self.ejected_until is not None:
            return ReplicaState.EJECTED
        return ReplicaState.READY

    def __repr__(self) -> str:
        return f"Replica({self.id!r}, model={self.model!r}, in_flight={self.in_flight})"


@dataclass(frozen=True, slots=True)
class SetDiff:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    unchanged: tuple[str, ...]


class Tallies:
    """Per-model figures of the data path that belong to no replica."""

    __slots__ = (
        "affinity",
        "fallbacks",
        "hold_outcomes",
        "last_asked",
        "overloaded",
        "retries",
        "stalled",
        "unserved",
    )

    def __init__(self) -> None:
        # First picks of the session and prefix policies per model: [hit, spill, none]
        # (picking.AFFINITY_OUTCOMES), counted by the model's policy itself.
        self.affinity: dict[str, list[int]] = {}
        # Held requests' ends, by (model, outcome): served, timeout, overflow, client_gone, shutdown.
        self.hold_outcomes: dict[tuple[str, str], int] = {}
        # Monotonic time a request for the model last found nothing to serve it (held, or refused).
        self.last_asked: dict[str, float] = {}
        self.overloaded: dict[str, int] = {}
        self.stalled: dict[str, int] = {}
        self.retries: dict[str, int] = {}
        self.fallbacks: dict[tuple[str, str], int] = {}
        self.unserved: dict[str, int] = {}

    def retried(self, model: str) -> None:
        self.retries[model] = self.retries.get(model, 0) + 1

    def refused_overloaded(self, model: str) -> None:
        self.overloaded[model] = self.overloaded.get(model, 0) + 1

    def client_stalled(self, model: str) -> None:
        self.stalled[model] = self.stalled.get(model, 0) + 1

    def fell_back(self, model: str, to: str) -> None:
        key = (model, to)
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1

    def hold_ended(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.hold_outcomes[key] = self.hold_outcomes.get(key, 0) + 1

    def unserved_request(self, model: str) -> None:
        if model not in self.unserved and (len(self.unserved) >= MAX_UNSERVED_NAMES or not keepable_name(model)):
            model = OTHER_MODELS
        self.unserved[model] = self.unserved.get(model, 0) + 1


_NO_ROUTING: Mapping[str, Routing] = {}
_LEAST_LOADED = Routing()


def _replica_name(replica: Replica) -> str:
    return replica.id


class _Waiter:
    """A request waiting for a replica of `model`: handed one (or None: none can take it) by the pool.

    A held waiter (`hold`) waits for its model to come up: it is never handed
    None, only a replica, or the end (deadline, shutdown).
    """

    __slots__ = ("avoid", "deadline", "exclude", "future", "hold", "key", "model", "seq", "since")

    def __init__(
        self,
        future: asyncio.Future[Replica | None],
        model: str,
        avoid: Replica | None,
        exclude: Container[Replica],
        seq: int,
        hold: bool = False,
        since: float = 0.0,
        deadline: float = 0.0,
        key: Hashable | None = None,
    ) -> None:
        self.future = future
        self.model = model
        self.avoid = avoid
        self.exclude = exclude
        self.seq = seq
        self.hold = hold
        # Monotonic time it began waiting (the oldest held request's age).
        self.since = since
        # A held request's deadline, in loop time.
        self.deadline = deadline
        # The request's affinity key (session, prefix): it keeps it while it waits.
        self.key = key


@dataclass(frozen=True, slots=True)
class HoldTicket:
    """A held request's place in its model's queue, and since when it waits."""

    seq: int
    since: float
    # Loop time by which a replica must have been handed over, or the request gets 503.
    deadline: float


class HoldEnded(Exception):
    """A held request's wait ended without a replica: the router is shutting down."""


# While a model is cold, one held request at a time is tried on its replicas,
# this long after the last try failed, doubling up to the cap: an engine that
# starts to answer is found within the cap, and is not flooded while it loads.
PROBE_FIRST_SECONDS = 0.05
PROBE_CAP_SECONDS = 0.2


class _Cold:
    """A model whose replicas do not answer yet (none, or all refusing): its held requests probe one at a time."""

    __slots__ = ("backoff", "probing", "timer")

    def __init__(self) -> None:
        self.backoff = PROBE_FIRST_SECONDS
        self.probing = False
        # The next probe.
        self.timer: asyncio.TimerHandle | None = None


class Pool:
    def __init__(
        self,
        replicas: Iterable[ReplicaConfig] = (),
        *,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        ejection: EjectionPolicy = EjectionPolicy(),
        limits: Limits = Limits(),
        routing: Mapping[str, Routing] = _NO_ROUTING,
    ) -> None:
        """`routing`: the picking policy per model; least-loaded otherwise."""
        self._clock = clock
        self._routing = routing
        self._rng = rng or random.Random()
        self.ejection = ejection
        self._by_id: dict[str, Replica] = {}
        # Removed from the desired set but still finishing requests.
        self._leaving: set[Replica] = set()
        self._models: dict[str, list[Replica]] = {}
        self._candidates: dict[str, Policy[Replica]] = {}
        self._ejected: list[Replica] = []
        self._next_readmit = float("inf")
        self.tallies = Tallies()
        self.limits = limits
        self.in_flight = 0
        # Requests waiting for a replica, per model, oldest first. A slot that
        # frees is handed straight to the oldest waiter that can take it (no
        # wake-up to lose, no newcomer to overtake it); a waiter that leaves
        # is removed in O(1).
        self._waiting: dict[str, OrderedDict[_Waiter, None]] = {}
        self._seq = itertools.count()
        # Models whose held requests wait for a replica that answers.
        self._cold: dict[str, _Cold] = {}
        self._holds: dict[str, int] = {}
        # Per model with held requests: the one timer for the oldest one's deadline.
        self._expiries: dict[str, asyncio.TimerHandle] = {}
        # Every model that had a replica since start: known, so never 404.
        self.ever_served: set[str] = set()
        self.set_replicas(replicas)

    # The hot path -----------------------------------------------------------

    def acquire(
        self, model: str, avoid: Replica | None = None, exclude: Container[Replica] = (), key: Hashable | None = None
    ) -> Replica | None:
        """Pick a ready replica of `model` by its policy, count it, stamp it.

        `key` is the request's affinity key (a session, a prompt prefix) for
        the policies that use one; least-loaded ignores it.

        On a retry, `avoid` is the replica that just failed: chosen again only
        when no other can serve (a stale keep-alive connection deserves a
        second try). `exclude` are replicas that this request must not reach
        again (they refused the connection or answered 503).
        """
        if self._ejected and self._clock() >= self._next_readmit:
            self._readmit_expired()
        candidates = self._candidates.get(model)
        if candidates is None:
            return None
        retry = avoid is not None or exclude
        replica = candidates.pick_avoiding(avoid, exclude, key) if retry else candidates.pick(key)
        if replica is None:
            return None
        limits = self.limits
        if limits.per_replica and replica.in_flight >= limits.per_replica:
            return None
        if limits.total and self.in_flight >= limits.total:
            return None
        self.in_flight += 1
        candidates.increment(replica)
        replica.in_flight += 1
        replica.requests += 1
        replica.last_used = self._clock()
        return replica

    def acquire_this(self, replica_id: str) -> Replica | None:
        """acquire() of one given replica (the one that keeps a response): None unless it is ready.

        Counted and stamped as acquire() does; the limits apply as well.
        """
        replica = self._by_id.get(replica_id)
        if replica is None or replica.state is not ReplicaState.READY:
            return None
        limits = self.limits
        if (limits.per_replica and replica.in_flight >= limits.per_replica) or (
            limits.total and self.in_flight >= limits.total
        ):
            return None
        candidates = self._candidates.get(replica.model)
        if candidates is not None:
            candidates.increment(replica)
        self.in_flight += 1
        replica.in_flight += 1
        replica.requests += 1
        replica.last_used = self._clock()
        return replica

    def release(self, replica: Replica) -> None:
        """Always called once per acquire(), in a `finally`."""
        replica.in_flight -= 1
        self.in_flight -= 1
        candidates = self._candidates.get(replica.model)
        if candidates is not None and replica in candidates:
            candidates.decrement(replica)
        elif replica.removed and replica.in_flight == 0:
            self._leaving.discard(replica)
        if self._waiting:
            self._hand_off(replica.model)
            if self.limits.total:
                # A slot under the router-wide limit frees for every model.
                for model in sorted(self._waiting, key=self._oldest_seq):
                    self._hand_off(model)

    async def acquire_or_wait(
        self,
        model: str,
        avoid: Replica | None = None,
        exclude: Container[Replica] = (),
        *,
        deadline: float,
        key: Hashable | None = None,
    ) -> tuple[Replica | None, bool]:
        """acquire(), or wait until `deadline` (loop time) in `model`'s FIFO queue while it is saturated.

        Returns (replica, timed_out): a replica; or None and False when no
        replica can take the request (none ready, or all excluded); or None
        and True when every candidate stayed at its limit until the deadline.
        """
        replica = self.acquire(model, avoid, exclude, key)
        if replica is not None or not self.saturated(model):
            return replica, False
        waiter = _Waiter(asyncio.get_running_loop().create_future(), model, avoid, exclude, next(self._seq), key=key)
        return await self._wait(waiter, deadline)

    async def hold(
        self, model: str, *, deadline: float, ticket: HoldTicket | None = None
    ) -> tuple[Replica | None, HoldTicket]:
        """Wait until `deadline` for a replica of `model` that may answer: the model is cold.

        One held request at a time is handed a replica while the model is
        cold (a probe: the caller tries it, then says warm() or still_cold());
        once warm, every held request in turn, under the limits. Returns
        (replica, ticket), or (None, ticket) at the deadline; raises HoldEnded
        when the router shuts down. A probe that failed passes its ticket
        back to keep its place at the head of the queue and its age.
        """
        cold = self._cold.get(model)
        if cold is None:
            cold = self._cold[model] = _Cold()
        again = ticket is not None
        if ticket is None:
            ticket = HoldTicket(next(self._seq), self._clock(), deadline)
        future: asyncio.Future[Replica | None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future, model, None, (), ticket.seq, hold=True, since=ticket.since, deadline=ticket.deadline)
        queue = self._waiting.get(model)
        if queue is None:
            queue = self._waiting[model] = OrderedDict()
        queue[waiter] = None
        if again:
            # A probe that failed goes back to where it was: first, and first due.
            queue.move_to_end(waiter, last=False)
            expiry = self._expiries.get(model)
            if expiry is not None and expiry.when() > ticket.deadline:
                expiry.cancel()
                del self._expiries[model]
        self._holds[model] = self._holds.get(model, 0) + 1
        # No timer per held request: a model's held requests share one, for
        # the oldest one's deadline (they are held in arrival order, for the
        # same cold_start_seconds, so the oldest is always the first due).
        self._expire_soon(model)
        self._hand_off(model)
        try:
            return await future, ticket
        except asyncio.CancelledError:
            # The client left; a replica handed over meanwhile goes to the next.
            if future.done() and not future.cancelled() and (handed := future.result()) is not None:
                self.probe_over(model)
                self.release(handed)
            raise
        finally:
            queue.pop(waiter, None)
            if not queue and self._waiting.get(model) is queue:
                del self._waiting[model]
            self._holds[model] -= 1
            if not self._holds[model]:
                del self._holds[model]

    def _expire_soon(self, model: str) -> None:
        if model in self._expiries:
            return
        queue = self._waiting.get(model)
        first = next((w for w in queue if w.hold), None) if queue else None
        if first is not None:
            self._expiries[model] = asyncio.get_running_loop().call_at(first.deadline, self._expire, model)

    def _expire(self, model: str) -> None:
        """Held requests whose deadline passed get None: the caller answers 503 model_cold."""
        self._expiries.pop(model, None)
        queue = self._waiting.get(model)
        now = asyncio.get_running_loop().time()
        if queue:
            for waiter in list(queue):
                if not waiter.hold:
                    continue
                if waiter.deadline > now:
                    break
                if not waiter.future.done():
                    waiter.future.set_result(None)
        self._expire_soon(model)

    async def _wait(self, waiter: _Waiter, deadline: float) -> tuple[Replica | None, bool]:
        model = waiter.model
        future = waiter.future
        queue = self._waiting.get(model)
        if queue is None:
            queue = self._waiting[model] = OrderedDict()
        queue[waiter] = None
        try:
            async with asyncio.timeout_at(deadline):
                return await future, False
        except TimeoutError:
            if future.done() and not future.cancelled():
                # Handed a replica in the same turn as the deadline: it is ours.
                return future.result(), False
            return None, True
        except asyncio.CancelledError:
            # The client left; a replica handed over meanwhile goes to the next.
            if future.done() and not future.cancelled() and (handed := future.result()) is not None:
                self.release(handed)
            raise
        finally:
            queue.pop(waiter, None)
            if not queue and self._waiting.get(model) is queue:
                del self._waiting[model]

    def warm(self, model: str) -> None:
        """A replica of `model` answered: its held requests go, oldest first, under the limits."""
        cold = self._cold.pop(model, None)
        if cold is None:
            return
        if cold.timer is not None:
            cold.timer.cancel()
        self._hand_off(model)

    def still_cold(self, model: str) -> None:
        """The probe was refused (connection refused, 503 while loading): the next one after a pause."""
        cold = self._cold.get(model)
        if cold is None:
            cold = self._cold[model] = _Cold()
        cold.probing = False
        self._probe_soon(model, cold, cold.backoff)
        cold.backoff = min(cold.backoff * 2, PROBE_CAP_SECONDS)

    def probe_over(self, model: str) -> None:
        """The probe ended without a verdict (its client left, it timed out): another may go."""
        cold = self._cold.get(model)
        if cold is not None and cold.probing:
            cold.probing = False
            self._probe_soon(model, cold, cold.backoff)

    def end_holds(self) -> int:
        """Shutting down: every held request's wait ends now. How many there were."""
        ended = 0
        for queue in list(self._waiting.values()):
            for waiter in list(queue):
                if waiter.hold and not waiter.future.done():
                    waiter.future.set_exception(HoldEnded("the router is shutting down"))
                    ended += 1
        for cold in self._cold.values():
            if cold.timer is not None:
                cold.timer.cancel()
                cold.timer = None
        for expiry in self._expiries.values():
            expiry.cancel()
        self._expiries.clear()
        return ended

    def held(self, model: str) -> int:
        """Requests held for `model` now, waiting (a probe trying a replica is not counted meanwhile)."""
        return self._holds.get(model, 0)

    def oldest_held(self, model: str) -> float | None:
        """Monotonic time the oldest request still held for `model` began waiting."""
        queue = self._waiting.get(model)
        if not queue:
            return None
        return min((w.since for w in queue if w.hold), default=None)

    def held_models(self) -> list[str]:
        return list(self._holds)

    def asked(self, model: str) -> None:
        """A request for `model` found nothing to serve it now: demand the control plane should see."""
        last_asked = self.tallies.last_asked
        if model in last_asked or len(last_asked) < MAX_UNSERVED_NAMES:
            last_asked[model] = self._clock()

    def _probe_soon(self, model: str, cold: _Cold, delay: float) -> None:
        if cold.probing or cold.timer is not None:
            return
        cold.timer = asyncio.get_running_loop().call_later(delay, self._probe, model)

    def _probe(self, model: str) -> None:
        """Hand one replica of a cold model to its oldest held request, to try."""
        cold = self._cold.get(model)
        if cold is None:
            return
        cold.timer = None
        queue = self._waiting.get(model)
        while queue:
            waiter = next(iter(queue))
            if waiter.future.done():
                queue.popitem(last=False)
                continue
            # Every replica may be tried again: a refusal was the engine loading.
            replica = self.acquire(model)
            if replica is None:
                # None ready, or all at a limit: an arrival or a release calls again.
                return
            queue.popitem(last=False)
            cold.probing = True
            waiter.future.set_result(replica)
            return

    def waiting(self, model: str) -> int:
        """Requests waiting for a replica of `model` now."""
        queue = self._waiting.get(model)
        return len(queue) if queue else 0

    def _oldest_seq(self, model: str) -> int:
        queue = self._waiting[model]
        return next(iter(queue)).seq if queue else -1

    def _hand_off(self, model: str) -> None:
        """Give what `model` can serve now to its waiters, oldest first."""
        queue = self._waiting.get(model)
        if not queue:
            return
        cold = self._cold.get(model)
        if cold is not None:
            # A cold model's waiters go one probe at a time, never all at once.
            self._probe_soon(model, cold, 0.0)
            return
        while queue:
            waiter = next(iter(queue))
            if waiter.future.done():
                # Gone (client left, deadline): its finally removes it; skip it now.
                queue.popitem(last=False)
                continue
            replica = self.acquire(model, waiter.avoid, waiter.exclude, waiter.key)
            if replica is None and (waiter.hold or self.saturated(model)):
                # Nothing for the head now; those behind it wait their turn.
                return
            queue.popitem(last=False)
            # A replica, or None: nothing left that this waiter may use.
            waiter.future.set_result(replica)

    def saturated(self, model: str) -> bool:
        """True when `model` could serve but every candidate is at a limit."""
        candidates = self._candidates.get(model)
        if candidates is None or not len(candidates):
            return False
        if self.limits.total and self.in_flight >= self.limits.total:
            return True
        lowest = candidates.lowest_load
        return bool(self.limits.per_replica) and lowest is not None and lowest >= self.limits.per_replica

    # Counters ---------------------------------------------------------------

    def count_response(self, replica: Replica, status: int) -> None:
        """A replica's answer, by status class ("2xx", ...)."""
        index = status // 100 - 1
        status_class = _STATUS_CLASSES[index] if 0 <= index < 5 else "other"
        responses = replica.responses
        responses[status_class] = responses.get(status_class, 0) + 1

    def count_failure(self, replica: Replica, reason: str) -> None:
        """A failed attempt on `replica`, by reason ("connect", "reset", "timeout", "status")."""
        errors = replica.errors
        errors[reason] = errors.get(reason, 0) + 1

    # Health -----------------------------------------------------------------

    def record_success(self, replica: Replica) -> None:
        if self._cold and replica.model in self._cold:
            self.warm(replica.model)
        replica.failures_in_row = 0
        if replica.ejected_until is None:
            replica.ejections_in_row = 0

    def record_failure(self, replica: Replica) -> bool:
        """Count a failure that says the replica is unwell; True if it was ejected."""
        replica.failures_in_row += 1
        if replica.failures_in_row < self.ejection.consecutive_failures:
            return False
        return self.try_eject(replica, f"{replica.failures_in_row} failures in a row")

    def try_eject(self, replica: Replica, why: str) -> bool:
        """Eject `replica` unless that would take out more than half of its model."""
        if replica.ejected_until is not None or replica.removed or replica.draining:
            return False
        siblings = self._models.get(replica.model, [])
        ejected = sum(1 for r in siblings if r.ejected_until is not None)
        # Never more than half of a model's replicas, never the last one.
        if ejected + 1 > len(siblings) // 2:
            return False
        seconds = min(self.ejection.base_seconds * 2**replica.ejections_in_row, self.ejection.max_seconds)
        self.eject(replica, seconds)
        log.warning("ejected replica %s (%s) for %gs: %s", replica.id, replica.model, seconds, why)
        return True

    def eject(self, replica: Replica, seconds: float) -> None:
        replica.ejected_until = self._clock() + seconds
        replica.ejections_in_row += 1
        replica.ejections += 1
        replica.failures_in_row = 0
        self._ejected.append(replica)
        self._next_readmit = min(self._next_readmit, replica.ejected_until)
        self._refresh_candidate(replica)

    def readmit(self, replica: Replica, why: str = "ejection time is up") -> None:
        """End an ejection (its time is up, or a health check saw it healthy)."""
        if replica.ejected_until is None:
            return
        replica.ejected_until = None
        replica.recoveries += 1
        log.info("replica %s (%s) back in rotation: %s", replica.id, replica.model, why)
        if replica in self._ejected:
            self._ejected.remove(replica)
        self._next_readmit = min((r.ejected_until or float("inf") for r in self._ejected), default=float("inf"))
        self._refresh_candidate(replica)

    def retry_after(self, models: Iterable[str]) -> int:
        """Seconds after which a request for `models`, refused now, may find a replica (Retry-After).

        The soonest end of an ejection among their replicas; else 1 where they
        have replicas (draining ones, or ones that refused: a moment's trouble);
        else 10: none at all, so one must be started first.
        """
        replicas = [r for model in models for r in self._models.get(model, ())]
        ends = [r.ejected_until for r in replicas if r.ejected_until is not None]
        if ends:
            return max(1, min(60, math.ceil(min(ends) - self._clock())))
        return 1 if replicas else 10

    def _readmit_expired(self) -> None:
        now = self._clock()
        for replica in [r for r in self._ejected if (r.ejected_until or 0.0) <= now]:
            self.readmit(replica)

    # Draining and the desired set -------------------------------------------

    def set_draining(self, replica_id: str, draining: bool) -> Replica | None:
        replica = self._by_id.get(replica_id)
        if replica is None:
            return None
        replica.draining = draining
        self._refresh_candidate(replica)
        return replica

    def set_replicas(self, configs: Iterable[ReplicaConfig]) -> SetDiff:
        """Make `configs` the desired set, atomically (no await in here).

        A replica whose URL or model changed is a removal plus an addition; a
        removed one drains: it takes no new request and is forgotten when its
        last request ends. Labels alone change in place.
        """
        desired = {c.id: c for c in configs}
        added: list[str] = []
        removed: list[str] = []
        changed: list[str] = []
        unchanged: list[str] = []
        for replica_id, replica in list(self._by_id.items()):
            config = desired.get(replica_id)
            if config is None:
                removed.append(replica_id)
                self._remove(replica)
            elif (config.url, config.model) != (replica.base_url, replica.model):
                changed.append(replica_id)
                self._remove(replica)
            elif config != replica.config:
                changed.append(replica_id)
                replica.config = config
            else:
                unchanged.append(replica_id)
        now = self._clock()
        for replica_id, config in desired.items():
            if replica_id in self._by_id:
                continue
            if replica_id not in changed:
                added.append(replica_id)
            replica = Replica(config, added_at=now)
            self.ever_served.add(replica.model)
            self._by_id[replica_id] = replica
            self._models.setdefault(replica.model, []).append(replica)
            self._refresh_candidate(replica)
        return SetDiff(tuple(added), tuple(removed), tuple(changed), tuple(unchanged))

    def _remove(self, replica: Replica) -> None:
        replica.removed = True
        del self._by_id[replica.id]
        siblings = self._models[replica.model]
        siblings.remove(replica)
        if replica in self._ejected:
            self._ejected.remove(replica)
        self._refresh_candidate(replica)
        if not siblings:
            del self._models[replica.model]
            del self._candidates[replica.model]
            if self._waiting:
                self._hand_off(replica.model)
        if replica.in_flight:
            self._leaving.add(replica)

    def _refresh_candidate(self, replica: Replica) -> None:
        candidates = self._candidates.get(replica.model)
        if candidates is None:
            if replica.removed:
                return
            routing = self._routing.get(replica.model, _LEAST_LOADED)
            settings = PolicySettings(
                replica.model,
                routing.balance_factor,
                self.limits.per_replica,
                _replica_name,
                self.tallies.affinity.setdefault(replica.model, [0, 0, 0]),
            )
            candidates = self._candidates[replica.model] = POLICIES[routing.policy](self._rng, settings)
        serving = replica.state is ReplicaState.READY
        if serving and replica not in candidates:
            candidates.add(replica, replica.in_flight)
            if self._waiting:
                # A new, readmitted or undrained replica: the model's waiters first.
                self._hand_off(replica.model)
        elif not serving:
            candidates.discard(replica)
            if self._waiting and not len(candidates):
                # The model's last candidate left: its waiters wait for nothing now.
                self._hand_off(replica.model)

    # Views --------------------------------------------------------------------

    def get(self, replica_id: str) -> Replica | None:
        return self._by_id.get(replica_id)

    def __iter__(self) -> Iterator[Replica]:
        """Every replica the router knows, the leaving ones included."""
        yield from self._by_id.values()
        yield from self._leaving

    def __len__(self) -> int:
        return len(self._by_id)

    def models(self) -> list[str]:
        """Models with at least one replica in the desired set."""
        return list(self._models)

    def serves(self, model: str) -> bool:
        return model in self._models

    def configs(self) -> list[ReplicaConfig]:
        return [r.config for r in self._by_id.values()]
