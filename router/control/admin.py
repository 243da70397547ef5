"""The admin API: the control plane's and Prometheus's door (admin_listen).

Reads answer from usage snapshots; the one that a control plane polls,
GET /api/v1/usage, answers bytes serialized once per tick. Mutating calls need
the admin token when one is configured. None of these routes exist on the
client port.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.control.endpoints import BadPush, PushedSets
from router.control.fleet import Fleet, FleetUnavailable
from router.control.openapi import DOCUMENT
from router.control.sinks.latest import LatestSink
from router.control.sinks.rates import RateSink
from router.control.status import fleet_status
from router.core.usage.snapshots import EngineReading, UsageSnapshot

log = logging.getLogger("router.control.admin")

ADMIN_BODY_LIMIT = 8 * 1024 * 1024
DEFAULT_IDLE_FOR = 1800.0
_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_GUARDED_ALL = _MUTATING | {"GET", "HEAD"}
# The kubelet's probes carry no token: open whatever admin_token_reads says.
_PROBES = frozenset({"/healthz", "/readyz"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _error(status: int, message: str, code: str) -> web.Response:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return _json({"error": {"message": message, "type": type_, "param": None, "code": code}}, status)


def replica_rows(snapshot: UsageSnapshot, now: float) -> list[dict[str, Any]]:
    """GET /api/v1/replicas: unknown is `last_used: null` and a negative idle_seconds.

    `quiet_for_seconds` is the proven quiet bound as of the snapshot (the
    rule of `router ctl idle` and status): idle for T when it is at least T.
    """
    rows = []
    proven = snapshot.quiet_for()
    for r in snapshot.replicas:
        quiet = r.quiet_seconds(now)
        quiet_for = proven.get(r.id)
        rows.append(
            {
                "id": r.id,
                "model": r.model,
                "url": r.url,
                "state": r.state,
                "in_flight": r.in_flight,
                # Requests that reached the replica; connections to it that failed are apart.
                "requests": r.requests,
                "connects_failed": r.connects_failed,
                # Attempts that got no usable answer (connect, reset, timeout, a refusing status).
                "errors": sum(r.errors.values()),
                "last_used": r.last_used,
                "idle_seconds": -1.0 if quiet is None else round(quiet, 3),
                "quiet_for_seconds": None if quiet_for is None else round(quiet_for, 3),
                "watching_since": r.watching_since,
                "labels": dict(r.labels),
                # What its engine says of its load (docs/routing.md), as of the snapshot; null: nothing read.
                "engine": r.engine,
                "engine_load": engine_load_json(r.engine_load, now),
                "saturated": r.saturated,
                # false: its /v1/models does not list the model sent to it (its engine answers 404); null: not read.
                "serves_model": r.serves_model,
                # The node it runs on and its fabric (null: not said): `fabrics` in /api/v1/status.
                "node": r.node,
                "fabric": r.fabric,
            }
        )
    return rows


def engine_load_json(load: EngineReading | None, now: float) -> dict[str, Any] | None:
    if load is None:
        return None
    return {
        "waiting": load.waiting,
        "running": load.running,
        "kv_cache_usage": load.kv,
        "age_seconds": round(max(0.0, now - load.read_at), 3),
        "source": load.source,
    }


class Admin:
    """The admin API's handlers: usage, replicas, endpoints, state, status, metrics, health; the token on mutating
    calls, and on reads too with admin_token_reads."""

    def __init__(
        self,
        fleet: Fleet,
        latest: LatestSink,
        *,
        admin_token: str,
        admin_token_reads: bool = False,
        is_ready: Callable[[], bool],
        rates: RateSink,
        wall: Callable[[], float] = time.time,
        exclusive_source: str | None = None,
    ) -> None:
        """`exclusive_source`: the name of a source that owns the replica set (discovery): pushes get 409."""
        self.fleet = fleet
        self._exclusive_source = exclusive_source
        self.latest = latest
        self._token = admin_token.encode()
        # The token on reads too: the usage map, the replicas' URLs and labels, metrics.
        self._guarded = _GUARDED_ALL if admin_token_reads else _MUTATING
        self._is_ready = is_ready
        self._rates = rates
        self._wall = wall
        # Pushed sets, read from what changed since the last (endpoints.py).
        self._pushed = PushedSets()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=ADMIN_BODY_LIMIT, middlewares=[self._auth])
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/api/v1/usage", self.usage)
        r.add_get("/api/v1/replicas", self.replicas)
        r.add_get("/api/v1/endpoints", self.get_endpoints)
        r.add_put("/api/v1/endpoints", self.put_endpoints)
        r.add_post("/api/v1/replicas/{id}/state", self.set_state)
        r.add_get("/api/v1/status", self.status)
        r.add_get("/api/v1/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._token and request.method in self._guarded and request.path not in _PROBES:
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode("utf-8", "surrogateescape"), self._token
            ):
                return _error(401, "This call needs 'Authorization: Bearer <admin token>'.", "invalid_admin_token")
        try:
            return await handler(request)
        except FleetUnavailable as exc:
            return _error(503, str(exc), "workers_unavailable")
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"The request body exceeds {ADMIN_BODY_LIMIT} bytes.", "request_too_large")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error(exc.status, exc.reason, "http_error")
            raise

    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self._is_ready():
            return _json({"status": "ready"})
        return _json({"status": "not ready"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = await self.fleet.metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def usage(self, request: web.Request) -> web.Response:
        body = self.latest.usage_body
        if body is None:
            return _error(503, "No usage snapshot has been taken yet.", "not_ready")
        return web.Response(body=body, content_type="application/json")

    async def replicas(self, request: web.Request) -> web.Response:
        return _json(replica_rows(await self.fleet.snapshot(), self._wall()))

    async def status(self, request: web.Request) -> web.Response:
        raw = request.query.get("idle_for", str(DEFAULT_IDLE_FOR))
        try:
            idle_for = float(raw)
        except ValueError:
            idle_for = -1.0
        if not 0 <= idle_for < float("inf"):
            return _error(400, f"idle_for must be a number of seconds >= 0, got {raw!r}.", "invalid_idle_for")
        with_replicas = request.query.get("replicas", "false")
        if with_replicas not in ("true", "false"):
            return _error(400, f"replicas must be true or false, got {with_replicas!r}.", "invalid_replicas")
        snapshot = await self.fleet.snapshot()
        summary = fleet_status(
            snapshot, now=snapshot.generated_at, idle_for=idle_for, rates=self._rates.per_second(snapshot)
        )
        doc = summary.as_json()
        if with_replicas == "true":
            # The rows of GET /api/v1/replicas from the same snapshot: a reader of both (ctl top)
            # sees one instant, its totals and its rows in agreement.
            doc["replicas"] = replica_rows(snapshot, self._wall())
        return _json(doc)

    async def openapi(self, request: web.Request) -> web.Response:
        return _json(DOCUMENT)

    async def get_endpoints(self, request: web.Request) -> web.Response:
        return _json({"replicas": [c.as_json() for c in await self.fleet.configs()]})

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _BadBody(f"The body is not valid JSON: {exc}") from exc

    async def put_endpoints(self, request: web.Request) -> web.Response:
        if self._exclusive_source is not None:
            return _error(
                409,
                f"The replica set comes from {self._exclusive_source}; pushes would fight it. "
                "Drains (POST /api/v1/replicas/{id}/state) still work.",
                "replica_set_owned",
            )
        try:
            configs = self._pushed.read(await request.read())
        except BadPush as exc:
            return _error(400, str(exc), "invalid_endpoints")
        diff = await self.fleet.set_replicas(configs)
        log.info(
            "endpoint push: %d added, %d removed, %d changed",
            len(diff["added"]),
            len(diff["removed"]),
            len(diff["changed"]),
        )
        return _json(diff)

    async def set_state(self, request: web.Request) -> web.Response:
        replica_id = request.match_info["id"]
        try:
            body = await self._body(request)
        except _BadBody as exc:
            return _error(400, str(exc), "invalid_state")
        state = body.get("state") if isinstance(body, dict) else None
        if state not in ("draining", "ready") or not isinstance(body, dict) or set(body) != {"state"}:
            return _error(400, 'The body must be {"state": "draining"} or {"state": "ready"}.', "invalid_state")
        answer = await self.fleet.set_draining(replica_id, state == "draining")
        if answer is None:
            return _error(404, f"No replica with id {replica_id!r}.", "replica_not_found")
        return _json(answer)


class _BadBody(Exception):
    """A body that cannot be applied; becomes a 400 that names the problem."""
