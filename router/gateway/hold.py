"""Scale from zero: a request for a cold model held until one of its replicas answers.

The first held request is tried on the model's replicas with a short capped
backoff while they refuse (an engine still loading); once one answers, the
rest follow in arrival order under the limits. How a hold ends (served, timed
out, overflowed, the client gone, shutdown) is the core's Hold to decide and
count; this module asks it for replicas and says what each answered.
"""

from __future__ import annotations

from router.core.config.models import ModelConfig
from router.core.config.settings import Config
from router.core.errors import ModelCold
from router.core.pool.coldstart import ShuttingDown
from router.core.pool.pool import Pool
from router.gateway.call import Call
from router.gateway.forward import Forwarder, answer_failed
from router.gateway.metrics import DataPathMetrics
from router.gateway.sleepers import Sleepers
from router.gateway.wake import Waker

_DEFAULT_MAX_HELD = ModelConfig("").max_held


class HeldRequests:
    """Requests held for a cold model until a replica answers: which models hold (`cold_start_seconds`),
    how many at most (`max_held`), and the loop that tries a held request's replicas."""

    def __init__(self, config: Config, pool: Pool, forwarder: Forwarder, metrics: DataPathMetrics) -> None:
        self.pool = pool
        self.forwarder = forwarder
        self.metrics = metrics
        # How long a request for the model may be held, and how many at once.
        self.seconds = {name: m.cold_start_seconds for name, m in config.models.items() if m.cold_start_seconds}
        self.max_held = {name: m.max_held for name, m in config.models.items()}
        self.waker: Waker | None = None
        # The sleep tier's request side (router.gateway.sleepers); None: this router wakes no replica.
        self.sleepers: Sleepers | None = None

    def wanted(self, model: str) -> None:
        """Requests for `model` wait, and one of its replicas sleeps: wake one (or another) for them."""
        if self.sleepers is not None:
            self.sleepers.wanted(model)

    async def serve(self, call: Call, cold_start: float) -> None:
        """Hold `call` until a replica of its model answers, `cold_start` seconds at most.

        The body is the one read from the client, never copied per try.
        """
        model = call.model
        pool = self.pool
        pool.asked(model)
        entry = call.entry
        retry_after = max(1, min(30, round(cold_start / 4)))
        # A model held only because its replicas sleep may have no table of its own: the default bound.
        max_held = self.max_held.get(model, _DEFAULT_MAX_HELD)
        if pool.cold_start.held(model) >= max_held:
            pool.tallies.hold_ended(model, "overflow")
            if entry is not None:
                entry.hold_outcome = entry.outcome = "overflow"
                entry.held_seconds = 0.0
            raise ModelCold(
                f"The model '{model}' is starting, and {max_held} "
                f"{'request already waits' if max_held == 1 else 'requests already wait'} for it; retry shortly.",
                retry_after=retry_after,
            )
        sleepers = self.sleepers
        if sleepers is not None and sleepers.sleepy(model):
            # A sleeping replica is woken first; wake_url is told if none can be.
            sleepers.wanted(model)
        elif self.waker is not None:
            self.waker.held(model)
        # Under the model's own name before the hold begins: a body that cannot be renamed is a 400, not a hold.
        call.body_for(model)
        hold = pool.cold_start.begin(model, cold_start)
        # How long it waited for the replica that answered; else, at the end, the whole wait.
        held: float | None = None
        try:
            # The hold ends every try it hands out and counts how the request left it.
            async with hold:
                while True:
                    try:
                        replica = await hold.replica()
                    except ShuttingDown:
                        raise ModelCold(
                            f"The router is shutting down; the model '{model}' was still starting.", retry_after=1
                        ) from None
                    if replica is None:
                        raise ModelCold(
                            f"No replica of '{model}' answered within {cold_start:g} s; it is still starting.",
                            retry_after=retry_after,
                        )
                    held = hold.held_seconds()
                    failed = await self.forwarder.attempt(
                        call, replica, model, extra=[(b"X-Router-Held-Seconds", b"%.3f" % held)], probe=True
                    )
                    if failed is not None and failed.asleep:
                        # Asleep, not loading: a wake (one per replica) is what it waits for, and it
                        # is no failure of the replica's; this request stays first in line for it.
                        pool.tallies.hold_probed(model, "loading")
                        self.wanted(model)
                        hold.still_loading()
                        held = None
                        continue
                    if failed is not None and failed.retryable and failed.loading:
                        # Still loading: the next try after a pause, this request first in line.
                        pool.tallies.hold_probed(model, "refused" if failed.connect_failure else "loading")
                        hold.still_loading()
                        held = None
                        continue
                    pool.tallies.hold_probed(model, "answered")
                    if failed is None:
                        hold.answered()
                    self.metrics.observe_held(model, held)
                    if failed is not None:
                        answer_failed(call, failed)
                    return
        finally:
            # The access log says how the hold ended, as router_hold_outcomes_total does.
            if entry is not None:
                entry.hold_outcome = hold.outcome
                entry.held_seconds = held if held is not None and hold.outcome == "served" else hold.held_seconds()
                if entry.trace is not None:
                    entry.trace.held(hold.held_seconds(), entry.held_seconds, hold.outcome or "")
                if hold.outcome in ("timeout", "shutdown"):
                    entry.outcome = hold.outcome
