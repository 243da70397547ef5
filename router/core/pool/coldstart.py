"""Scale from zero: a held request waits for a replica that answers, one probe at a time while its model is cold.

A request for a model with `cold_start_seconds` that nothing can serve now
is held, in one object for the whole of its wait:

    async with pool.cold_start.begin(model, seconds) as hold:
        while (replica := await hold.replica()) is not None:
            ...try it; hold.answered() or hold.still_loading()...

While the model is cold (no replica, or every one refusing as an engine
does while it loads) one held request at a time is handed a replica to try,
a probe: at once, then after a pause that doubles up to a cap while the
probes are refused, so that an engine that starts to answer is found within
the cap and is not flooded while it loads. Once one answers, every held
request goes in turn, oldest first, under the limits. A model's held
requests share one timer for the oldest one's deadline.

The hold's exit decides how its last try ended, so that no caller can leave
a hold half done; its replica goes back to the pool there, and the hold's
outcome is tallied (served, timeout, client_gone, shutdown).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from types import TracebackType

from router.core.clock import Clock, Timer
from router.core.pool.fairness import Lines
from router.core.pool.replicas import Replica
from router.core.pool.tallies import Tallies
from router.core.pool.waiters import PROBE_CAP_SECONDS, Probing, Waiter, handed


class ShuttingDown(Exception):
    """A held request's wait ended without a replica: the router is shutting down."""


class _Seen(enum.Enum):
    """What the caller saw of a try's replica, which decides how the try ends."""

    ANSWERED = "answered"
    LOADING = "loading"


class ColdStart:
    """The held requests of every model: their cold cold, their count, and the timers of their deadlines.

    The waiters sit in the pool's lines (`lines`), beside those queued at
    the limits and ahead of them; `cold` is read by the pool too.
    """

    __slots__ = (
        "cold",
        "tallies",
        "_acquire",
        "_clock",
        "_expiries",
        "_hand_off",
        "_holds",
        "_lines",
        "_release",
        "_seq",
    )

    def __init__(
        self,
        clock: Clock,
        tallies: Tallies,
        *,
        lines: Lines,
        seq: Callable[[], int],
        acquire: Callable[[str], Replica | None],
        release: Callable[[Replica], None],
        hand_off: Callable[[str], None],
    ) -> None:
        """The pool's: its lines, its arrival numbers, and its acquire(), release() and hand-off to a model's line."""
        self._clock = clock
        self.tallies = tallies
        self._lines = lines
        self._seq = seq
        self._acquire = acquire
        self._release = release
        self._hand_off = hand_off
        # Models whose held requests wait for a replica that answers.
        self.cold: dict[str, Probing] = {}
        # Held requests waiting now, per model.
        self._holds: dict[str, int] = {}
        # Per model with held requests: the one timer for the oldest one's deadline, and that deadline.
        self._expiries: dict[str, tuple[float, Timer]] = {}

    def is_cold(self, model: str) -> bool:
        """Whether `model`'s held requests probe its replicas one at a time now (none answered yet)."""
        return model in self.cold

    def begin(self, model: str, seconds: float) -> Hold:
        """A request for the cold `model`, held up to `seconds` for a replica that answers: `async with` it."""
        now = self._clock.now()
        return Hold(self, model, seq=self._seq(), since=now, deadline=now + seconds)

    def now(self) -> float:
        return self._clock.now()

    async def wait(self, hold: Hold, again: bool) -> tuple[Replica | None, Probing | None]:
        """Wait in the line of `hold`'s model for a replica that may answer, or None at its deadline.

        Returns the replica and the probing it is the probe of (None: handed
        over once the model was warm). `again`: a try that was refused goes
        back where it was, first in line and first due. Raises ShuttingDown when
        the router shuts down.
        """
        model = hold.model
        if model not in self.cold:
            self.cold[model] = Probing()
        future: asyncio.Future[Replica | None] = asyncio.get_running_loop().create_future()
        waiter = Waiter(future, model, None, (), hold.seq, hold=True, since=hold.since, deadline=hold.deadline)
        queue = self._lines.open(model)
        queue.add(waiter, first=again)
        if again:
            expiry = self._expiries.get(model)
            if expiry is not None and expiry[0] > hold.deadline:
                expiry[1].cancel()
                del self._expiries[model]
        # No timer per held request: a model's held requests share one, for
        # the oldest one's deadline (they are held in arrival order, for the
        # same cold_start_seconds, so the oldest is always the first due).
        self._expire_soon(model)
        self._hand_off(model)
        try:
            # A client gone after the hand-off ends the try it was handed: the next may probe.
            return await handed(future, lambda replica: self.end_try(model, replica, waiter.probe, None)), waiter.probe
        finally:
            queue.discard(waiter)
            self._lines.close(model, queue)

    def entered(self, model: str) -> None:
        """A request is held for `model` from now until left(): waiting, or trying a replica."""
        self._holds[model] = self._holds.get(model, 0) + 1

    def left(self, model: str) -> None:
        held = self._holds[model] - 1
        if held:
            self._holds[model] = held
        else:
            del self._holds[model]

    def end_try(self, model: str, replica: Replica, probe: Probing | None, seen: _Seen | None) -> None:
        """A try is over: its replica back to the pool, and the model warm, still cold, or free to probe again."""
        self._release(replica)
        if seen is _Seen.LOADING:
            self.still_cold(model)
        elif probe is not None and self.cold.get(model) is probe:
            # Only the probe of the probing still on decides it: a request handed
            # its replica before the model went cold again ends no one's probe.
            if seen is _Seen.ANSWERED:
                self.warm(model)
            elif probe.under_way:
                probe.under_way = False
                self.probe_soon(model, probe, probe.backoff)

    def warm(self, model: str) -> None:
        """A replica of `model` answered: its held requests go, oldest first, under the limits."""
        probing = self.cold.pop(model, None)
        if probing is None:
            return
        if probing.timer is not None:
            probing.timer.cancel()
        self._hand_off(model)

    def still_cold(self, model: str) -> None:
        """A try was refused (connection refused, 503 while loading): the next probe after a pause."""
        probing = self.cold.get(model)
        if probing is None:
            probing = self.cold[model] = Probing()
        probing.under_way = False
        self.probe_soon(model, probing, probing.backoff)
        probing.backoff = min(probing.backoff * 2, PROBE_CAP_SECONDS)

    def end_holds(self) -> int:
        """Shutting down: every held request's wait ends now. How many there were."""
        ended = 0
        for queue in list(self._lines.values()):
            for waiter in list(queue.held):
                if not waiter.future.done():
                    waiter.future.set_exception(ShuttingDown("the router is shutting down"))
                    ended += 1
        for probing in self.cold.values():
            if probing.timer is not None:
                probing.timer.cancel()
                probing.timer = None
        for _, expiry in self._expiries.values():
            expiry.cancel()
        self._expiries.clear()
        return ended

    def held(self, model: str) -> int:
        """Requests held for `model` now: waiting in its line, or trying one of its replicas.

        A request counts from the moment it is held to the end of its hold,
        tries included, so that `max_held` bounds them at every instant: a
        request that arrives while another probes a loading replica sees it.
        """
        return self._holds.get(model, 0)

    def oldest_held(self, model: str) -> float | None:
        """Monotonic time the oldest request still held for `model` began waiting."""
        queue = self._lines.get(model)
        if not queue:
            return None
        return min((w.since for w in queue.held), default=None)

    def held_models(self) -> list[str]:
        return list(self._holds)

    def probe_soon(self, model: str, probing: Probing, delay: float) -> None:
        """Hand a replica of the cold `model` to its oldest held request after `delay`, unless one is on its way."""
        if probing.under_way or probing.timer is not None:
            return
        probing.timer = self._clock.call_at(self._clock.now() + delay, lambda: self._probe(model))

    def _probe(self, model: str) -> None:
        """Hand one replica of a cold model to its oldest held request, to try."""
        probing = self.cold.get(model)
        if probing is None:
            return
        probing.timer = None
        queue = self._lines.get(model)
        # The oldest held request (a queued one only when none is held).
        waiter = queue.next(self._clock.now) if queue else None
        if queue is None or waiter is None:
            return
        # Every replica may be tried again: a refusal was the engine loading.
        replica = self._acquire(model)
        if replica is None:
            # None ready, or all at a limit: an arrival or a release calls again.
            return
        queue.take(waiter, served=True)
        probing.under_way = True
        waiter.probe = probing
        waiter.future.set_result(replica)

    def _expire_soon(self, model: str) -> None:
        if model in self._expiries:
            return
        queue = self._lines.get(model)
        first = queue.oldest_held() if queue else None
        if first is not None:
            timer = self._clock.call_at(first.deadline, lambda: self._expire(model))
            self._expiries[model] = (first.deadline, timer)

    def _expire(self, model: str) -> None:
        """Held requests whose deadline passed get None: the caller answers 503 model_cold."""
        self._expiries.pop(model, None)
        queue = self._lines.get(model)
        now = self._clock.now()
        if queue:
            for waiter in list(queue.held):
                if waiter.deadline > now:
                    break
                if not waiter.future.done():
                    waiter.future.set_result(None)
        self._expire_soon(model)


class Hold:
    """One held request, from the moment it is held to its end: `async with pool.cold_start.begin(model, s) as hold`.

    `await hold.replica()` waits in the model's line for a replica that may
    answer (the probe while the model is cold, its turn once warm); None once
    `seconds` have passed; ShuttingDown when the router shuts down. The caller
    tries the replica and says what it saw: `answered()` (the engine is up)
    or `still_loading()` (refused as a loading engine refuses), then asks
    again or leaves. A try ends at the next replica() or at the exit, and
    that end decides, once: warm (answered: every held request may go),
    still cold (the next probe after a pause, this request first in line and
    keeping its age), or over (anything else, a client gone included:
    another request may probe). Its replica goes back to the pool there.
    """

    __slots__ = (
        "deadline",
        "model",
        "outcome",
        "seq",
        "since",
        "_cold_start",
        "_ended",
        "_entered",
        "_probe",
        "_replica",
        "_seen",
        "_tried",
    )

    def __init__(self, cold_start: ColdStart, model: str, *, seq: int, since: float, deadline: float) -> None:
        self._cold_start = cold_start
        self.model = model
        # Its place in the model's line, kept through its tries.
        self.seq = seq
        # Monotonic time it was held, and when its wait ends with None, in the pool's clock.
        self.since = since
        self.deadline = deadline
        self._replica: Replica | None = None
        self._probe: Probing | None = None
        self._seen: _Seen | None = None
        self._tried = False
        # Tries are handed out only inside `async with`, whose exit ends the last one.
        self._entered = False
        # Why it ended without a replica: "timeout" or "shutdown".
        self._ended: str | None = None
        # How it ended, once it has (served, timeout, client_gone, shutdown), as tallied;
        # None before, or after an error of the caller's own.
        self.outcome: str | None = None

    def held_seconds(self) -> float:
        """How long the request has been held."""
        return self._cold_start.now() - self.since

    async def replica(self) -> Replica | None:
        """The next replica to try, once one may answer; None at the deadline. Ends the try before it."""
        if not self._entered:
            raise RuntimeError("a hold hands out replicas only inside `async with`, whose exit gives them back")
        if self._ended is not None:
            raise RuntimeError(f"the hold of {self.model!r} has ended ({self._ended})")
        self._end_try()
        try:
            replica, probe = await self._cold_start.wait(self, again=self._tried)
        except ShuttingDown:
            self._ended = "shutdown"
            raise
        if replica is None:
            self._ended = "timeout"
            return None
        self._tried = True
        self._replica, self._probe, self._seen = replica, probe, None
        return replica

    def answered(self) -> None:
        """The try's replica answered: the model is warm."""
        self._seen = _Seen.ANSWERED

    def still_loading(self) -> None:
        """The try's replica refused as an engine does while it loads (connection refused, 503)."""
        self._seen = _Seen.LOADING

    def _end_try(self) -> None:
        replica = self._replica
        if replica is not None:
            self._replica = None
            self._cold_start.end_try(self.model, replica, self._probe, self._seen)

    async def __aenter__(self) -> Hold:
        self._entered = True
        self._cold_start.entered(self.model)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._end_try()
        self._entered = False
        self._cold_start.left(self.model)
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            outcome: str | None = "client_gone"
        elif self._ended is not None:
            outcome = self._ended
        elif exc_type is None and self._tried:
            outcome = "served"
        else:
            # An error of the caller's own: it answers the client, no outcome is counted.
            outcome = None
        self.outcome = outcome
        if outcome is not None:
            self._cold_start.tallies.hold_ended(self.model, outcome)
