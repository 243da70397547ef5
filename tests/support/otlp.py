"""A local OTLP/HTTP traces receiver written for the tests: it decodes the protobuf it gets, as a collector does.

`OtlpReceiver` listens on 127.0.0.1 port 0 (aiohttp), takes `POST /v1/traces`
bodies of `ExportTraceServiceRequest` (opentelemetry-proto's messages, the
test extra's), and keeps every span with its resource's attributes, its ids
as hex, and its attributes as plain values. Its `mode` makes it hostile:
`"slow"` never answers (an export waits out its timeout), `"fail"` answers
500 to everything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

# The span kinds' numbers in the protocol (opentelemetry/proto/trace/v1/trace.proto).
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS_ERROR = 2


def plain(value: AnyValue) -> Any:
    """An attribute's value as Python's."""
    which = value.WhichOneof("value")
    if which == "array_value":
        return [plain(item) for item in value.array_value.values]
    return None if which is None else getattr(value, which)


def attributes(items: Any) -> dict[str, Any]:
    return {item.key: plain(item.value) for item in items if isinstance(item, KeyValue)}


@dataclass
class Span:
    """One span as received: its ids in hex, as a traceparent writes them."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int
    start: int
    end: int
    events: list[str] = field(default_factory=list)


class OtlpReceiver:
    """The receiver and what it got: `spans`, and `posts` (bodies received, decoded or not)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self.headers: list[dict[str, str]] = []
        self.mode = "ok"
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.posts += 1
        self.headers.append(dict(request.headers))
        if self.mode == "slow":
            await asyncio.Event().wait()
        if self.mode == "fail":
            return web.Response(status=500, text="the collector is broken")
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource_spans in message.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        Span(
                            name=span.name,
                            kind=KINDS.get(span.kind, str(span.kind)),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes=attributes(span.attributes),
                            resource=resource,
                            status=span.status.code,
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            events=[event.name for event in span.events],
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def trace(self, trace_id: str) -> list[Span]:
        return [span for span in self.spans if span.trace_id == trace_id]


@pytest.fixture(name="otlp")
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    """A receiver, listening; stopped at the end."""
    receiver = OtlpReceiver()
    await receiver.start()
    yield receiver
    await receiver.stop()
