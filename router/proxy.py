"""The client port's routes: who may ask, for what, and the retry and fallback policy.

The body is read once and forwarded byte for byte; only `model` and `stream`
are looked at. Before the first byte reaches the client a failed attempt is
retried on another replica and then on the model's fallbacks (the policy,
`_serve`, is the one short loop below); after it, a broken answer is ended so
that it looks broken. One attempt is router/forward.py's; every error the
router makes is OpenAI-shaped, made in router/answers.py.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import orjson

from router.answers import JSON, error_body, error_response
from router.client import Client
from router.config import Config
from router.errors import (
    BadRequest,
    ClientFacingError,
    ModelCold,
    ModelNotFound,
    NoReplicaAvailable,
    Overloaded,
    Unauthorized,
)
from router.forward import DataPathMetrics, Failed, Forwarder
from router.pool import HoldEnded, HoldTicket, Pool, Replica
from router.server import Reply, Request, Writer
from router.upstream import request_headers
from router.wake import Waker

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


def parse_request(body: bytes) -> tuple[dict[str, Any], str, bool]:
    """The body as a JSON object, its model name, and whether it asks for a stream."""
    if not body:
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("The request must name a model: 'model' must be a non-empty string.", param="model")
    return obj, model, obj.get("stream") is True


class Routes:
    """Which names clients may ask for, and where each leads."""

    def __init__(self, config: Config) -> None:
        self.aliases: dict[str, str] = {}
        self.fallbacks: dict[str, tuple[str, ...]] = {}
        self.declared: set[str] = set()
        for name, model in config.models.items():
            self.declared.add(name)
            self.fallbacks[name] = model.fallbacks
            for alias in model.aliases:
                self.aliases[alias] = name


class ApiKeys:
    """The client keys: compared in constant time, consumed, never forwarded."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode() for key in keys)
        self.active = bool(self._keys)
        # The router consumes the client's key; the replicas never see it.
        self.drop = frozenset({b"authorization"}) if self._keys else frozenset()

    def check(self, request: Request) -> None:
        if not self._keys:
            return
        header = (request.header(b"authorization") or b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and given:
            candidate = given.strip().encode("latin-1")
            # Compare with every key, in constant time, so timing tells nothing.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(candidate, key)
            if matched:
                return
        raise Unauthorized("Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.")


class Proxy:
    def __init__(
        self,
        config: Config,
        pool: Pool,
        client: Client,
        metrics: DataPathMetrics,
        *,
        started_at: float | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.routes = Routes(config)
        self.keys = ApiKeys(config.api_keys)
        self.forwarder = Forwarder(
            pool,
            client,
            metrics,
            first_byte_timeout=config.first_byte_timeout_seconds,
            write_stall_timeout=config.write_stall_timeout_seconds,
        )
        self._max_attempts = config.max_attempts
        # Scale from zero, per model: how long a request may be held, and how many at once.
        self.cold_start = {name: m.cold_start_seconds for name, m in config.models.items() if m.cold_start_seconds}
        self.max_held = {name: m.max_held for name, m in config.models.items()}
        self.waker: Waker | None = None
        self._queue_timeout = config.queue_timeout_seconds
        self._created = int(started_at if started_at is not None else time.time())

    # Routes -------------------------------------------------------------------

    async def dispatch(self, request: Request, writer: Writer) -> None:
        """The client port's one handler: every answer goes through `writer`."""
        path = request.path
        method = request.method
        if method == "POST" and path in INFERENCE_PATHS:
            await self.inference(request, writer)
        elif path == "/v1/models" and method in ("GET", "HEAD"):
            writer.answer(self.models(request))
        else:
            writer.answer(self.not_found(request))

    async def inference(self, request: Request, writer: Writer) -> None:
        started = time.perf_counter()
        try:
            if self.keys.active:
                self.keys.check(request)
            body = request.body
            obj, requested, stream = parse_request(body)
            model = self.routes.aliases.get(requested, requested)
            if not self.pool.serves(model) and model not in self.routes.declared and model not in self.pool.ever_served:
                # Known is declared, or served now or at any time since start:
                # a model scaled to zero is unavailable (503), not unknown (404).
                self.pool.tallies.unserved_request(requested)
                raise ModelNotFound(f"The model '{requested}' does not exist or no replica serves it.", param="model")
            await self._serve(request, writer, obj, requested, model, stream)
        except ClientFacingError as exc:
            writer.answer(error_response(exc))
            return
        self.metrics.observe_duration(model, time.perf_counter() - started)

    def models(self, request: Request) -> Reply:
        try:
            self.keys.check(request)
        except ClientFacingError as exc:
            return error_response(exc)
        served = self.pool.models()
        names = list(served)
        names += [alias for alias, target in self.routes.aliases.items() if self.pool.serves(target)]
        data = [{"id": name, "object": "model", "created": self._created, "owned_by": "router"} for name in names]
        return Reply(200, orjson.dumps({"object": "list", "data": data}), [JSON])

    def not_found(self, request: Request) -> Reply:
        if request.path in INFERENCE_PATHS or request.path == "/v1/models":
            allow = b"GET, HEAD" if request.path == "/v1/models" else b"POST"
            body = error_body(
                405,
                f"Method {request.method} is not allowed on {request.path}.",
                "invalid_request_error",
                "method_not_allowed",
            )
            return Reply(405, body, [JSON, (b"Allow", allow)])
        body = error_body(404, f"Unknown path: {request.path}", "invalid_request_error", "unknown_url")
        return Reply(404, body, [JSON])

    # The retry and fallback policy ----------------------------------------------

    async def _serve(
        self, request: Request, writer: Writer, obj: dict[str, Any], requested: str, model: str, stream: bool
    ) -> None:
        """Each model of the chain in turn, each up to max_attempts replicas, until one answers.

        A failure that reached the client, or one the replica may have acted
        on, ends it there; a refused connection or a busy answer moves on.
        """
        # Framed once for every attempt; only Host and the length differ.
        headers = request_headers(request.raw_headers, self.keys.drop)
        chain = (model, *self.routes.fallbacks.get(model, ()))
        last: Failed | None = None
        only_connect_failures = True
        only_loading = True
        for target in chain:
            # The replica must see the name it serves (vLLM refuses an alias or
            # another model's name); only then is the body re-encoded.
            body = request.body if target == requested else orjson.dumps({**obj, "model": target})
            avoid: Replica | None = None
            refused: set[Replica] = set()
            for attempt in range(self._max_attempts):
                replica = self.pool.acquire(target, avoid, refused)
                if replica is None:
                    if not self.pool.saturated(target):
                        break
                    replica = await self._wait(target, avoid, refused)
                    if replica is None:
                        break
                if attempt or target != model:
                    self._count_attempt(model, target, attempt)
                try:
                    failed = await self.forwarder.attempt(request, writer, replica, body, headers, target, stream)
                finally:
                    self.pool.release(replica)
                if failed is None:
                    return
                last = failed
                only_connect_failures = only_connect_failures and failed.connect_failure
                only_loading = only_loading and failed.loading
                if not failed.retryable:
                    writer.answer(failed.reply())
                    return
                avoid = replica
                refused.add(replica)
        cold_start = self.cold_start.get(model)
        if cold_start and (last is None or only_loading):
            # Scaled to zero, or every replica still loading: held until one answers.
            await self._hold(request, writer, obj, requested, model, stream, headers, cold_start)
            return
        writer.answer(self._unserved(requested, chain, last, only_connect_failures))

    async def _hold(
        self,
        request: Request,
        writer: Writer,
        obj: dict[str, Any],
        requested: str,
        model: str,
        stream: bool,
        headers: bytes,
        cold_start: float,
    ) -> None:
        """Hold the request until a replica of `model` answers, `cold_start` seconds at most.

        The first held request is tried on the model's replicas with a short
        capped backoff while they refuse (loading); once one answers, the
        rest follow in arrival order under the limits. The body is the one
        read from the client, never copied per try.
        """
        pool = self.pool
        tallies = pool.tallies
        pool.asked(model)
        retry_after = max(1, min(30, round(cold_start / 4)))
        max_held = self.max_held[model]
        if pool.held(model) >= max_held:
            tallies.hold_ended(model, "overflow")
            raise ModelCold(
                f"The model '{model}' is starting, and {max_held} requests already wait for it; retry shortly.",
                retry_after=retry_after,
            )
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + cold_start
        if self.waker is not None:
            self.waker.held(model)
        body = request.body if model == requested else orjson.dumps({**obj, "model": model})
        ticket: HoldTicket | None = None
        try:
            while True:
                try:
                    replica, ticket = await pool.hold(model, deadline=deadline, ticket=ticket)
                except HoldEnded:
                    tallies.hold_ended(model, "shutdown")
                    raise ModelCold(
                        f"The router is shutting down; the model '{model}' was still starting.", retry_after=1
                    ) from None
                if replica is None:
                    tallies.hold_ended(model, "timeout")
                    raise ModelCold(
                        f"No replica of '{model}' answered within {cold_start:g} s; it is still starting.",
                        retry_after=retry_after,
                    )
                held = loop.time() - began
                ended = False
                try:
                    failed = await self.forwarder.attempt(
                        request,
                        writer,
                        replica,
                        body,
                        headers,
                        model,
                        stream,
                        [(b"X-Router-Held-Seconds", b"%.3f" % held)],
                    )
                    ended = True
                finally:
                    pool.release(replica)
                    if not ended:
                        pool.probe_over(model)
                if failed is not None and failed.retryable and failed.loading:
                    # Still loading: the next try after a pause, this request first in line.
                    pool.still_cold(model)
                    continue
                pool.probe_over(model)
                tallies.hold_ended(model, "served")
                self.metrics.observe_held(model, held)
                if failed is not None:
                    writer.answer(failed.reply())
                return
        except asyncio.CancelledError:
            tallies.hold_ended(model, "client_gone")
            raise

    async def _wait(self, model: str, avoid: Replica | None, refused: set[Replica]) -> Replica | None:
        """Every replica of `model` is at its limit: wait in its queue for one (503 after the timeout)."""
        deadline = asyncio.get_running_loop().time() + self._queue_timeout
        replica, timed_out = await self.pool.acquire_or_wait(model, avoid, refused, deadline=deadline)
        if timed_out:
            self.pool.tallies.refused_overloaded(model)
            raise Overloaded(
                f"Every replica of '{model}' is at its concurrency limit; waited {self._queue_timeout:g} s."
            )
        return replica

    def _count_attempt(self, model: str, target: str, attempt: int) -> None:
        if attempt:
            self.pool.tallies.retried(target)
        elif target != model:
            self.pool.tallies.fell_back(model, target)

    def _unserved(
        self, requested: str, chain: tuple[str, ...], last: Failed | None, only_connect_failures: bool
    ) -> Reply:
        """No attempt answered: the last replica's own answer, or a 503 when none could be reached."""
        if last is None or only_connect_failures:
            self.pool.tallies.unserved_request(requested)
            names = " or ".join(repr(name) for name in chain)
            detail = f" (last failure: {last.error.message})" if last is not None else ""
            return error_response(NoReplicaAvailable(f"No replica of {names} can serve the request now{detail}."))
        return last.reply()
