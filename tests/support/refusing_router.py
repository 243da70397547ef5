"""A router's admin API that fences a replica but refuses to be told it sleeps: the second phase failing.

Real routers cannot be made to refuse that step on cue; this stand-in takes
`{"state": "draining"}` and `{"state": "ready"}`, lists the replica drained,
and answers `{"state": "asleep", ...}` 503, recording every body it was sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web


class RefusingRouter:
    """The stand-in's admin address, and every state body it was sent, in order."""

    def __init__(self, url: str, posted: list[dict[str, Any]]) -> None:
        self.admin_url = url
        self.posted = posted

    @property
    def states(self) -> list[str]:
        return [str(body.get("state")) for body in self.posted]


@contextlib.asynccontextmanager
async def refusing_router(replica_id: str) -> AsyncIterator[RefusingRouter]:
    posted: list[dict[str, Any]] = []
    fenced = {"id": replica_id, "state": "drained", "in_flight": 0}

    async def state(request: web.Request) -> web.Response:
        body = await request.json()
        posted.append(body)
        if body.get("state") == "asleep":
            error = {"message": "Not now.", "type": "server_error", "param": None, "code": "unavailable"}
            return web.json_response({"error": error}, status=503)
        return web.json_response({**fenced, "state": "drained" if body.get("state") == "draining" else "ready"})

    async def replicas(request: web.Request) -> web.Response:
        return web.json_response([fenced])

    app = web.Application()
    app.router.add_post("/api/v1/replicas/{id}/state", state)
    app.router.add_get("/api/v1/replicas", replicas)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield RefusingRouter(f"http://{host}:{port}", posted)
    finally:
        await runner.cleanup()
