"""OpenTelemetry's side of `[tracing]`: a span per inference request, exported over OTLP/HTTP.

The request path knows only router.gateway.traces' interface; this module
implements it with the official SDK (`opentelemetry-sdk`) and exporter
(`opentelemetry-exporter-otlp-proto-http`), the optional extra
`router[tracing]`, imported only when `[tracing]` is configured.

A request's trace (docs/tracing.md):

    chat m                      SERVER, the request as the client sees it; the client's
    │                           traceparent, when it sent one, is its parent
    ├── router.queue            INTERNAL, each wait for a slot at the limits
    ├── router.hold             INTERNAL, a hold for a cold model
    └── chat m                  CLIENT, each attempt on a replica; its traceparent is
        └── (the engine's)      the one the replica is sent, so vLLM's spans join here

Spans are handed to a BatchSpanProcessor: the exporter runs in the SDK's own
thread, its queue bounded (`max_queue_size`, past it spans are dropped), each
export bounded (`timeout_seconds`). A collector down, slow or failing costs
spans, never a request. An error of the SDK itself is logged once and the
request goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from router.core.config.settings import Config
from router.core.config.tracing import TracingConfig
from router.core.errors import ConfigError

if TYPE_CHECKING:
    from router.core.pool.replicas import Replica
    from router.gateway.access_log import Entry
    from router.gateway.dispatch import Proxy
    from router.http.messages import Request

log = logging.getLogger("router.tracing")

INSTALL = "pip install 'router[tracing]'"
# gen_ai.operation.name of each routed path (the GenAI semantic conventions' values); another
# path's is its last segment. gen_ai.provider.name: the API the path speaks.
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}
_ANTHROPIC = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
# The SDK's spans take wall-clock nanoseconds.
_NS = 1_000_000_000
# A traceparent of version 00 (W3C Trace Context): trace id, parent id, flags; all-zero ids are invalid.
_TRACEPARENT = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def check_installed(config: Config) -> None:
    """With `[tracing]` configured, the extra must be installed: else one line saying how."""
    if config.tracing is None:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: PLC0415
        import opentelemetry.sdk.trace  # noqa: F401, PLC0415
    except ImportError as exc:
        raise ConfigError(
            f"{config.source}: tracing: [tracing] needs OpenTelemetry's SDK and OTLP/HTTP exporter, "
            f"which are not installed (no module {exc.name!r}): {INSTALL}"
        ) from None


def start_tracing(proxy: Proxy, config: Config, stack: contextlib.AsyncExitStack) -> None:
    """With `[tracing]`, `proxy` traces its inference requests from now on; the exporter is flushed
    and stopped with `stack`. Without, nothing."""
    settings = config.tracing
    if settings is None:
        return
    check_installed(config)
    tracer = OtelTracer(settings)
    proxy.trace_with(tracer, config)

    async def close() -> None:
        # In a thread: a flush to a slow collector takes up to its timeout, and the loop goes on meanwhile.
        await asyncio.to_thread(tracer.close)

    stack.push_async_callback(close)


def endpoint_of(settings: TracingConfig) -> str:
    """The URL spans are posted to: as given, or a collector's base URL with OTLP's /v1/traces."""
    return settings.endpoint if urlsplit(settings.endpoint).path not in ("", "/") else settings.endpoint + "/v1/traces"


class OtelTracer:
    """router.gateway.traces.Tracer on OpenTelemetry's SDK: one provider, its batch exporter, W3C propagation."""

    def __init__(self, settings: TracingConfig) -> None:
        # Imported here: with tracing off nothing of OpenTelemetry is loaded.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased  # noqa: PLC0415
        from opentelemetry.trace import SpanKind, set_span_in_context  # noqa: PLC0415
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415
        from opentelemetry.trace.status import Status, StatusCode  # noqa: PLC0415

        self.kinds = SpanKind
        self.in_context = set_span_in_context
        self.error = Status(StatusCode.ERROR)
        self.propagator = TraceContextTextMapPropagator()
        # A client's traceparent decides (its trace is whole, or not at all); else sample_ratio, in begin():
        # what reaches the SDK without a sampled parent is a request already chosen.
        self.ratio = settings.sample_ratio
        self.provider = TracerProvider(
            sampler=ParentBased(ALWAYS_ON),
            resource=Resource.create({"service.name": settings.service_name}),
            shutdown_on_exit=False,
        )
        exporter = OTLPSpanExporter(
            endpoint=endpoint_of(settings), headers=dict(settings.headers), timeout=settings.timeout_seconds
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=settings.max_queue_size,
                max_export_batch_size=min(512, settings.max_queue_size),
                export_timeout_millis=settings.timeout_seconds * 1000,
            )
        )
        self.tracer = self.provider.get_tracer("router")
        self._failed = False

    def begin(self, request: Request) -> RequestTraceImpl | Unsampled:
        """The request's SERVER span, begun now, the client's traceparent its parent when it sent a valid one.

        A request not sampled (its client's traceparent says so, or sample_ratio
        passed it over) makes no span: the SDK is not asked (a third of a short
        request's instructions), and its attempts are sent a traceparent of the
        same trace with the sampled flag off, as the SDK would send.
        """
        sent = request.header(b"traceparent")
        parent = None
        if sent is not None and (found := _TRACEPARENT.fullmatch(sent.strip())) is not None:
            trace_id, parent_id, flags = found.groups()
            if trace_id.strip(b"0") and parent_id.strip(b"0"):
                if not int(flags, 16) & 1:
                    return Unsampled(trace_id, request.header(b"tracestate"))
                carrier = {"traceparent": sent.strip().decode("ascii")}
                state = request.header(b"tracestate")
                if state is not None:
                    carrier["tracestate"] = state.decode("latin-1")
                parent = self.propagator.extract(carrier)
        if parent is None and (self.ratio < 1.0 and random.random() >= self.ratio):
            return Unsampled(b"%032x" % (random.getrandbits(128) or 1), None)
        path = request.path
        operation = _OPERATIONS.get(path) or path.rsplit("/", 1)[-1]
        provider = "anthropic" if path in _ANTHROPIC else "openai"
        try:
            span = self.tracer.start_span(
                operation,
                context=parent,
                kind=self.kinds.SERVER,
                attributes={
                    "gen_ai.operation.name": operation,
                    "gen_ai.provider.name": provider,
                    "http.request.method": request.method,
                    "url.path": path,
                    "router.request.id": request.request_id.decode("ascii"),
                },
            )
        except Exception as exc:  # noqa: BLE001 (the SDK's fault is never the request's: served untraced)
            self.failed(exc)
            return Unsampled(b"%032x" % (random.getrandbits(128) or 1), None)
        return RequestTraceImpl(self, span, operation, provider)

    def failed(self, exc: Exception) -> None:
        """The SDK raised: said once, and the request goes on."""
        if not self._failed:
            self._failed = True
            log.warning("tracing: a span could not be made or ended (said once): %r", exc)

    def close(self) -> None:
        """Flush what is queued, within the exporter's timeout, and stop its thread (the SDK's shutdown)."""
        self.provider.shutdown()


class Unsampled:
    """router.gateway.traces.RequestTrace of a request not sampled: no span, only its trace's context passed on."""

    __slots__ = ("_lines",)

    def __init__(self, trace_id: bytes, state: bytes | None) -> None:
        # The parent id a replica sees: any, as long as it is not zero (nothing records it).
        parent = b"%016x" % (random.getrandbits(64) or 1)
        lines = b"traceparent: 00-" + trace_id + b"-" + parent + b"-00\r\n"
        if state is not None:
            lines += b"tracestate: " + state + b"\r\n"
        self._lines = lines

    def attempt(self, replica: Replica, model: str) -> bytes:
        return self._lines

    def outcome(self, outcome: str, status: int, ttfb: float | None, reason: str) -> None:
        pass

    def waited(self, priority: str, seconds: float, served: bool) -> None:
        pass

    def held(self, began_ago: float, seconds: float, outcome: str) -> None:
        pass

    def end(self, entry: Entry) -> None:
        pass


class RequestTraceImpl:
    """router.gateway.traces.RequestTrace: one request's spans, made as the request goes."""

    __slots__ = ("_attempt", "_operation", "_provider", "_root", "_tracer")

    def __init__(self, tracer: OtelTracer, root: Any, operation: str, provider: str) -> None:
        self._tracer = tracer
        self._root = root
        self._operation = operation
        self._provider = provider
        # The attempt under way (its span open until its outcome, or the answer's end).
        self._attempt: Any = None

    def attempt(self, replica: Replica, model: str) -> bytes:
        tracer = self._tracer
        try:
            self._close_attempt()
            root = self._root
            span = root
            if root.is_recording():
                parts = urlsplit(replica.base_url)
                span = self._attempt = tracer.tracer.start_span(
                    f"{self._operation} {model}",
                    context=tracer.in_context(root),
                    kind=tracer.kinds.CLIENT,
                    attributes={
                        "gen_ai.operation.name": self._operation,
                        "gen_ai.provider.name": self._provider,
                        "gen_ai.request.model": model,
                        "server.address": parts.hostname or "",
                        "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                        "router.replica.id": replica.id,
                    },
                )
            # Not sampled: the root's context still goes on (its flags say so), as W3C asks.
            carrier: dict[str, str] = {}
            tracer.propagator.inject(carrier, context=tracer.in_context(span))
            return "".join(f"{name}: {value}\r\n" for name, value in carrier.items()).encode("latin-1")
        except Exception as exc:  # noqa: BLE001 (the SDK's failure must not fail the request)
            tracer.failed(exc)
            return b""

    def outcome(self, outcome: str, status: int, ttfb: float | None, reason: str) -> None:
        span = self._attempt
        if span is None:
            return
        try:
            if status:
                span.set_attribute("http.response.status_code", status)
            if ttfb is not None:
                span.set_attribute("router.ttfb_seconds", ttfb)
                span.add_event("first_byte")
            if outcome == "answered" and status < 400:
                # Open until the answer ends (or breaks off): the engine's spans fall inside it.
                return
            error = reason or (str(status) if status else outcome)
            span.set_attribute("error.type", error)
            span.set_status(self._tracer.error)
            if outcome != "answered":
                span.set_attribute("router.outcome", outcome)
            span.end()
            self._attempt = None
        except Exception as exc:  # noqa: BLE001
            self._tracer.failed(exc)

    def waited(self, priority: str, seconds: float, served: bool) -> None:
        self._child("router.queue", seconds, seconds, {"router.priority": priority, "router.queue.served": served})

    def held(self, began_ago: float, seconds: float, outcome: str) -> None:
        self._child("router.hold", began_ago, seconds, {"router.hold.outcome": outcome})

    def _child(self, name: str, began_ago: float, seconds: float, attributes: dict[str, Any]) -> None:
        tracer = self._tracer
        root = self._root
        if not root.is_recording():
            return
        try:
            start = time.time_ns() - int(began_ago * _NS)
            span = tracer.tracer.start_span(
                name,
                context=tracer.in_context(root),
                kind=tracer.kinds.INTERNAL,
                attributes=attributes,
                start_time=start,
            )
            span.end(end_time=start + int(seconds * _NS))
        except Exception as exc:  # noqa: BLE001
            tracer.failed(exc)

    def _close_attempt(self) -> None:
        span = self._attempt
        if span is not None:
            self._attempt = None
            span.end()

    def end(self, entry: Entry) -> None:
        root = self._root
        try:
            self._close_attempt()
            if not root.is_recording():
                root.end()
                return
            model = entry.model
            if model is not None:
                root.update_name(f"{self._operation} {model}")
            found = {
                "gen_ai.request.model": model,
                "gen_ai.response.model": entry.served_model,
                "gen_ai.usage.input_tokens": entry.prompt_tokens,
                "gen_ai.usage.output_tokens": entry.completion_tokens,
                "gen_ai.usage.cache_read.input_tokens": entry.cached_tokens,
                "http.response.status_code": entry.status or None,
                "router.tenant": entry.tenant,
                "router.attempts": entry.attempts,
                "router.replica.id": entry.replica,
                "router.priority": entry.priority,
                "router.queue.wait_seconds": entry.queued_seconds,
                "router.hold.seconds": entry.held_seconds,
                "router.ttfb_seconds": entry.ttfb_seconds,
                "router.outcome": entry.outcome,
            }
            root.set_attributes({key: value for key, value in found.items() if value is not None})
            if entry.status >= 500 or entry.outcome not in ("ok", "client_gone"):
                root.set_attribute("error.type", entry.outcome if entry.outcome != "ok" else str(entry.status))
                root.set_status(self._tracer.error)
            root.end()
        except Exception as exc:  # noqa: BLE001
            self._tracer.failed(exc)
