"""What the request path tells a request's trace when `[tracing]` is on: an interface, nothing more.

The OpenTelemetry side (spans, sampling, the exporter) is router.run.tracing's,
which the gateway never imports: with tracing off nothing of it is loaded and
the request path pays one check, the handler the server was given (`Proxy.dispatch_traced`
only when a tracer is set). A traced request carries its `RequestTrace` on its
access-log entry (`Entry.trace`), where the parts that already write down each
attempt, wait and hold find it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.core.pool.replicas import Replica
    from router.gateway.access_log import Entry
    from router.http.messages import Request

# What a traced request's replica is not sent as the client sent them: the router sends its own,
# the client's trace continued by the router's span (W3C Trace Context).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


class RequestTrace(Protocol):
    """One request's trace as it goes: its attempts, its waits, its hold; ended with its entry."""

    def attempt(self, replica: Replica, model: str) -> bytes:
        """An attempt on `replica` (for `model`) begins: the header lines it is sent (traceparent, tracestate)."""

    def outcome(self, outcome: str, status: int, ttfb: float | None, reason: str) -> None:
        """What the attempt under way came to (router.gateway.outcomes.Outcome's value), as the ledgers learn it."""

    def waited(self, priority: str, seconds: float, served: bool) -> None:
        """A wait for a slot at the limits ended now, after `seconds`; `served`: a slot came."""

    def held(self, began_ago: float, seconds: float, outcome: str) -> None:
        """A hold for a cold model that began `began_ago` seconds ago held the request `seconds`, with `outcome`."""

    def end(self, entry: Entry) -> None:
        """The request ended: what its entry says of it (status, models, tokens) closes the trace."""


class Tracer(Protocol):
    """Starts a request's trace, continuing the client's when its traceparent says one."""

    def begin(self, request: Request) -> RequestTrace:
        """The trace of `request`, begun now."""
