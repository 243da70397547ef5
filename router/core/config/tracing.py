"""`[tracing]`: OpenTelemetry traces of the requests, sent to an OTLP/HTTP endpoint (docs/tracing.md).

Absent, nothing of tracing is built or runs. Present, `endpoint` is required
(the collector's traces URL, as the OTLP/HTTP exporter posts to it:
`http://collector:4318/v1/traces`); the rest have defaults. Header values
(a collector's API key) are kept out of reprs, as the engines' keys are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.core.config import checks as check

TRACING_KEYS = frozenset({"endpoint", "service_name", "sample_ratio", "headers", "timeout_seconds", "max_queue_size"})
# A header name (RFC 9110 5.1: a token) and a value without control characters.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(r"[\x20-\x7e\t]*")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go, under which service name, how many requests are traced, and the exporter's bounds."""

    endpoint: str
    service_name: str = "router"
    # The share of requests traced (a client's sampled traceparent is followed: its decision stands).
    sample_ratio: float = 1.0
    # Sent with every export (a collector's key): never shown.
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # One export's bound, retries included; the exporter's thread, never a request, waits for it.
    timeout_seconds: float = 10.0
    # Spans kept for export at most; past it, new ones are dropped (a collector down or slow).
    max_queue_size: int = 2048


def parse_tracing(where: check.Where, value: object) -> TracingConfig:
    """The `[tracing]` table: one line naming the key for any mistake."""
    table: Mapping[str, Any] = check.table(where, "tracing", value, set(TRACING_KEYS))
    if "endpoint" not in table:
        raise where.error("tracing.endpoint", "is required in [tracing] (the collector's OTLP/HTTP traces URL)")
    endpoint = check.url(where, "tracing.endpoint", table["endpoint"])
    service = check.string(where, "tracing.service_name", table.get("service_name", "router"))
    ratio = check.number(where, "tracing.sample_ratio", table.get("sample_ratio", 1.0), minimum=0.0)
    if ratio > 1.0:
        raise where.error(
            "tracing.sample_ratio", f"must be between 0 and 1 (the share of requests traced), got {ratio:g}"
        )
    raw_headers = table.get("headers", {})
    if not isinstance(raw_headers, dict):
        raise where.error(
            "tracing.headers", f"must be a table of header names to values, got {check.type_name(raw_headers)}"
        )
    headers = []
    for name, item in raw_headers.items():
        if not _TOKEN.fullmatch(name):
            raise where.error(f"tracing.headers.{name}", "is not a header name")
        if not isinstance(item, str) or not _VALUE.fullmatch(item):
            raise where.error(f"tracing.headers.{name}", "must be a string of printable characters")
        headers.append((name, item))
    timeout = check.number(where, "tracing.timeout_seconds", table.get("timeout_seconds", 10.0), minimum=0.001)
    queue = int(
        check.number(where, "tracing.max_queue_size", table.get("max_queue_size", 2048), minimum=1, integer=True)
    )
    return TracingConfig(endpoint, service, ratio, tuple(headers), timeout, queue)
