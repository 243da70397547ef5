"""The client port's routes: who may ask, for what, and the retry and fallback policy.

The body is read once and forwarded byte for byte; only `model` and `stream`
are looked at. Before the first byte reaches the client a failed attempt is
retried on another replica and then on the model's fallbacks (the policy,
`_serve`, is the one short loop below); after it, a broken answer is ended so
that it looks broken. One attempt is router/gateway/forward.py's; every error the
router makes is OpenAI-shaped, made in router/gateway/answers.py.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from router.core.coldstart import HoldEnded
from router.core.config import Config
from router.core.errors import (
    BadRequest,
    ClientFacingError,
    ModelCold,
    ModelNotFound,
    NoReplicaAvailable,
    Overloaded,
    ResponseNotFound,
    Unauthorized,
    UpstreamResetError,
    UpstreamTimeout,
    quoted,
)
from router.core.pool import Pool
from router.core.replicas import Replica
from router.core.tallies import MAX_NAME_BYTES
from router.gateway.access_log import AccessLog, Entry, current_entry
from router.gateway.affinity import Affinity
from router.gateway.answers import JSON, error_body, error_response
from router.gateway.forward import DataPathMetrics, Failed, Forwarder
from router.gateway.wake import Waker
from router.http.client import Client
from router.http.headers import REQUEST_ID, HeaderFilter
from router.http.messages import Reply, Request
from router.http.writer import Writer


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


def parse_form(body: bytes, content_type: bytes | None) -> tuple[dict[str, Any], str, bool]:
    """Multipart form data: the `model` field (and `stream`), found without copying the file parts."""
    boundary = _boundary(content_type)
    if boundary is None:
        raise BadRequest("The request body looks like multipart form data, but its Content-Type has no boundary.")
    model = form_field(body, boundary, b"model")
    if model is None or not model.strip():
        raise BadRequest("The request must name a model: the form field 'model' is missing or empty.", param="model")
    stream = form_field(body, boundary, b"stream")
    obj: dict[str, Any] = {"model": model, _FORM: boundary}
    return obj, model, stream is not None and stream.strip().lower() == "true"


# Where parse_form() leaves the boundary, for with_model().
_FORM = "\x00form-boundary"


def _boundary(content_type: bytes | None) -> bytes | None:
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        return None
    for param in content_type.split(b";")[1:]:
        name, _, value = param.strip().partition(b"=")
        if name.lower() == b"boundary" and value:
            return value.strip(b'"')
    return None


def _form_parts(body: bytes, boundary: bytes) -> Iterator[tuple[bytes, int, int]]:
    """(headers, start, end) of each part: the part's bytes are body[start:end], never copied here."""
    delimiter = b"--" + boundary
    position = body.find(delimiter)
    while position >= 0:
        start = position + len(delimiter)
        if body[start : start + 2] == b"--":
            return
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            return
        following = body.find(b"\r\n" + delimiter, head_end + 4)
        if following < 0:
            return
        yield body[start:head_end], head_end + 4, following
        position = following + 2


def form_field(body: bytes, boundary: bytes, name: bytes) -> str | None:
    """A text field of multipart form data; the search skips over file parts without copying them."""
    wanted = b'name="' + name + b'"'
    for headers, start, end in _form_parts(body, boundary):
        if wanted in headers and b"filename=" not in headers:
            return body[start:end].decode("utf-8", "replace")
    return None


def with_model(body: bytes, obj: dict[str, Any], model: str) -> bytes:
    """The body with another model's name (an alias's, a fallback's): re-encoded JSON, or the form field replaced."""
    boundary = obj.get(_FORM)
    if boundary is None:
        return orjson.dumps({**obj, "model": model})
    for headers, start, end in _form_parts(body, boundary):
        if b'name="model"' in headers and b"filename=" not in headers:
            return body[:start] + model.encode() + body[end:]
    return body


def response_id(first_bytes: bytes) -> str | None:
    """A /v1/responses answer's id: the JSON body's `id`, or the first event's `response.id`."""
    text = first_bytes.lstrip()
    if text.startswith(b"{"):
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        ident = doc.get("id") if isinstance(doc, dict) else None
        return ident if isinstance(ident, str) else None
    for line in text.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            response = event.get("response") if isinstance(event, dict) else None
            ident = response.get("id") if isinstance(response, dict) else None
            return ident if isinstance(ident, str) else None
    return None


def _answer_failed(writer: Writer, failed: Failed) -> None:
    """The client gets what failed (the replica's own answer, or the router's error); the access log, how."""
    if (entry := current_entry.get()) is not None:
        if isinstance(failed.error, UpstreamTimeout):
            entry.outcome = "timeout"
        elif isinstance(failed.error, UpstreamResetError):
            entry.outcome = "upstream_reset"
    writer.answer(failed.reply())


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

    def refusal(self, request: Request) -> Reply | None:
        """check() as the client port's head check: the 401 to answer, or None."""
        try:
            self.check(request)
        except Unauthorized as exc:
            return error_response(exc)
        return None


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
            expose_replica=config.expose_replica_header,
        )
        self._max_attempts = config.max_attempts
        # The models routed by session or prompt prefix: how their requests are keyed.
        self._affinity = {
            name: Affinity(model) for name, model in config.models.items() if model.routing in ("session", "prefix")
        }
        # Scale from zero, per model: how long a request may be held, and how many at once.
        self.cold_start = {name: m.cold_start_seconds for name, m in config.models.items() if m.cold_start_seconds}
        self.max_held = {name: m.max_held for name, m in config.models.items()}
        self.waker: Waker | None = None
        self._queue_timeout = config.queue_timeout_seconds
        self._created = int(started_at if started_at is not None else time.time())
        # The POST paths routed by the model they name (config routed_paths).
        self.routed = frozenset(config.routed_paths)
        # Headers never passed to a replica as the client sent them: its key,
        # and X-Request-Id, which the router sets (the client's, checked, or its own).
        self._forwarded = HeaderFilter(self.keys.drop | REQUEST_ID)
        # Response id -> the replica that made it and keeps it, least recently used first.
        self.responses: OrderedDict[str, str] = OrderedDict()
        self._remembered = config.remembered_responses
        self.access_log: AccessLog | None = None

    # Routes -------------------------------------------------------------------

    async def dispatch(self, request: Request, writer: Writer) -> None:
        """The client port's one handler: every answer goes through `writer`."""
        path = request.path
        method = request.method
        if method == "POST" and path in self.routed:
            await self.inference(request, writer)
        elif path.startswith("/v1/responses/"):
            await self.stored_response(request, writer)
        elif method == "GET" or method == "HEAD":  # noqa: PLR1714 (two compares beat a tuple here)
            if path == "/v1/models":
                writer.answer(self.models(request))
            elif path.startswith("/v1/models/"):
                writer.answer(self.model_info(request, path[len("/v1/models/") :]))
            else:
                writer.answer(self.not_found(request))
        else:
            writer.answer(self.not_found(request))

    def refuse_keyless_body(self, request: Request) -> Reply | None:
        """The client port's head check while api_keys is set: a request that announces a body
        and has no valid key is refused from its head (401), before a byte of the body is read
        or a 100 sent, so that clients without a key never hold the bodies' shared budget.

        The server answers it in its turn and closes; its access-log line is written here.
        """
        reply = self.keys.refusal(request)
        if reply is not None and self.access_log is not None:
            entry = Entry(request.request_id.decode("ascii"), request.peer, request.method, request.path, 0)
            entry.status = reply.status
            # The body's bytes, as a stream counts them: the head is the server's to write, later.
            entry.bytes_out = len(reply.body)
            self.access_log.write(entry)
        return reply

    async def dispatch_logged(self, request: Request, writer: Writer) -> None:
        """dispatch(), with the request's line written to the access log when it ends."""
        assert self.access_log is not None
        ident = request.request_id.decode("ascii")
        entry = Entry(ident, request.peer, request.method, request.path, len(request.body))
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
            self.access_log.write(entry)

    async def inference(self, request: Request, writer: Writer) -> None:
        started = time.perf_counter()
        try:
            if self.keys.active:
                self.keys.check(request)
            body = request.body
            if body.startswith(b"--"):
                # Multipart form data (the audio endpoints): the model is a form field.
                obj, requested, stream = parse_form(body, request.header(b"content-type"))
            else:
                obj, requested, stream = parse_request(body)
            if (entry := current_entry.get()) is not None:
                entry.model = requested
            model = self.routes.aliases.get(requested, requested)
            if not self.pool.serves(model) and model not in self.routes.declared and model not in self.pool.ever_served:
                # Known is declared, or served now or at any time since start:
                # a model scaled to zero is unavailable (503), not unknown (404).
                self.pool.tallies.unserved_request(model)
                raise ModelNotFound(
                    f"The model {quoted(requested)} does not exist or no replica serves it.", param="model"
                )
            pinned: Replica | None = None
            if request.path == "/v1/responses" and (previous := obj.get("previous_response_id")) is not None:
                pinned = self._maker_of(previous)
            await self._serve(request, writer, obj, requested, model, stream, pinned)
        except ClientFacingError as exc:
            writer.answer(error_response(exc))
            return
        self.metrics.observe_duration(model, time.perf_counter() - started)

    async def stored_response(self, request: Request, writer: Writer) -> None:
        """GET /v1/responses/{id} (and its cancel, input_items): only the replica that made it knows it."""
        try:
            if self.keys.active:
                self.keys.check(request)
            ident, _, rest = request.path[len("/v1/responses/") :].partition("/")
            allowed = {"": ("GET", "DELETE"), "cancel": ("POST",), "input_items": ("GET",)}.get(rest)
            if allowed is None or not ident:
                writer.answer(self.not_found(request))
                return
            if request.method not in allowed:
                body = error_body(
                    405,
                    f"Method {request.method} is not allowed on {request.path}.",
                    "invalid_request_error",
                    "method_not_allowed",
                )
                writer.answer(Reply(405, body, [JSON, (b"Allow", ", ".join(allowed).encode())]))
                return
            replica = self._maker_of(ident)
            if (entry := current_entry.get()) is not None:
                entry.model = entry.served_model = replica.model
            headers = self._forwarded.framed(request.raw_headers)
            if entry is not None:
                entry.attempts += 1
                entry.replica = replica.id
            try:
                failed = await self.forwarder.attempt(
                    request, writer, replica, request.body, headers, replica.model, False
                )
            finally:
                self.pool.release(replica)
            if failed is not None:
                _answer_failed(writer, failed)
        except ClientFacingError as exc:
            writer.answer(error_response(exc))

    def _maker_of(self, response_id: object) -> Replica:
        """The replica that made `response_id`, acquired; 404 if this router did not see it, or it is gone."""
        replica_id = self.responses.get(response_id) if isinstance(response_id, str) else None
        if replica_id is None:
            raise ResponseNotFound(
                f"No response {quoted(response_id)} was made through this router (or it is no longer remembered).",
                param="previous_response_id",
            )
        self.responses.move_to_end(response_id)  # type: ignore[arg-type]
        replica = self.pool.acquire_this(replica_id)
        if replica is None:
            raise ResponseNotFound(
                f"The replica that made response {quoted(response_id)} ({replica_id}) is gone "
                "or takes no new requests; the response is lost with it.",
                param="previous_response_id",
            )
        return replica

    def remember(self, replica: Replica) -> Callable[[bytes], None]:
        """What reads a /v1/responses answer's id (its JSON body's, or its first event's) and keeps it."""

        def seen(first_bytes: bytes) -> None:
            ident = response_id(first_bytes)
            if ident is None or len(ident) > MAX_NAME_BYTES:
                # The memory is bounded in entries; an id past any engine's
                # (vLLM's are 37 characters) would unbound it in bytes.
                return
            responses = self.responses
            responses[ident] = replica.id
            responses.move_to_end(ident)
            while len(responses) > self._remembered:
                responses.popitem(last=False)

        return seen

    def models(self, request: Request) -> Reply:
        try:
            self.keys.check(request)
        except ClientFacingError as exc:
            return error_response(exc)
        data = [self._model_doc(name) for name in self._catalog()]
        return Reply(200, orjson.dumps({"object": "list", "data": data}), [JSON])

    def model_info(self, request: Request, name: str) -> Reply:
        """GET /v1/models/{model}: one entry of the catalog (the SDK's models.retrieve)."""
        try:
            self.keys.check(request)
            if name not in self._catalog():
                raise ModelNotFound(f"The model {quoted(name)} does not exist or no replica serves it.", param="model")
        except ClientFacingError as exc:
            return error_response(exc)
        return Reply(200, orjson.dumps(self._model_doc(name)), [JSON])

    def _catalog(self) -> list[str]:
        names = self.pool.models()
        names += [alias for alias, target in self.routes.aliases.items() if self.pool.serves(target)]
        return names

    def _model_doc(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "router"}

    def not_found(self, request: Request) -> Reply:
        if request.path in self.routed or request.path == "/v1/models":
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
        self,
        request: Request,
        writer: Writer,
        obj: dict[str, Any],
        requested: str,
        model: str,
        stream: bool,
        pinned: Replica | None = None,
    ) -> None:
        """Each model of the chain in turn, each up to max_attempts replicas, until one answers.

        A failure that reached the client, or one the replica may have acted
        on, ends it there; a refused connection or a busy answer moves on.
        `pinned`: the one replica that must answer (it made the response this
        request continues), already acquired: no other is tried.
        """
        # Framed once for every attempt; only Host and the length differ.
        headers = self._forwarded.framed(request.raw_headers)
        entry = current_entry.get()
        if pinned is not None:
            await self._serve_pinned(request, writer, obj, requested, stream, headers, pinned)
            return
        # A /v1/responses answer's id is remembered with its replica: requests
        # that continue it must reach the replica that keeps it.
        remembering = request.path == "/v1/responses"
        chain = (model, *self.routes.fallbacks.get(model, ()))
        last: Failed | None = None
        only_connect_failures = True
        only_loading = True
        for target in chain:
            # The replica must see the name it serves (vLLM refuses an alias or
            # another model's name); only then is the body re-encoded.
            body = request.body if target == requested else with_model(request.body, obj, target)
            avoid: Replica | None = None
            refused: set[Replica] = set()
            key = None
            if self._affinity and (affinity := self._affinity.get(target)) is not None:
                key = affinity.key(request, obj)
            for attempt in range(self._max_attempts):
                replica = self.pool.acquire(target, avoid, refused, key)
                if replica is None:
                    if not self.pool.saturated(target):
                        break
                    replica = await self._wait(target, avoid, refused, key)
                    if replica is None:
                        break
                if attempt or target != model:
                    self._count_attempt(model, target, attempt)
                if entry is not None:
                    entry.attempts += 1
                    entry.served_model = target
                    entry.replica = replica.id
                try:
                    failed = await self.forwarder.attempt(
                        request,
                        writer,
                        replica,
                        body,
                        headers,
                        target,
                        stream,
                        None,
                        self.remember(replica) if remembering else None,
                    )
                finally:
                    self.pool.release(replica)
                if failed is None:
                    return
                last = failed
                only_connect_failures = only_connect_failures and failed.connect_failure
                only_loading = only_loading and failed.loading
                if not failed.retryable:
                    _answer_failed(writer, failed)
                    return
                avoid = replica
                refused.add(replica)
        cold_start = self.cold_start.get(model)
        if cold_start and (last is None or only_loading):
            # Scaled to zero, or every replica still loading: held until one answers.
            await self._hold(request, writer, obj, requested, model, stream, headers, cold_start)
            return
        writer.answer(self._unserved(requested, chain, last, only_connect_failures))

    async def _serve_pinned(
        self,
        request: Request,
        writer: Writer,
        obj: dict[str, Any],
        requested: str,
        stream: bool,
        headers: bytes,
        pinned: Replica,
    ) -> None:
        """A request that continues a response: to the replica that made it, and no other."""
        entry = current_entry.get()
        if entry is not None:
            entry.attempts += 1
            entry.served_model = pinned.model
            entry.replica = pinned.id
        body = request.body if pinned.model == requested else with_model(request.body, obj, pinned.model)
        try:
            failed = await self.forwarder.attempt(
                request, writer, pinned, body, headers, pinned.model, stream, None, self.remember(pinned)
            )
        finally:
            self.pool.release(pinned)
        if failed is not None:
            _answer_failed(writer, failed)

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
        pool.asked(model)
        retry_after = max(1, min(30, round(cold_start / 4)))
        max_held = self.max_held[model]
        if pool.held(model) >= max_held:
            pool.tallies.hold_ended(model, "overflow")
            raise ModelCold(
                f"The model '{model}' is starting, and {max_held} requests already wait for it; retry shortly.",
                retry_after=retry_after,
            )
        if self.waker is not None:
            self.waker.held(model)
        body = request.body if model == requested else with_model(request.body, obj, model)
        # The hold ends every try it hands out and counts how the request left it.
        async with pool.hold(model, cold_start) as hold:
            while True:
                try:
                    replica = await hold.replica()
                except HoldEnded:
                    raise ModelCold(
                        f"The router is shutting down; the model '{model}' was still starting.", retry_after=1
                    ) from None
                if replica is None:
                    raise ModelCold(
                        f"No replica of '{model}' answered within {cold_start:g} s; it is still starting.",
                        retry_after=retry_after,
                    )
                held = hold.held_seconds()
                if (entry := current_entry.get()) is not None:
                    entry.held_seconds = held
                    entry.attempts += 1
                    entry.served_model = model
                    entry.replica = replica.id
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
                if failed is not None and failed.retryable and failed.loading:
                    # Still loading: the next try after a pause, this request first in line.
                    hold.still_loading()
                    continue
                if failed is None:
                    hold.answered()
                self.metrics.observe_held(model, held)
                if failed is not None:
                    _answer_failed(writer, failed)
                return

    async def _wait(
        self, model: str, avoid: Replica | None, refused: set[Replica], key: bytes | None
    ) -> Replica | None:
        """Every replica of `model` is at its limit: wait in its queue for one (503 after the timeout)."""
        started = time.perf_counter()
        replica, timed_out = await self.pool.acquire_or_wait(
            model, avoid, refused, wait_seconds=self._queue_timeout, key=key
        )
        # A wait that ended in a 503 counts too: it is the wait the client saw.
        self.metrics.observe_queue_wait(model, time.perf_counter() - started)
        if timed_out:
            self.pool.tallies.refused_overloaded(model)
            raise Overloaded(
                f"Every replica of '{model}' is at its concurrency limit; waited {self._queue_timeout:g} s.",
                retry_after=1,
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
            # Demand is counted under the model the name leads to (an alias's model).
            self.pool.tallies.unserved_request(chain[0])
            names = " or ".join(repr(name) for name in chain)
            detail = f" (last failure: {last.error.message})" if last is not None else ""
            return error_response(
                NoReplicaAvailable(
                    f"No replica of {names} can serve the request now{detail}.",
                    retry_after=self.pool.retry_after(chain),
                )
            )
        return last.reply()
