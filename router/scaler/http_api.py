"""The scaler's HTTP port: /healthz, /metrics, and POST /wake for the routers' `wake_url`.

POST /wake takes the body a router sends when it holds a request for a cold
model, `{"router", "model", "held", "since"}` (with the admin token as a
bearer when one is set): the model turns active on every open
StreamIsActive at once, and a round starts at once. /metrics is read from
the poller's figures at scrape time; /healthz answers 200 while the process
runs, with the same figures as JSON.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from router.scaler.board import Board
from router.scaler.poller import Poller

WAKE_BODY_LIMIT = 64 * 1024


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class PollCollector(Collector):
    """The scaler's polls of the routers, as series for /metrics."""

    def __init__(self, poller: Poller, board: Board) -> None:
        self._poller = poller
        self._board = board

    def describe(self) -> list[Metric]:
        # An empty describe() keeps registration from calling collect() early.
        return []

    def collect(self) -> Iterator[Metric]:
        poller = self._poller
        yield CounterMetricFamily("router_scaler_polls", "Poll rounds over every router.", value=poller.rounds)
        sleeps = CounterMetricFamily(
            "router_scaler_sleeps", "Replicas put to sleep for sleepAfter, by result (ok, failed).", labels=["result"]
        )
        for result, count in sorted(poller.sleeper.results.items()):
            sleeps.add_metric([result], count)
        yield sleeps
        yield CounterMetricFamily(
            "router_scaler_incomplete_polls",
            "Poll rounds in which a router did not answer (every model stays active).",
            value=poller.incomplete_rounds,
        )
        yield CounterMetricFamily(
            "router_scaler_poll_errors",
            "Poll rounds that broke (logged); the last view stays.",
            value=poller.round_failures,
        )
        failures = CounterMetricFamily(
            "router_scaler_poll_failures",
            "Polls of one router that failed, timed out or answered nonsense.",
            labels=["server"],
        )
        up = GaugeMetricFamily(
            "router_scaler_router_up", "1 if the router answered the newest round.", labels=["server"]
        )
        for server, stats in sorted(poller.servers.items()):
            failures.add_metric([server], stats.failures)
            up.add_metric([server], 1.0 if stats.ok else 0.0)
        yield failures
        yield up
        age = poller.last_complete_age()
        if age is not None:
            # No sample until a round was complete: unknown, not 0.
            yield GaugeMetricFamily(
                "router_scaler_last_complete_merge_age_seconds",
                "Seconds since the last round in which every router answered.",
                value=age,
            )
        yield GaugeMetricFamily(
            "router_scaler_poll_duration_seconds", "Time the newest round took.", value=poller.last_round_seconds
        )
        yield GaugeMetricFamily(
            "router_scaler_streams",
            "StreamIsActive calls open (one per ScaledObject trigger).",
            value=self._board.streams,
        )
        yield from self._told()

    def _told(self) -> Iterator[Metric]:
        """What each ScaledObject was last told, and the metric GetMetrics answers for its model now."""
        board = self._board
        active = GaugeMetricFamily(
            "router_scaler_active",
            "1 if the ScaledObject was last told active (keep or bring up its replicas), 0 if inactive.",
            labels=["scaled_object", "model"],
        )
        for name, told in sorted(board.told.items()):
            active.add_metric([name, told.model], 1.0 if told.active else 0.0)
        yield active
        requests = GaugeMetricFamily(
            "router_scaler_requests",
            "Requests in flight plus held over every router: what GetMetrics answers for the model.",
            labels=["model"],
        )
        view = board.view
        # No sample while GetMetrics answers UNAVAILABLE: the value is unknown, not 0.
        if view is not None and view.reporting:
            for model in sorted({told.model for told in board.told.values()}):
                requests.add_metric([model], view.facts(model).requests)
        yield requests


class HttpApi:
    """The scaler's HTTP side: health, metrics, and the wake calls from routers."""

    def __init__(self, poller: Poller, board: Board, *, token: str, registry: CollectorRegistry) -> None:
        self.poller = poller
        self.board = board
        self._token = token.encode()
        self.registry = registry
        registry.register(PollCollector(poller, board))
        self.wake_calls = Counter(
            "router_scaler_wake_calls",
            "POST /wake calls by result: ok, unauthorized, invalid, full.",
            ["result"],
            registry=registry,
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=WAKE_BODY_LIMIT)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/wake", self.wake)
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        poller = self.poller
        age = poller.last_complete_age()
        return _json(
            {
                "status": "alive",
                "polls": poller.rounds,
                "incomplete_polls": poller.incomplete_rounds,
                "last_complete_merge_age_seconds": None if age is None else round(age, 3),
                "streams": self.board.streams,
                "wakes_pending": self.board.pending_wakes(),
                "scaled_objects": [
                    {"name": name, "model": told.model, "active": told.active, "reason": told.reason}
                    for name, told in sorted(self.board.told.items())
                ],
                "routers": [
                    {"server": server, "ok": stats.ok, "failures": stats.failures, "last_error": stats.last_error}
                    for server, stats in sorted(poller.servers.items())
                ],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def wake(self, request: web.Request) -> web.Response:
        if self._token:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode("utf-8", "surrogateescape"), self._token
            ):
                self.wake_calls.labels("unauthorized").inc()
                return _json({"error": "this call needs 'Authorization: Bearer <admin token>'"}, 401)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return self._invalid(f"the body is not JSON: {exc}")
        except web.HTTPRequestEntityTooLarge:
            return self._invalid(f"the body exceeds {WAKE_BODY_LIMIT} bytes")
        if not isinstance(body, dict):
            return self._invalid('the body must be {"router", "model", "held", "since"}')
        model, router, held, since = body.get("model"), body.get("router", ""), body.get("held", 1), body.get("since")
        if not isinstance(model, str) or not model:
            return self._invalid("model: must be a non-empty string")
        if not isinstance(router, str):
            return self._invalid("router: must be a string")
        if not isinstance(held, int) or isinstance(held, bool) or held < 0:
            return self._invalid("held: must be an integer >= 0")
        if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
            return self._invalid("since: must be Unix seconds or null")
        if held > 0 and not self.board.wake(model, router, None if since is None else float(since)):
            self.wake_calls.labels("full").inc()
            return _json({"error": "too many wake calls held; the next round settles them"}, 503)
        self.poller.poke()
        self.wake_calls.labels("ok").inc()
        return _json({"status": "ok", "model": model})

    def _invalid(self, problem: str) -> web.Response:
        self.wake_calls.labels("invalid").inc()
        return _json({"error": problem}, 400)
