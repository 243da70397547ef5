"""The access log: one JSON line per request when it ends, written off the hot path.

Off by default (`access_log = ""`); `"-"` writes to standard output, a path
to that file, opened for appending and opened again on SIGHUP so that
logrotate can move it away (lines buffered before the signal go to the old
file, none is lost). Lines are gathered in memory and written together,
a few times a second or when 64 KiB have gathered: one write per batch,
never per request. A line holds what the operator needs to follow one
request (`Entry`), never a body and never a key.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING

import orjson

from router.core.clock import perf_counter

if TYPE_CHECKING:
    from router.gateway.traces import RequestTrace

log = logging.getLogger("router.access")

FLUSH_EVERY_SECONDS = 0.2
FLUSH_BYTES = 64 * 1024


class Entry:
    """One request's line, filled in as it goes by the proxy, the forwarder and the writer.

    The writer sees it as its meter (router.http's Meter: status, bytes_out);
    the gateway's code finds it through `current_entry`.
    """

    __slots__ = (
        "attempts",
        "bytes_in",
        "bytes_out",
        "cached_tokens",
        "client",
        "completion_tokens",
        "held_seconds",
        "hold_outcome",
        "id",
        "method",
        "model",
        "outcome",
        "path",
        "priority",
        "prompt_tokens",
        "queued_for",
        "queued_seconds",
        "replica",
        "served_model",
        "started",
        "status",
        "tenant",
        "trace",
        "ttfb_seconds",
    )

    def __init__(self, request_id: str, client: str, method: str, path: str, bytes_in: int) -> None:
        self.id = request_id
        self.client = client
        self.method = method
        self.path = path
        self.bytes_in = bytes_in
        self.started = perf_counter()
        self.model: str | None = None
        self.served_model: str | None = None
        self.replica: str | None = None
        self.status = 0
        self.bytes_out = 0
        self.attempts = 0
        self.held_seconds: float | None = None
        # The key's tenant (never the key); None before the key is checked.
        self.tenant: str | None = None
        # Set once the request waited in its model's queue at the limits: its
        # class, and how long it waited there (every wait of its attempts).
        self.priority: str | None = None
        self.queued_seconds: float | None = None
        # Why it waited in the router's queue: "limit" (max_in_flight...) or "engines" (saturated); None: it did not.
        self.queued_for: str | None = None
        # How a hold for a cold model ended (served, timeout, overflow, client_gone,
        # shutdown: router_hold_outcomes_total's outcomes); None if never held.
        self.hold_outcome: str | None = None
        self.ttfb_seconds: float | None = None
        # The tokens its answer said it took (router.gateway.tokens); None: it said nothing
        # readable (a stream whose client did not ask for usage), or nothing was answered.
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        # ok, client_gone, upstream_reset, stalled, timeout, error; overflow, shutdown (a hold's)
        self.outcome = "ok"
        # Its trace, when [tracing] is on and it is an inference request (router.gateway.traces).
        self.trace: RequestTrace | None = None

    def line(self, now: float) -> bytes:
        return orjson.dumps(
            {
                "time": round(time.time(), 3),
                "id": self.id,
                "client": self.client,
                "method": self.method,
                "path": self.path,
                "model": _clipped(self.model),
                "served_model": self.served_model,
                "replica": self.replica,
                "status": self.status,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "attempts": self.attempts,
                "held_seconds": None if self.held_seconds is None else round(self.held_seconds, 3),
                "tenant": self.tenant,
                "priority": self.priority,
                "queued_seconds": None if self.queued_seconds is None else round(self.queued_seconds, 4),
                "queued_for": self.queued_for,
                "hold": self.hold_outcome,
                "ttfb_seconds": None if self.ttfb_seconds is None else round(self.ttfb_seconds, 4),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
                "duration_seconds": round(now - self.started, 4),
                "outcome": self.outcome,
            }
        )


# The entry of the request whose handler runs, set once per logged request in
# its own task: the proxy and the forwarder fill in their fields without the
# entry passed down every call, nor hung on the HTTP layer's writer. None while
# the access log is off (no cost but a lookup).
current_entry: ContextVar[Entry | None] = ContextVar("current_entry", default=None)


# The name a client asked for is its own text, up to the body's size: a line
# keeps enough of it to recognise, so that one request cannot write a megabyte.
MAX_LOGGED_NAME = 256


def _clipped(name: str | None) -> str | None:
    if name is None or len(name) <= MAX_LOGGED_NAME:
        return name
    return f"{name[:MAX_LOGGED_NAME]}... ({len(name)} characters)"


class AccessLog:
    """The access log's file: lines gathered in memory and written a batch at a time, reopened on SIGHUP."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._fd = -1
        self._buffer: list[bytes] = []
        self._size = 0
        self._flusher: asyncio.TimerHandle | None = None
        self.open()

    def open(self) -> None:
        if self.target == "-":
            self._fd = sys.stdout.fileno()
        else:
            self._fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def reopen(self) -> None:
        """SIGHUP: what is gathered goes to the file as it was; then the path is opened anew."""
        self.flush()
        if self.target != "-":
            old, self._fd = self._fd, -1
            try:
                self.open()
            finally:
                if old >= 0:
                    os.close(old)

    def write(self, entry: Entry) -> None:
        line = entry.line(perf_counter())
        self._buffer.append(line)
        self._size += len(line) + 1
        if self._size >= FLUSH_BYTES:
            self.flush()
        elif self._flusher is None:
            self._flusher = asyncio.get_running_loop().call_later(FLUSH_EVERY_SECONDS, self.flush)

    def flush(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        if not self._buffer:
            return
        data = b"\n".join(self._buffer) + b"\n"
        self._buffer = []
        self._size = 0
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            log.error("the access log could not be written (%s): %s", self.target, exc)  # noqa: TRY400

    def close(self) -> None:
        self.flush()
        if self.target != "-" and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
