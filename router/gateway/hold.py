"""Scale from zero: a request for a cold model held until one of its replicas answers.

The first held request is tried on the model's replicas with a short capped
backoff while they refuse (an engine still loading); once one answers, the
rest follow in arrival order under the limits. How a hold ends (served, timed
out, overflowed, the client gone, shutdown) is the core's Hold to decide and
count; this module asks it for replicas and says what each answered.
"""

from __future__ import annotations

from router.core.config.settings import Config
from router.core.errors import ModelCold
from router.core.pool.coldstart import ShuttingDown
from router.core.pool.pool import Pool
from router.gateway.access_log import current_entry
from router.gateway.bodies import with_model
from router.gateway.forward import Forwarder, answer_failed
from router.gateway.metrics import DataPathMetrics
from router.gateway.wake import Waker
from router.http.messages import Request
from router.http.writer import Writer


class HeldRequests:
    """The models that hold requests (`cold_start_seconds`), and each model's bound (`max_held`)."""

    def __init__(self, config: Config, pool: Pool, forwarder: Forwarder, metrics: DataPathMetrics) -> None:
        self.pool = pool
        self.forwarder = forwarder
        self.metrics = metrics
        # How long a request for the model may be held, and how many at once.
        self.seconds = {name: m.cold_start_seconds for name, m in config.models.items() if m.cold_start_seconds}
        self.max_held = {name: m.max_held for name, m in config.models.items()}
        self.waker: Waker | None = None

    async def serve(
        self,
        request: Request,
        writer: Writer,
        obj: dict[str, object],
        requested: str,
        model: str,
        stream: bool,
        headers: bytes,
        cold_start: float,
    ) -> None:
        """Hold the request until a replica of `model` answers, `cold_start` seconds at most.

        The body is the one read from the client, never copied per try.
        """
        pool = self.pool
        pool.asked(model)
        entry = current_entry.get()
        retry_after = max(1, min(30, round(cold_start / 4)))
        max_held = self.max_held[model]
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
        if self.waker is not None:
            self.waker.held(model)
        body = request.body if model == requested else with_model(request.body, obj, model)
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
                        request,
                        writer,
                        replica,
                        body,
                        headers,
                        model,
                        stream,
                        [(b"X-Router-Held-Seconds", b"%.3f" % held)],
                        probe=True,
                    )
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
                        answer_failed(writer, failed)
                    return
        finally:
            # The access log says how the hold ended, as router_hold_outcomes_total does.
            if entry is not None:
                entry.hold_outcome = hold.outcome
                entry.held_seconds = held if held is not None and hold.outcome == "served" else hold.held_seconds()
                if hold.outcome in ("timeout", "shutdown"):
                    entry.outcome = hold.outcome
