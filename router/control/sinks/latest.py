"""Keeps the newest snapshot and its usage document, serialized once per tick."""

from __future__ import annotations

from router.control.sinks.document import UsageDocument
from router.core.usage.snapshots import UsageSnapshot


class LatestSink:
    """GET /api/v1/usage answers from here: polling it costs the router nothing
    but a write of bytes that were encoded when the tick happened."""

    name = "latest"

    def __init__(self, document: UsageDocument | None = None) -> None:
        """`document`: shared with the push, so that the body is built once per tick for both."""
        self.document = document if document is not None else UsageDocument()
        self.snapshot: UsageSnapshot | None = None
        self.usage_body: bytes | None = None

    def publish(self, snapshot: UsageSnapshot) -> None:
        body = self.document.body(snapshot)
        self.snapshot = snapshot
        self.usage_body = body
