"""The retry and fallback policy: each model of the chain in turn, each up to max_attempts replicas.

Before the first byte reaches the client a failed attempt is retried on
another replica, then on the model's fallbacks; only when the replica cannot
have acted on the request (a refused connection, a busy answer). A failure
that reached the client, or one the replica may have acted on, ends it there.
"""

from __future__ import annotations

from collections.abc import Collection

from router.core.clock import perf_counter
from router.core.config.settings import Config
from router.core.config.tenants import Caller, PriorityClass, lowered
from router.core.errors import NoReplicaAvailable, Overloaded, quoted
from router.core.limits.estimates import output_estimate
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.pool.waiters import Charge
from router.gateway.access_log import Entry
from router.gateway.affinity import Affinity
from router.gateway.answers import error_response
from router.gateway.call import Call
from router.gateway.catalog import Routes
from router.gateway.forward import Forwarder, answer_failed
from router.gateway.hold import HeldRequests
from router.gateway.metrics import DataPathMetrics
from router.gateway.outcomes import Failed
from router.gateway.responses import ResponsesMemory, lost
from router.http.messages import Reply, Request


class Chain:
    """The retry and fallback policy: which replica each attempt of a request goes to, and when to stop."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        forwarder: Forwarder,
        *,
        routes: Routes,
        responses: ResponsesMemory,
        held_requests: HeldRequests,
        metrics: DataPathMetrics,
    ) -> None:
        self.pool = pool
        self.forwarder = forwarder
        self.routes = routes
        self.responses = responses
        self.held_requests = held_requests
        self.metrics = metrics
        self._max_attempts = config.max_attempts
        self._classes = config.priority_classes
        # fairness_unit = "tokens": a request that waits is charged its estimate (docs/fairness.md).
        self._output_weight = config.fairness_output_weight if config.fairness_unit == "tokens" else None
        # The names X-Priority may give, as the header's bytes, lower-cased.
        self._ranks = {c.name.encode(): rank for rank, c in enumerate(config.priority_classes)}
        # The models routed by session or prompt prefix: how their requests are keyed.
        self._affinity = {
            name: Affinity(model) for name, model in config.models.items() if model.routing in ("session", "prefix")
        }
        # The models with a replica asleep or waking (router.gateway.sleepers): held as a cold model's
        # requests are, for cold_start_seconds or else twice wake_timeout_seconds: time for a wake that
        # fails at its deadline, and the next replica's.
        self._sleepy = pool.sleepy
        self._wake_hold = 2 * config.wake_timeout_seconds

    async def serve(self, call: Call) -> None:
        """Each model of the chain in turn, each up to max_attempts replicas, until one answers.

        The call's `caller` (its key's tenant and class) decides its place in
        the queue when every replica is at its limit.
        """
        pool = self.pool
        request, model = call.request, call.model
        # A /v1/responses answer's id is remembered with its replica: requests
        # that continue it must reach the replica that keeps it.
        remembering = request.path == "/v1/responses"
        adapter = call.adapter
        # An adapter's request is its own: another model's answer is not the adapter's, so no fallbacks.
        chain = (model, *self.routes.fallbacks.get(model, ())) if adapter is None else (model,)
        # About four bytes a token: a large prompt weighs in the picks while it prefills (core/pool/loads.py).
        tokens = len(request.body) >> 2 if pool.engines is not None else 0
        cold_start = self.held_requests.seconds.get(model)
        if cold_start is None and self._sleepy and model in self._sleepy:
            cold_start = self._wake_hold
        last: Failed | None = None
        only_connect_failures = True
        only_loading = True
        # Tries of the cold model that found it loading: probes if the request is
        # held in the end, else attempts as any (counted in the finally).
        probes: list[Failed] | None = None
        try:
            for target in chain:
                probing = cold_start is not None and target == model
                if probing and pool.cold_start.is_cold(model):
                    # Its held requests probe its replicas one at a time: this one
                    # waits its turn behind them (after the fallbacks), rather than
                    # try a loading engine out of turn.
                    continue
                # The body under the target's name, made now: a body that cannot be
                # renamed is refused (400) before any replica is taken for it.
                if target != call.requested:
                    call.body_for(target)
                avoid: Replica | None = None
                # Replicas this request must not reach: those that refused it, and for an
                # adapter, from the start, those of its base model that do not list it.
                # (A set only once there is one: none on the common path.)
                refused: Collection[Replica] = () if adapter is None else pool.lacking(target, adapter)
                key = None
                if self._affinity and (affinity := self._affinity.get(target)) is not None:
                    key = affinity.key(request, call.parsed)
                for attempt in range(self._max_attempts):
                    replica = pool.acquire(target, avoid, refused, key, tokens)
                    if replica is None:
                        if self._sleepy and target in self._sleepy:
                            # Gone or saturated, and one of its replicas sleeps: it is woken.
                            self.held_requests.wanted(target)
                        why = pool.why_saturated(target)
                        if why is None:
                            break
                        if call.entry is not None:
                            call.entry.queued_for = why
                        replica = await self._wait(call, target, avoid, refused, key)
                        if replica is None:
                            break
                    if attempt:
                        pool.tallies.retried(target)
                    elif target != model:
                        pool.tallies.fell_back(model, target)
                    try:
                        failed = await self.forwarder.attempt(
                            call,
                            replica,
                            target,
                            None,
                            self.responses.remember(replica) if remembering else None,
                            probing,
                        )
                    finally:
                        pool.release(replica)
                    if failed is None:
                        return
                    if failed.replica is not None:
                        if probes is None:
                            probes = []
                        probes.append(failed)
                    last = failed
                    only_connect_failures = only_connect_failures and failed.connect_failure
                    only_loading = only_loading and failed.loading
                    if not failed.retryable:
                        answer_failed(call, failed)
                        return
                    avoid = replica
                    refused = {*refused, replica}
            if cold_start is None and self._sleepy and model in self._sleepy:
                # A replica that answered 503 "sleeping" just now: asleep, and woken for this request.
                cold_start = self._wake_hold
            if cold_start and (last is None or only_loading):
                # Scaled to zero, or every replica still loading: held until one answers.
                if probes is not None:
                    for probe in probes:
                        pool.tallies.hold_probed(model, "refused" if probe.connect_failure else "loading")
                    probes = None
                await self.held_requests.serve(call, cold_start)
                return
            call.writer.answer(self._unserved(chain, last, only_connect_failures, adapter))
        finally:
            if probes is not None:
                self.forwarder.ledgers.count_tried(call.entry, probes, model)

    async def serve_pinned(self, call: Call, pinned: Replica) -> None:
        """A request that continues a response: to the replica that made it (already acquired), and no other."""
        try:
            failed = await self.forwarder.attempt(call, pinned, pinned.model, remember=self.responses.remember(pinned))
        finally:
            self.pool.release(pinned)
        if failed is not None:
            answer_failed(call, failed)

    def rank(self, request: Request, obj: dict[str, object], caller: Caller) -> int:
        """The request's class: its key's, lowered by X-Priority or the body's `priority` (read only to wait)."""
        return lowered(caller.priority, request.header(b"x-priority"), obj.get("priority"), self._ranks)

    async def pinned(self, response_id: object, rank: int = 0, entry: Entry | None = None) -> Replica:
        """The replica that keeps `response_id`, acquired: waiting in its queue while it is busy, as any request.

        404 when this router never saw the response, or its replica is gone
        (removed, draining, ejected); 503 server_overloaded after the wait of
        the request's class (`rank`). Only that replica can serve it, so it
        waits in the replica's own line, in arrival order, not in the model's
        queue by class and tenant (docs/fairness.md).
        """
        replica_id = self.responses.maker_of(response_id)
        replica = self.pool.acquire_this(replica_id)
        if replica is not None:
            return replica
        keeper = self.pool.get(replica_id)
        if keeper is None:
            raise lost(response_id, replica_id)
        klass = self._classes[rank]
        started = perf_counter()
        replica, timed_out = await self.pool.pinned.wait(replica_id, wait_seconds=klass.queue_timeout_seconds)
        if replica is None and not timed_out:
            # Gone, draining or ejected (at once or while it waited): not a wait of the limits.
            raise lost(response_id, replica_id)
        self._waited(entry, keeper.model, klass, started, replica is not None)
        if replica is None:
            self.pool.tallies.refused_overloaded(keeper.model)
            raise Overloaded(
                f"Replica {replica_id}, which keeps response {quoted(response_id)}, is at its concurrency limit; "
                f"waited {klass.queue_timeout_seconds:g} s.",
                retry_after=1,
            )
        return replica

    async def _wait(
        self, call: Call, model: str, avoid: Replica | None, refused: Collection[Replica], key: bytes | None
    ) -> Replica | None:
        """Every replica of `model` is at its limit: wait in its queue for one (503 after the class's timeout)."""
        rank = self.rank(call.request, call.parsed, call.caller)
        klass = self._classes[rank]
        started = perf_counter()
        if self._output_weight is not None and call.charge is None:
            call.charge = Charge(estimate(call, self._output_weight), self._output_weight)
        replica, timed_out = await self.pool.queues.acquire_or_wait(
            model,
            avoid,
            refused,
            wait_seconds=klass.queue_timeout_seconds,
            key=key,
            caller=call.caller,
            priority=rank,
            charge=call.charge,
        )
        self._waited(call.entry, model, klass, started, replica is not None)
        if timed_out:
            self.pool.tallies.refused_overloaded(model)
            raise Overloaded(
                f"Every replica of '{model}' is at its concurrency limit; waited {klass.queue_timeout_seconds:g} s "
                f"({klass.name}).",
                retry_after=1,
            )
        return replica

    def _waited(
        self, entry: Entry | None, model: str, klass: PriorityClass, started: float, served: bool = True
    ) -> None:
        """A wait for a slot ended, served or not: a wait that ended in a 503 counts too, it is the one
        the client saw. The access log sums a request's waits, one per attempt that waited."""
        waited = perf_counter() - started
        self.metrics.observe_queue_wait(model, klass.name, waited)
        if entry is not None:
            if entry.trace is not None:
                entry.trace.waited(klass.name, waited, served)
            entry.priority = klass.name
            entry.queued_seconds = waited + (entry.queued_seconds or 0.0)

    def _unserved(
        self, chain: tuple[str, ...], last: Failed | None, only_connect_failures: bool, adapter: str | None
    ) -> Reply:
        """No attempt answered: the last replica's own answer, or a 503 when none could be reached."""
        if last is None or only_connect_failures:
            # Demand is counted under the model the name leads to (an alias's model, an adapter's base).
            self.pool.tallies.unserved_request(chain[0])
            names = " or ".join(repr(name) for name in chain) if adapter is None else f"{adapter!r} (on {chain[0]!r})"
            detail = f" (last failure: {last.error.message})" if last is not None else ""
            return error_response(
                NoReplicaAvailable(
                    f"No replica of {names} can serve the request now{detail}.",
                    retry_after=self.pool.ejections.retry_after(chain),
                )
            )
        return last.reply()


# The output a request that names no bound is counted for, until its answer says what it made.
DEFAULT_OUTPUT_TOKENS = 256


def estimate(call: Call, output_weight: float) -> float:
    """What a request may cost in tokens before its answer says: about four bytes a prompt token
    (the body's, its JSON included), plus what it may generate weighted, counted as the limits count
    it (router.core.limits.estimates: every answer asked for, nothing on a path that generates
    nothing), with DEFAULT_OUTPUT_TOKENS an answer where it names no bound."""
    request = call.request
    return (len(request.body) >> 2) + output_weight * output_estimate(call.parsed, DEFAULT_OUTPUT_TOKENS, request.path)
