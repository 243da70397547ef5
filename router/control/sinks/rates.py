"""Keeps each model's request totals over the last minute, one point per tick."""

from __future__ import annotations

from collections import deque

from router.control.sinks.usage_maps import UsageMaps
from router.core.usage.snapshots import UsageSnapshot

WINDOW_SECONDS = 60.0


class RateSink:
    """Requests per second per model, from the difference between snapshots."""

    name = "rates"

    def __init__(self, window: float = WINDOW_SECONDS, maps: UsageMaps | None = None) -> None:
        """`maps`: shared with the other exporters; it keeps the requests per model from each snapshot's changes."""
        self.window = window
        self._maps = maps if maps is not None else UsageMaps()
        self._points: deque[tuple[float, dict[str, int]]] = deque()

    def publish(self, snapshot: UsageSnapshot) -> None:
        self._maps.follow(snapshot)
        self._points.append((snapshot.generated_at, dict(self._maps.requests)))
        # Keep one point older than the window, so that the rate spans all of it.
        while len(self._points) > 2 and self._points[1][0] <= snapshot.generated_at - self.window:
            self._points.popleft()

    def per_second(self, snapshot: UsageSnapshot) -> dict[str, float]:
        """Requests per second by model, from the oldest point in the window to `snapshot`."""
        now, now_totals = snapshot.generated_at, requests_by_model(snapshot)
        if not self._points:
            return {}
        then, old = self._points[0]
        span = now - then
        if span <= 0:
            return {}
        # A replica removed meanwhile takes its count along: never a negative rate.
        return {model: max(0, total - old.get(model, 0)) / span for model, total in now_totals.items()}


def requests_by_model(snapshot: UsageSnapshot) -> dict[str, int]:
    totals: dict[str, int] = {}
    for r in snapshot.replicas:
        totals[r.model] = totals.get(r.model, 0) + r.requests
    return totals
