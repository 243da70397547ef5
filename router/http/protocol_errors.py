"""Protocol errors of either side, counted by reason and logged at most once a minute per reason.

A hostile client or a broken replica can cause thousands of these a second;
each must be visible (a counter the operator can alert on, a log line that
says what happened) without the log becoming the attack. The counts are read
by the Prometheus collector as `router_client_protocol_errors_total{reason}`
and `router_upstream_protocol_errors_total{reason}`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# Reasons are fixed strings chosen in the code, never taken from the wire:
# the label set stays bounded whatever a peer sends.
LOG_EVERY_SECONDS = 60.0

# A protocol error is its connection's or its replica's, never a request's: its
# line names no request id (router/run/logs.py), even when written in a request's
# task (the next request read, and refused, as one ends).
_NO_REQUEST = {"request_id": None}


class ProtocolErrors:
    """Counts per reason; the first of each reason per minute is logged with how many were not."""

    __slots__ = ("counts", "_clock", "_last_logged", "_log", "_level", "_unlogged")

    def __init__(
        self, log: logging.Logger, *, level: int = logging.INFO, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.counts: dict[str, int] = {}
        self._log = log
        self._level = level
        self._clock = clock
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def record(self, reason: str, detail: str, *, level: int | None = None) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = self._clock()
        last = self._last_logged.get(reason)
        if last is not None and now - last < LOG_EVERY_SECONDS:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._last_logged[reason] = now
        more = self._unlogged.pop(reason, 0)
        suffix = f" ({more} more since the last such line)" if more else ""
        self._log.log(self._level if level is None else level, "%s: %s%s", reason, detail, suffix, extra=_NO_REQUEST)


class ProtocolErrorCollector(Collector):
    """`router_client_protocol_errors_total{reason}` and `router_upstream_protocol_errors_total{reason}`."""

    def __init__(self, client_side: ProtocolErrors, upstream_side: ProtocolErrors) -> None:
        self.client_side = client_side
        self.upstream_side = upstream_side

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, documentation, errors in (
            (
                "router_client_protocol_errors",
                "Client connections refused or cut off for breaking HTTP/1.1 or a limit, by reason.",
                self.client_side,
            ),
            (
                "router_upstream_protocol_errors",
                "Replica answers that broke HTTP/1.1 or a limit, by reason.",
                self.upstream_side,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["reason"])
            for reason, count in sorted(errors.counts.items()):
                family.add_metric([reason], count)
            yield family
