"""Client-facing handlers: read the model, acquire, forward, stream, release.

The body is read once and forwarded byte for byte; only `model` and `stream`
are looked at. Before the first byte reaches the client a failed attempt is
retried on another replica and then on the model's fallbacks; after it, the
stream is ended with an SSE error event so that the client never hangs.
Every error the router produces is OpenAI-shaped, made in `error_response()`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Histogram

from router.client import Client, ConnectFailed, ConnectionBroken, HeadTimeout, Response, UpstreamIdle
from router.config import Config
from router.errors import (
    BadRequest,
    ClientFacingError,
    ModelNotFound,
    NoReplicaAvailable,
    Overloaded,
    Unauthorized,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
)
from router.pool import Pool, Replica
from router.server import Reply, Request, WriteStalled
from router.upstream import request_headers, response_headers

log = logging.getLogger("router.proxy")

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})

# A replica answering these is busy or broken, not saying no to the request:
# another replica may well serve it.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# These say the replica is unwell. A 500 is left out on purpose: engines answer
# some invalid requests with 500 (llama.cpp, an unknown role), and one client's
# bad requests must not eject healthy replicas.
UNHEALTHY_STATUSES = frozenset({502, 503, 504})
_STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
# Answers that never have a body, whatever the request asked for.
_NO_BODY = frozenset({204, 304})
# Bytes queued for a client beyond which its stream waits for it to read.
_CLIENT_HIGH_WATER = 64 * 1024


def error_body(status: int, message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


_JSON = (b"Content-Type", b"application/json")


def error_response(exc: ClientFacingError) -> Reply:
    return Reply(exc.status, error_body(exc.status, exc.message, exc.type, exc.code, exc.param), [_JSON])


def server_error(status: int, message: str, *, code: str | None = None) -> Reply:
    """The server's own answers (unparsable request, body too large, handler failure)."""
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return Reply(status, error_body(status, message, type_, code), [_JSON])


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


def openai_shaped(body: bytes, status: int) -> bytes | None:
    """None if `body` already is an OpenAI error; else the body wrapped into one."""
    text = body.decode("utf-8", "replace").strip()
    message = text
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return None
        for key in ("message", "detail", "error"):
            value = parsed.get(key)
            if isinstance(value, str) and value:
                message = value
                break
    if not message:
        message = f"The replica answered {status} with an empty body."
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return error_body(status, message[:4096], type_, None)


def _answer(resp: Response, data: bytes, headers: list[tuple[bytes, bytes]]) -> Reply:
    """The replica's whole answer for the client; an error gets OpenAI's shape if it lacks it."""
    if resp.status >= 400:
        wrapped = openai_shaped(data, resp.status)
        if wrapped is not None:
            data = wrapped
            headers = [h for h in headers if h[0].lower() != b"content-type"]
            headers.append(_JSON)
    return Reply(resp.status, data, headers, resp.reason_bytes)


@dataclass(slots=True)
class _Failed:
    """An attempt that sent nothing to the client: what the client would get."""

    error: ClientFacingError
    retryable: bool
    # The replica's own answer (status, headers, body) when it gave one.
    answer: Reply | None = None


class DataPathMetrics:
    """Histograms observed per request; their children are bound once per model."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "router_request_duration_seconds",
            "Inference requests from arrival to the last byte sent, by model.",
            ["model"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.first_byte = Histogram(
            "router_time_to_first_byte_seconds",
            "From arrival to the replica's response head, by model.",
            ["model"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self._duration: dict[str, Any] = {}
        self._first_byte: dict[str, Any] = {}

    def observe_duration(self, model: str, seconds: float) -> None:
        child = self._duration.get(model)
        if child is None:
            child = self._duration[model] = self.duration.labels(model)
        child.observe(seconds)

    def observe_first_byte(self, model: str, seconds: float) -> None:
        child = self._first_byte.get(model)
        if child is None:
            child = self._first_byte[model] = self.first_byte.labels(model)
        child.observe(seconds)


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
        self.client = client
        self.metrics = metrics
        self.routes = Routes(config)
        self._keys = tuple(key.encode() for key in config.api_keys)
        # The router consumes the client's key; the replicas never see it.
        self._drop = frozenset({b"authorization"}) if self._keys else frozenset()
        self._first_byte_timeout = config.first_byte_timeout_seconds
        self._max_attempts = config.max_attempts
        self._queue_timeout = config.queue_timeout_seconds
        self._created = int(started_at if started_at is not None else time.time())

    # Entry points -------------------------------------------------------------

    async def dispatch(self, request: Request) -> Reply | None:
        """The client port's one handler: a Reply, or None when a stream was written."""
        path = request.path
        method = request.method
        if method == "POST" and path in INFERENCE_PATHS:
            return await self.inference(request)
        if path == "/v1/models" and method in ("GET", "HEAD"):
            return self.models(request)
        return self.not_found(request)

    async def inference(self, request: Request) -> Reply | None:
        started = time.perf_counter()
        try:
            self._authorize(request)
            body = request.body
            obj, requested, stream = parse_request(body)
            model = self.routes.aliases.get(requested, requested)
            if not self.pool.serves(model) and model not in self.routes.declared:
                self.pool.tallies.unserved_request(requested)
                raise ModelNotFound(f"The model '{requested}' does not exist or no replica serves it.", param="model")
            response = await self._serve(request, body, obj, requested, model, stream)
        except ClientFacingError as exc:
            return error_response(exc)
        self.metrics.observe_duration(model, time.perf_counter() - started)
        return response

    def models(self, request: Request) -> Reply:
        try:
            self._authorize(request)
        except ClientFacingError as exc:
            return error_response(exc)
        served = self.pool.models()
        names = list(served)
        names += [alias for alias, target in self.routes.aliases.items() if self.pool.serves(target)]
        data = [{"id": name, "object": "model", "created": self._created, "owned_by": "router"} for name in names]
        return Reply(200, orjson.dumps({"object": "list", "data": data}), [_JSON])

    def not_found(self, request: Request) -> Reply:
        if request.path in INFERENCE_PATHS or request.path == "/v1/models":
            allow = b"GET, HEAD" if request.path == "/v1/models" else b"POST"
            body = error_body(
                405,
                f"Method {request.method} is not allowed on {request.path}.",
                "invalid_request_error",
                "method_not_allowed",
            )
            return Reply(405, body, [_JSON, (b"Allow", allow)])
        body = error_body(404, f"Unknown path: {request.path}", "invalid_request_error", "unknown_url")
        return Reply(404, body, [_JSON])

    # Steps ----------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
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

    async def _serve(
        self, request: Request, body: bytes, obj: dict[str, Any], requested: str, model: str, stream: bool
    ) -> Reply | None:
        # Framed once for every attempt; only Host and the length differ.
        headers = request_headers(request.raw_headers, self._drop)
        target_path = request.target
        chain = (model, *self.routes.fallbacks.get(model, ()))
        last: _Failed | None = None
        only_connect_failures = True
        for target in chain:
            # The replica must see the name it serves (vLLM refuses an alias or
            # another model's name); only then is the body re-encoded.
            upstream_body = body if target == requested else orjson.dumps({**obj, "model": target})
            avoid: Replica | None = None
            refused: set[Replica] = set()
            for attempt in range(self._max_attempts):
                replica = self.pool.acquire(target, avoid, refused)
                if replica is None and self.pool.saturated(target):
                    deadline = asyncio.get_running_loop().time() + self._queue_timeout
                    replica, timed_out = await self.pool.acquire_or_wait(target, avoid, refused, deadline=deadline)
                    if timed_out:
                        self.pool.tallies.refused_overloaded(target)
                        raise Overloaded(
                            f"Every replica of '{target}' is at its concurrency limit; "
                            f"waited {self._queue_timeout:g} s."
                        )
                if replica is None:
                    break
                if attempt:
                    self.pool.tallies.retried(target)
                if target != model and attempt == 0:
                    self.pool.tallies.fell_back(model, target)
                try:
                    outcome = await self._attempt(request, replica, target_path, upstream_body, headers, target, stream)
                finally:
                    self.pool.release(replica)
                if not isinstance(outcome, _Failed):
                    return outcome
                last = outcome
                if not isinstance(outcome.error, UpstreamConnectError):
                    only_connect_failures = False
                if not outcome.retryable:
                    return outcome.answer or error_response(outcome.error)
                avoid = replica
                # Only a connection that broke may be tried again on the same
                # replica (it may have been a stale keep-alive one).
                if not isinstance(outcome.error, UpstreamResetError):
                    refused.add(replica)
        if last is None or only_connect_failures:
            self.pool.tallies.unserved_request(requested)
            names = " or ".join(repr(name) for name in chain)
            detail = f" (last failure: {last.error.message})" if last is not None else ""
            return error_response(NoReplicaAvailable(f"No replica of {names} can serve the request now{detail}."))
        return last.answer or error_response(last.error)

    async def _attempt(
        self,
        request: Request,
        replica: Replica,
        path: bytes,
        body: bytes,
        headers: bytes,
        model: str,
        stream: bool,
    ) -> Reply | _Failed | None:
        origin = replica.origin
        head = b"".join(
            (
                b"POST ",
                origin.prefix,
                path,
                b" HTTP/1.1\r\nHost: ",
                origin.host_header,
                b"\r\n",
                headers,
                b"Content-Length: %d\r\n\r\n" % len(body),
            )
        )
        began = time.perf_counter()
        try:
            # The connect timeout is the client's own; the first-byte deadline
            # runs from the request going out.
            resp = await self.client.request(origin, head, body, self._first_byte_timeout)
        except HeadTimeout:
            return self._failed(
                replica,
                UpstreamTimeout(f"Replica {replica.id} sent no response within {self._first_byte_timeout:g} s."),
                retryable=False,
            )
        except ConnectFailed as exc:
            return self._failed(replica, UpstreamConnectError(f"Cannot connect to replica {replica.id}: {exc}"))
        except ConnectionBroken as exc:
            # A replica that sent part of an answer has seen the request: it is
            # never sent again, here or elsewhere (a POST must not run twice).
            return self._failed(
                replica,
                UpstreamResetError(f"Replica {replica.id} failed before its answer: {exc}"),
                retryable=not exc.answered,
            )
        try:
            self.metrics.observe_first_byte(model, time.perf_counter() - began)
            status = resp.status
            if status in RETRY_STATUSES:
                return await self._refused(replica, resp)
            self._count_response(replica, status)
            if status >= 500 and status in UNHEALTHY_STATUSES:
                self.pool.record_failure(replica)
            else:
                self.pool.record_success(replica)
            out_headers = response_headers(resp.headers)
            # Passed through as it arrives: a stream, or anything without a length.
            # A replica's error answer is read whole, to give it OpenAI's shape.
            if (
                status < 400
                and status not in _NO_BODY
                and (
                    stream
                    or resp.content_length is None
                    or (resp.header(b"content-type") or b"").startswith(b"text/event-stream")
                )
            ):
                await self._stream(request, replica, resp, out_headers)
                return None
            try:
                data = await resp.read()
            except UpstreamIdle as exc:
                return self._failed(
                    replica, UpstreamTimeout(f"Replica {replica.id} stopped sending its answer: {exc}"), retryable=False
                )
            except ConnectionBroken as exc:
                return self._failed(
                    replica, UpstreamResetError(f"Replica {replica.id} broke off its answer: {exc}"), retryable=False
                )
            return _answer(resp, data, out_headers)
        finally:
            # Back to the pool after a complete answer; closed if the answer
            # was cut short, so a half-read stream never lingers.
            resp.release()

    async def _refused(self, replica: Replica, resp: Response) -> _Failed:
        """A 429/502/503/504: keep the answer for the client in case no one else serves."""
        status = resp.status
        self._count_response(replica, status)
        if status in UNHEALTHY_STATUSES:
            self.pool.record_failure(replica)
        try:
            data = await resp.read()
        except ConnectionBroken:
            data = b""
        answer = _answer(resp, data, response_headers(resp.headers))
        replica.errors["status"] = replica.errors.get("status", 0) + 1
        return _Failed(UpstreamError(f"Replica {replica.id} answered {status}."), retryable=True, answer=answer)

    async def _stream(
        self,
        request: Request,
        replica: Replica,
        resp: Response,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """Pass the body through as it arrives, each piece written in the replica's callback.

        Nothing runs per chunk but the write and a buffer check: when the
        client stops taking bytes, the replica's connection stops being read
        (TCP pushes back to the replica) and this task waits on the drain,
        which the server cuts off after write_stall_timeout_seconds.
        """
        connection = request.connection
        last = b"\n\n"
        write_chunk = connection.write_chunk

        def sink(chunk: bytes) -> bool:
            nonlocal last
            last = chunk
            return write_chunk(chunk)

        try:
            connection.start_stream(resp.status, resp.reason_bytes, headers, request.version_11)
            try:
                await resp.pipe(sink, connection.drain)
            except ConnectionBroken as exc:
                # Bytes already reached the client: no retry, and the answer
                # must look broken, never complete: an SSE stream gets an
                # error event the SDKs raise, then the connection closes
                # without the last-chunk; any other body just closes.
                replica.errors["reset"] = replica.errors.get("reset", 0) + 1
                self.pool.record_failure(replica)
                log.warning("replica %s broke off an answer: %s", replica.id, exc)
                if (resp.header(b"content-type") or b"").startswith(b"text/event-stream"):
                    event = b"data: " + error_body(
                        502, f"Replica {replica.id} broke off the stream: {exc}", "server_error", "upstream_error"
                    )
                    # Close a half-sent event first, so that the error is an event of its own.
                    prefix = b"" if last.endswith(b"\n\n") else b"\n\n"
                    connection.abort_stream(prefix + event + b"\n\n")
                else:
                    connection.abort_stream()
                return
            connection.end_stream()
        except WriteStalled:
            self.pool.tallies.client_stalled(replica.model)
            log.warning(
                "cut off a client that read nothing of its %s stream for %gs",
                replica.model,
                self.config.write_stall_timeout_seconds,
            )
        except ConnectionError:
            # The client went away. Nothing more to send; release() in the
            # caller closes the half-read upstream connection at once.
            connection.close_after_answer()

    def _failed(self, replica: Replica, error: UpstreamError, *, retryable: bool = True) -> _Failed:
        replica.errors[error.reason] = replica.errors.get(error.reason, 0) + 1
        self.pool.record_failure(replica)
        return _Failed(error, retryable)

    @staticmethod
    def _count_response(replica: Replica, status: int) -> None:
        index = status // 100 - 1
        status_class = _STATUS_CLASSES[index] if 0 <= index < 5 else "other"
        replica.responses[status_class] = replica.responses.get(status_class, 0) + 1
