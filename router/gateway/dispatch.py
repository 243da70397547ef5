"""The client port's one handler: who may ask, for what, and where each request goes.

Every answer goes through the request's Writer. An inference request (a POST
to a path of `routed_paths`) is read for its model name (bodies.py), checked
against what is served (catalog.py), and handed to the retry and fallback
chain (chain.py), or to the replica that keeps the response it continues
(responses.py). Every error the router makes is OpenAI-shaped (answers.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router.core.clock import perf_counter
from router.core.config.engines import ANTHROPIC_PATHS
from router.core.config.settings import Config, has_upstream
from router.core.config.tenants import ANYONE
from router.core.errors import BadRequest, ClientFacingError, ModelNotFound, quoted
from router.core.pool.pool import Pool
from router.gateway.access_log import AccessLog, Entry, current_entry
from router.gateway.answers import JSON, error_body, error_response
from router.gateway.anthropic import AnthropicWriter, reshaped
from router.gateway.bodies import parse_form, parse_request
from router.gateway.call import Call
from router.gateway.catalog import Catalog, Routes
from router.gateway.chain import Chain
from router.gateway.forward import Forwarder, answer_failed
from router.gateway.hold import HeldRequests
from router.gateway.keys import CLIENT_KEY_HEADERS, ApiKeys
from router.gateway.limits import LimitedWriter, RateLimiter
from router.gateway.metrics import DataPathMetrics
from router.gateway.responses import ResponsesMemory
from router.gateway.sleepers import Sleepers
from router.gateway.traces import TRACE_HEADERS, RequestTrace, Tracer
from router.gateway.tunnel import Tunnels, asks_websocket
from router.gateway.wake import Waker
from router.http.client import Client
from router.http.headers import REQUEST_ID, HeaderFilter
from router.http.messages import Reply, Request
from router.http.writer import Writer

# The methods each path under /v1/responses/{id} allows.
_STORED = {"": ("GET", "DELETE"), "cancel": ("POST",), "input_items": ("GET",)}


class Proxy:
    """The client port's handler: who may ask, for what, and which part of the gateway answers each request."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        client: Client,
        metrics: DataPathMetrics,
        *,
        started_at: float | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.routes = routes = Routes(config)
        self.keys = keys = ApiKeys(config.api_keys, config.priority_classes)
        self.catalog = Catalog(pool, routes, keys, int(started_at if started_at is not None else time.time()))
        forwarder = Forwarder(
            pool,
            client,
            metrics,
            first_byte_timeout=config.first_byte_timeout_seconds,
            write_stall_timeout=config.write_stall_timeout_seconds,
            expose_replica=config.expose_replica_header,
            credentials={name: m.upstream.lines for name, m in config.models.items() if m.upstream is not None},
            count_tokens=config.count_tokens,
        )
        self.forwarder = forwarder
        self.responses = ResponsesMemory(config.remembered_responses)
        self.held_requests = HeldRequests(config, pool, forwarder, metrics)
        self.chain = Chain(
            config,
            pool,
            forwarder,
            routes=routes,
            responses=self.responses,
            held_requests=self.held_requests,
            metrics=metrics,
        )
        # The POST paths routed by the model they name (config routed_paths).
        self.routed = frozenset(config.routed_paths)
        # Never passed to a replica as the client sent them: its key, X-Request-Id (the router sets it:
        # the client's, checked, or its own), and any key the client sent once the engines have their own.
        self._forwarded = HeaderFilter(keys.drop | withheld(config) | REQUEST_ID)
        # The GET paths whose WebSocket upgrades are routed by the query's model (config upgrade_paths).
        self.upgrades = frozenset(config.upgrade_paths)
        self.tunnels = Tunnels(config, pool, routes, keys, self._forwarded)
        self.access_log: AccessLog | None = None
        # [tracing]'s (router.run.tracing), set by trace_with(); None: nothing of tracing runs.
        self.tracer: Tracer | None = None
        # The tenants' rate limits ([limits], router.gateway.limits); None: no tenant is limited.
        self.limiter: RateLimiter | None = None

    @property
    def waker(self) -> Waker | None:
        """The wake calls made when a request is held (config wake_url)."""
        return self.held_requests.waker

    @waker.setter
    def waker(self, waker: Waker | None) -> None:
        self.held_requests.waker = waker
        if (sleepers := self.held_requests.sleepers) is not None:
            sleepers.waker = waker

    def wake_sleepers(self, sleepers: Sleepers) -> None:
        """Wake sleeping replicas for the requests that need them, and know a 503 "sleeping" (the sleep tier)."""
        sleepers.waker = self.held_requests.waker
        self.held_requests.sleepers = self.forwarder.sleepers = sleepers

    def dispatch(self, request: Request, writer: Writer) -> Awaitable[None]:
        """The client port's one handler: every answer goes through `writer`.

        An inference request's coroutine is handed back to be awaited as it is:
        one of dispatch's own around it would cost a frame on every request.
        """
        if request.method == "POST" and request.path in self.routed:
            return self.inference(request, writer)
        return self._other(request, writer)

    async def _other(self, request: Request, writer: Writer) -> None:
        """Any request but an inference request: a stored response, a WebSocket upgrade, the models."""
        path = request.path
        method = request.method
        if path.startswith("/v1/responses/"):
            await self.stored_response(request, writer)
        elif method == "GET" or method == "HEAD":  # noqa: PLR1714 (two compares beat a tuple here)
            if path in self.upgrades and method == "GET":
                await self.tunnels.serve(request, writer)
            elif path == "/v1/models":
                writer.answer(self.catalog.models(request))
            elif path.startswith("/v1/models/"):
                writer.answer(self.catalog.model_info(request, path[len("/v1/models/") :]))
            else:
                writer.answer(self.not_found(request))
        else:
            writer.answer(self.not_found(request))

    def apply_keys(self, config: Config) -> None:
        """SIGHUP's api_keys: checked from the next request on; what the replicas are not sent follows
        (the client's key is theirs to see only while the router checks none and they hold none)."""
        self.keys.update(config.api_keys, config.priority_classes)
        if self.limiter is not None:
            # Limits of tenants that had none at start need a restart: the limiter is made at start.
            self.limiter.update(dict(config.limits.tenants) if config.limits is not None else {})
        dropped = self.keys.drop | withheld(config) | REQUEST_ID
        self.tunnels.forwarded = HeaderFilter(dropped)
        self._forwarded = HeaderFilter(dropped | TRACE_HEADERS) if self.tracer is not None else self.tunnels.forwarded

    def handler(self) -> Callable[[Request, Writer], Awaitable[None]]:
        """The client port's handler: with no access log and no tracing, one that keeps nothing per request for them."""
        if self.tracer is not None:
            return self.dispatch_traced
        return self.dispatch_logged if self.access_log is not None else self.dispatch

    def trace_with(self, tracer: Tracer, config: Config) -> None:
        """Trace inference requests (the server's handler is then dispatch_traced): a replica gets the
        router's traceparent, never the client's as it came (its trace is continued by the router's span)."""
        self.tracer = tracer
        self._forwarded = HeaderFilter(self.keys.drop | withheld(config) | REQUEST_ID | TRACE_HEADERS)

    def may_switch(self, request: Request) -> bool:
        """The server's upgrade check: a WebSocket upgrade on a path of upgrade_paths."""
        return request.path in self.upgrades and asks_websocket(request)

    def refuse_keyless_body(self, request: Request) -> Reply | None:
        """The client port's head check while api_keys is set: a request that announces a body
        and has no valid key is refused from its head (401), before a byte of the body is read
        or a 100 sent, so that clients without a key never hold the bodies' shared budget.

        The server answers it in its turn and closes; its access-log line is written here.
        """
        reply = self.keys.refusal(request)
        if reply is not None and request.path in ANTHROPIC_PATHS:
            body = reshaped(reply.body, reply.status)
            reply = Reply(reply.status, body or reply.body, reply.headers)
        if reply is not None and self.access_log is not None:
            entry = Entry(request.request_id.decode("ascii"), request.peer, request.method, request.path, 0)
            entry.status = reply.status
            # The body's bytes, as a stream counts them: the head is the server's to write, later.
            entry.bytes_out = len(reply.body)
            self.access_log.write(entry)
        return reply

    async def dispatch_logged(self, request: Request, writer: Writer) -> None:
        """dispatch(), with the request's line written to the access log when it ends."""
        await self._entered(request, writer, None)

    async def dispatch_traced(self, request: Request, writer: Writer) -> None:
        """dispatch(), an inference request traced (and, with the access log on, every request logged)."""
        tracer = self.tracer
        if tracer is None or request.method != "POST" or request.path not in self.routed:
            if self.access_log is None:
                await self.dispatch(request, writer)
            else:
                await self._entered(request, writer, None)
            return
        await self._entered(request, writer, tracer.begin(request))

    async def _entered(self, request: Request, writer: Writer, trace: RequestTrace | None) -> None:
        """dispatch() with the request's entry (its access-log line, its trace's record), ended when it ends."""
        ident = request.request_id.decode("ascii")
        entry = Entry(ident, request.peer, request.method, request.path, len(request.body))
        entry.trace = trace
        # The writer fills in what it writes (status, bytes); the gateway's own
        # fields are reached through current_entry, for this request's task only.
        writer.meter = entry
        token = current_entry.set(entry)
        try:
            await self.dispatch(request, writer)
        except asyncio.CancelledError:
            entry.outcome = "client_gone"
            raise
        except Exception:
            entry.outcome = "error"
            if not writer.started:
                entry.status = 500  # what the server answers for a handler that failed
            raise
        finally:
            current_entry.reset(token)
            if trace is not None:
                trace.end(entry)
            if self.access_log is not None:
                self.access_log.write(entry)

    async def inference(self, request: Request, writer: Writer) -> None:
        started = perf_counter()
        if request.path in ANTHROPIC_PATHS:
            writer = AnthropicWriter(writer)
        try:
            caller = self.keys.check(request) if self.keys.active else ANYONE
            body = request.body
            if body.startswith(b"--"):
                # Multipart form data (the audio endpoints): the model is a form field.
                obj, requested, stream = parse_form(body, request.header(b"content-type"))
            else:
                obj, requested, stream = parse_request(body)
            if requested is None:
                requested = self.routes.unnamed(self.pool)
            if (entry := current_entry.get()) is not None:
                entry.model = requested
                entry.tenant = caller.tenant
            routes = self.routes
            model = routes.aliases.get(requested, requested)
            pool = self.pool
            adapter = None
            if model not in pool.ever_served and not pool.serves(model) and model not in routes.declared:
                # Known is served at any time since start (the test that settles the common
                # case, first), or now, or declared: a model scaled to zero is unavailable (503),
                # not unknown (404).
                # Else a LoRA adapter some replica lists, served by its base model's.
                base = pool.adapters.base_of(model)
                if base is None:
                    pool.tallies.unserved_request(model)
                    raise ModelNotFound(
                        f"The model {quoted(requested)} does not exist or no replica serves it.", param="model"
                    )
                adapter, model = model, base
            # Framed once for every attempt; only Host and the length differ.
            headers = self._forwarded.framed(request.raw_headers)
            call = Call(request, writer, obj, requested, model, stream, headers, entry, caller, adapter, started)
            if (limiter := self.limiter) is not None and caller.tenant in limiter.tenants:
                # A tenant with rate limits (router.gateway.limits); any other: this one check.
                await self.limited(limiter, call, obj)
            elif request.path == "/v1/responses" and (previous := obj.get("previous_response_id")) is not None:
                await self.serve_continued(call, previous, obj)
            else:
                await self.chain.serve(call)
        except ClientFacingError as exc:
            writer.answer(error_response(exc))
            return
        self.metrics.duration.observe(model, perf_counter() - started)

    async def serve_continued(self, call: Call, previous: object, obj: dict[str, Any]) -> None:
        """A /v1/responses request that continues one: served by the replica that keeps it."""
        if not isinstance(previous, str):
            raise BadRequest("'previous_response_id' must be a string.", param="previous_response_id")
        pinned = await self.chain.pinned(previous, self.chain.rank(call.request, obj, call.caller), call.entry)
        await self.chain.serve_pinned(call, pinned)

    async def limited(self, limiter: RateLimiter, call: Call, obj: dict[str, Any]) -> None:
        """A limited tenant's request: admitted or refused (429), its answer with x-ratelimit-*, then settled."""
        request = call.request
        tenant = call.caller.tenant
        ticket = (
            limiter.admit_now(tenant, request.path, len(request.body), obj)
            if limiter.memory is not None
            else await limiter.admit(tenant, request.path, len(request.body), obj)
        )
        if isinstance(ticket, Reply):
            call.writer.answer(ticket)
            return
        call.writer = writer = LimitedWriter(call.writer, ticket.headers)
        try:
            if request.path == "/v1/responses" and (previous := obj.get("previous_response_id")) is not None:
                await self.serve_continued(call, previous, obj)
            else:
                await self.chain.serve(call)
        except ClientFacingError as exc:
            writer.answer(error_response(exc))
        finally:
            # A stream admitted runs to its end; only then is its estimate trued up.
            limiter.settle(ticket, call, writer.status)

    async def stored_response(self, request: Request, writer: Writer) -> None:
        """GET /v1/responses/{id} (and its cancel, input_items): only the replica that made it knows it."""
        try:
            if self.keys.active:
                self.keys.check(request)
            ident, _, rest = request.path[len("/v1/responses/") :].partition("/")
            allowed = _STORED.get(rest)
            if allowed is None or not ident:
                writer.answer(self.not_found(request))
                return
            if request.method not in allowed:
                writer.answer(_not_allowed(request, ", ".join(allowed).encode()))
                return
            entry = current_entry.get()
            replica = await self.chain.pinned(ident, entry=entry)
            if entry is not None:
                entry.model = replica.model
            headers = self._forwarded.framed(request.raw_headers)
            model = replica.model
            call = Call(request, writer, {}, model, model, False, headers, entry, ANYONE, None, perf_counter())
            # The response again, not a new one: its tokens were counted when it was made.
            call.metered = False
            try:
                failed = await self.forwarder.attempt(call, replica, replica.model)
            finally:
                self.pool.release(replica)
            if failed is not None:
                answer_failed(call, failed)
        except ClientFacingError as exc:
            writer.answer(error_response(exc))

    def not_found(self, request: Request) -> Reply:
        if request.path in self.routed or request.path == "/v1/models":
            return _not_allowed(request, b"GET, HEAD" if request.path == "/v1/models" else b"POST")
        body = error_body(404, f"Unknown path: {request.path}", "invalid_request_error", "unknown_url")
        return Reply(404, body, [JSON])


def withheld(config: Config) -> frozenset[bytes]:
    """The client's key headers, once any engine has a key of its own to be sent instead: one
    Authorization a request, the router's, never the client's beside it."""
    return CLIENT_KEY_HEADERS if has_upstream(config) else frozenset()


def _not_allowed(request: Request, allow: bytes) -> Reply:
    body = error_body(
        405, f"Method {request.method} is not allowed on {request.path}.", "invalid_request_error", "method_not_allowed"
    )
    return Reply(405, body, [JSON, (b"Allow", allow)])
