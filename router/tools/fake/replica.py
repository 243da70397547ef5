"""`FakeReplica`: one fake engine's aiohttp app, its routes, and what it records of what it saw.

The endpoints live with their concern (`inference`, `responses`, `echo`);
the replica holds the state they share: the switches (`behaviour`), the
requests seen, the counters a test waits on, the Responses API's store and
the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from router.tools.fake.echo import ECHOED, TRANSCRIBED, Echo
from router.tools.fake.engine import Engine
from router.tools.fake.exposition import ENGINES, metrics_page, orca_header, router_load, sglang_loads
from router.tools.fake.inference import Inference
from router.tools.fake.messages import Messages
from router.tools.fake.responses import ResponsesApi
from router.tools.fake.sleep import SleepMode
from router.tools.fake.switches import Behaviour, Seen

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Loop turns from the accept of a connection to its handler's connection_made (asyncio: two), and a margin.
_ACCEPT_TURNS = 4
_BACKLOG = 128


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets as aiohttp's TCPSite binds them: one per address of `host`, SO_REUSEADDR,
    and SO_REUSEPORT on a given port (a fake beside another one, or restarted while the old one dies)."""
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


@dataclass
class FakeReplica:
    """An OpenAI replica for the demo and the tests: real HTTP, made-up tokens, switches for every failure."""

    models: Sequence[str] = ("fake-model",)
    behaviour: Behaviour = field(default_factory=Behaviour)
    name: str = "fake"
    # Seconds an idle keep-alive connection stays open (uvicorn's default is 5).
    keepalive_timeout: float = 75.0
    record: bool = True
    # Reported to SGLang's and vLLM's routers, which otherwise fetch a tokenizer from a hub.
    tokenizer_path: str = ""
    seen: list[Seen] = field(default_factory=list)
    cancelled: int = 0
    # Reads of its load (/metrics, /v1/loads), which `seen` does not record.
    metrics_reads: int = 0
    # GET /health requests answered (the router's active checks), which `seen` does not record.
    health_checks: int = 0
    active: int = 0
    completed: int = 0
    url: str = ""
    # Responses this replica created, by id (the Responses API's store).
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The prefix cache (Behaviour.prefix_cache_blocks): block hashes, least recently used first.
    kv_cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    # Prompt tokens seen, and how many of them the prefix cache held.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Larger request bodies get 413: at least what a router in front lets through.
    max_body_bytes: int = 64 * 1024 * 1024
    # Fields of the model cards in this replica's /v1/models, as vLLM's carry them (max_model_len, root).
    card: dict[str, Any] = field(default_factory=dict)
    # As vLLM's --api-key: every /v1 path refused 401 without "Authorization: Bearer <key>" ("": none).
    api_key: str = ""
    # LoRA adapters loaded on its first model, listed in /v1/models as vLLM lists them (their base as `parent`).
    adapters: list[str] = field(default_factory=list)
    # A simulated engine (router.tools.fake.engine) that makes the tokens, and whose load
    # the replica reports under `engine_kind`'s names (router.tools.fake.exposition).
    engine: Engine | None = None
    engine_kind: str = "vllm"
    # vLLM's sleep API and SGLang's memory release (router.tools.fake.sleep); None: not served, as without
    # VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode.
    sleep: SleepMode | None = None
    _runner: web.AppRunner | None = None
    _listeners: list[socket.socket] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def app(self) -> web.Application:
        # aiohttp refuses a body of exactly client_max_size bytes.
        app = web.Application(client_max_size=self.max_body_bytes + 1, middlewares=[self._authenticated])
        inference, responses, echo = Inference(self), ResponsesApi(self), Echo(self)
        app.router.add_post("/v1/chat/completions", inference.chat)
        app.router.add_post("/v1/completions", inference.completions)
        app.router.add_post("/v1/embeddings", inference.embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/responses", responses.create)
        messages = Messages(self)
        app.router.add_post("/v1/messages", messages.create)
        app.router.add_post("/v1/messages/count_tokens", messages.count_tokens)
        app.router.add_get("/v1/responses/{id}", responses.stored)
        app.router.add_post("/v1/responses/{id}/cancel", responses.stored)
        app.router.add_get("/v1/responses/{id}/input_items", responses.stored)
        for path in ECHOED:
            app.router.add_post(path, echo.echo)
        for path in TRANSCRIBED:
            app.router.add_post(path, echo.transcribe)
        app.router.add_post("/v1/audio/speech", echo.speech)
        app.router.add_get("/v1/realtime", self._realtime)
        app.router.add_get("/health", self._health)
        if self.engine is not None:
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/v1/loads", self._loads)
            app.router.add_get("/get_load", self._router_load)
        # What SGLang's and vLLM's own routers probe before they route (bench/compare.py).
        app.router.add_get("/get_model_info", self._engine_info)
        app.router.add_get("/get_server_info", self._engine_info)
        app.router.add_get("/model_info", self._engine_info)
        app.router.add_get("/server_info", self._engine_info)
        if self.sleep is not None:
            self.sleep.add_routes(app, lambda: self.active)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None) -> str:
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, keepalive_timeout=self.keepalive_timeout, access_log=None
        )
        await self._runner.setup()
        # Its own listening sockets (TCPSite's, by hand), so that kill() can stop accepting before it closes them.
        self._listeners = [sock] if sock is not None else _listen(host, port)
        for listener in self._listeners:
            await web.SockSite(self._runner, listener).start()
        bound = self._runner.addresses[-1]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._listeners = []

    async def kill(self) -> None:
        """Stop as a killed engine does: the port refusing, every connection reset at once, nothing finished."""
        runner = self._runner
        if runner is None:
            return
        self._runner = None
        # Accepting stops first, and the port closes only once every connection accepted is
        # a handler. Closed at once, the port can leave behind a connection the loop accepted
        # the turn before and has no transport for yet: asyncio (3.11) then drops it unclosed
        # (Server._attach asserts the server is open), and the router's request on it waits
        # for an answer no killed engine keeps it waiting for.
        loop = asyncio.get_running_loop()
        for listener in self._listeners:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                # A loop that accepts otherwise (uvloop) makes each transport at the accept.
                loop.remove_reader(listener.fileno())
        for _ in range(_ACCEPT_TURNS):
            self._reset_connections(runner)
            await asyncio.sleep(0)
        self._reset_connections(runner)
        for site in list(runner.sites):
            await site.stop()
        self._listeners = []
        # With no connection left, the runner's graceful shutdown has nothing to wait for.
        await runner.cleanup()

    @staticmethod
    def _reset_connections(runner: web.AppRunner) -> None:
        if runner.server is not None:
            for handler in list(runner.server.connections):
                transport = handler.transport
                if transport is not None:
                    transport.abort()

    # What the endpoints share ---------------------------------------------------------

    async def begin(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        """Read and record an inference request, then apply the switches: its JSON object, or the answer instead."""
        body = await request.read()
        if self.record:
            self.remember(request, body)
        b = self.behaviour
        if b.stall:
            await asyncio.Event().wait()
        if b.first_token_delay:
            await asyncio.sleep(b.first_token_delay)
        if b.fail_status is not None:
            return {}, web.Response(status=b.fail_status, body=b.fail_body, content_type=b.fail_content_type)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {}, web.json_response(
                {"error": {"message": "bad json", "type": "invalid_request_error", "param": None, "code": None}},
                status=400,
            )
        if not isinstance(obj, dict):
            return {}, web.json_response(
                {"error": {"message": "not an object", "type": "invalid_request_error", "param": None, "code": None}},
                status=400,
            )
        model = obj.get("model")
        if model and not self.serves(model):
            # vLLM's answer to a name it does not serve (serving_engine.py, _check_model); no name is its own.
            return obj, web.json_response(
                {
                    "error": {
                        "message": f"The model `{model}` does not exist.",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                },
                status=404,
            )
        return obj, None

    def serves(self, model: object) -> bool:
        """Whether it answers requests naming `model`: one of its models or of its LoRA adapters."""
        return model in self.models or model in self.adapters

    def remember(self, request: web.Request, body: bytes) -> None:
        self.seen.append(Seen(request.path_qs, dict(request.headers), body))

    def headers(self) -> dict[str, str]:
        return {"X-Served-By": self.name, **self.behaviour.extra_headers}

    def received(self, body: bytes) -> dict[str, Any]:
        return {"served_by": self.name, "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest()}

    def tokens(self, obj: dict[str, Any]) -> int:
        """The tokens of an answer: what the request asks for, at most `behaviour.tokens`."""
        wanted = obj.get("max_tokens") or obj.get("max_completion_tokens")
        if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0:
            return min(wanted, self.behaviour.tokens)
        return self.behaviour.tokens

    @web.middleware
    async def _authenticated(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's AuthenticationMiddleware: the /v1 paths want the server's key; /health, /metrics do not."""
        key = self.api_key
        if key and request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self.sleep is not None and request.method == "POST" and request.path.startswith("/v1/"):
            asleep = await self.sleep.guard()
            if asleep is not None:
                return asleep
        return await handler(request)

    def cut_short(self, obj: dict[str, Any], n: int) -> bool:
        """Whether an answer of `n` tokens stopped at the request's limit (finish_reason "length", as an
        engine says it) rather than ending on its own ("stop"): the `openai` SDK's stream() and parse()
        helpers raise on "length"."""
        wanted = obj.get("max_tokens") or obj.get("max_completion_tokens")
        return isinstance(wanted, int) and not isinstance(wanted, bool) and 0 < wanted <= n

    def load_headers(self, request: web.Request) -> dict[str, str]:
        """vLLM's ORCA report, when the request asks for one and this replica is a simulated vLLM."""
        form = request.headers.get("endpoint-load-metrics-format")
        if not form or self.engine is None or self.engine_kind != "vllm":
            return {}
        value = orca_header(form, self.engine.report)
        return {} if value is None else {"endpoint-load-metrics": value}

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        self.metrics_reads += 1
        if self.engine_kind not in ENGINES:
            # An engine whose page broke (a test's switch).
            return web.Response(status=500, text="metrics unavailable")
        page = metrics_page(self.engine_kind, self.models[0], self.engine.report)
        return web.Response(body=page, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _loads(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        if self.engine_kind != "sglang":
            return web.Response(status=404)
        self.metrics_reads += 1
        return web.Response(body=sglang_loads(self.engine.report, time.time()), content_type="application/json")

    async def _router_load(self, request: web.Request) -> web.Response:
        """What vLLM's router polls for its power_of_two policy (exposition.router_load): a vLLM engine's only."""
        assert self.engine is not None
        if self.engine_kind != "vllm":
            return web.Response(status=404)
        self.metrics_reads += 1
        return web.Response(body=router_load(self.engine.report), content_type="application/json")

    def next_id(self) -> int:
        """A number for the next answer's id, unique within this replica."""
        return next(self._ids)

    # Its own endpoints ----------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.behaviour.fail_status is not None:
            return web.Response(status=503, text="unhealthy")
        return web.Response(text="ok")

    async def _realtime(self, request: web.Request) -> web.StreamResponse:
        """vLLM's realtime API over WebSocket: session.created first, then every message echoed back."""
        if self.record:
            self.remember(request, b"")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.active += 1
        try:
            created = {"type": "session.created", "model": request.query.get("model"), "served_by": self.name}
            await ws.send_bytes(orjson.dumps(created))
            async for message in ws:
                if message.type == web.WSMsgType.TEXT:
                    if message.data == "close":
                        await ws.close()
                    else:
                        await ws.send_str(message.data)
                elif message.type == web.WSMsgType.BINARY:
                    await ws.send_bytes(message.data)
        finally:
            self.active -= 1
            self.completed += 1
        return ws

    async def _engine_info(self, request: web.Request) -> web.Response:
        model = self.models[0]
        info = {"model_path": model, "tokenizer_path": self.tokenizer_path or model, "is_generation": True}
        return web.Response(body=orjson.dumps(info), content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        # A simulated engine says its name there, as vLLM, SGLang and llama.cpp do.
        owner = self.engine_kind if self.engine is not None else self.name
        data = [{"id": m, "object": "model", "created": 0, "owned_by": owner, **self.card} for m in self.models]
        base = self.models[0]
        data += [{"id": a, "object": "model", "created": 0, "owned_by": owner, "parent": base} for a in self.adapters]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")
