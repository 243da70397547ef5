"""Keeps the newest snapshot and its usage document, serialized once per tick."""

from __future__ import annotations

import orjson

from router.core.usage import UsageSnapshot


class LatestSink:
    """GET /api/v1/usage answers from here: polling it costs the router nothing
    but a write of bytes that were encoded when the tick happened."""

    name = "latest"

    def __init__(self) -> None:
        self.snapshot: UsageSnapshot | None = None
        self.usage_body: bytes | None = None

    def publish(self, snapshot: UsageSnapshot) -> None:
        body = orjson.dumps(snapshot.usage_document())
        self.snapshot = snapshot
        self.usage_body = body
