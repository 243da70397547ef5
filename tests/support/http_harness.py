"""The client port's server alone: a real Server on 127.0.0.1 port 0 running a stub handler.

No router and no replica: the handler answers each request from the request
alone, as far as the server's tests need the router's routes (a chat request
for model "m" answered whole or streamed, the model list, 400, 404 and 405),
and notes what it was given (`Stub.seen`), so that a test can say what reached
the handler, in what order, with which target, headers and body. The error
answers the server makes itself are shaped by the function the router injects
(router.gateway.answers.server_error), so that they are the client port's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from router.gateway.answers import server_error
from router.http.messages import Reply, Request
from router.http.server import Server
from router.http.writer import Writer

JSON = (b"Content-Type", b"application/json")
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
LISTING = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})

Handler = Callable[[Request, Writer], Awaitable[None]]


@dataclass(frozen=True)
class Seen:
    """A request as the handler was given it (the server empties the body once it is answered)."""

    method: str
    target: bytes
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    request_id: bytes
    peer: str
    version_11: bool
    keep_alive: bool

    @classmethod
    def of(cls, request: Request) -> Seen:
        return cls(
            request.method,
            request.target,
            request.path,
            list(request.raw_headers),
            request.body,
            request.request_id,
            request.peer,
            request.version_11,
            request.keep_alive,
        )

    def names(self) -> set[bytes]:
        return {name.lower() for name, _ in self.headers}


def _error(status: int, message: str, code: str) -> Reply:
    return server_error(status, message, code=code)


class Stub:
    """The handler: the router's routes, as a stand-in that needs no replica.

    A chat request streams `max_tokens` events (at most `tokens`), each after
    `token_delay` seconds, when it asks for a stream, and is otherwise answered
    whole with that many completion tokens; `gate`, when given, holds every
    answer until it is set. An embeddings request is answered with `padding`
    bytes more than its JSON (an answer far over the sockets' buffers).
    """

    def __init__(
        self, *, tokens: int = 16, token_delay: float = 0.0, padding: int = 0, gate: asyncio.Event | None = None
    ) -> None:
        self.tokens = tokens
        self.token_delay = token_delay
        self.padding = padding
        self.gate = gate
        self.seen: list[Seen] = []

    @property
    def inference(self) -> list[Seen]:
        """The requests the router would have sent a replica: a POST to an inference path naming model m."""
        return [s for s in self.seen if s.method == "POST" and s.path in INFERENCE_PATHS and _model(s.body) == "m"]

    async def __call__(self, request: Request, writer: Writer) -> None:
        self.seen.append(Seen.of(request))
        if self.gate is not None:
            await self.gate.wait()
        path = request.path
        method = request.method
        if method == "POST" and path in INFERENCE_PATHS:
            await self._inference(request, writer, path)
        elif path == "/v1/models" and method in ("GET", "HEAD"):
            writer.answer(Reply(200, LISTING, [JSON]))
        elif path in INFERENCE_PATHS or path == "/v1/models":
            writer.answer(_error(405, f"Method {method} is not allowed on {path}.", "method_not_allowed"))
        else:
            writer.answer(_error(404, f"Unknown URL {path}.", "unknown_url"))

    async def _inference(self, request: Request, writer: Writer, path: str) -> None:
        try:
            obj: Any = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            obj = None
        model = obj.get("model") if isinstance(obj, dict) else None
        if not isinstance(model, str) or not model:
            writer.answer(_error(400, "The request must name a model.", "invalid_request"))
            return
        if model != "m":
            writer.answer(_error(404, f"The model {model!r} does not exist.", "model_not_found"))
            return
        assert isinstance(obj, dict)
        wanted = obj.get("max_tokens")
        count = min(wanted, self.tokens) if isinstance(wanted, int) and wanted > 0 else self.tokens
        if path == "/v1/embeddings":
            body = orjson.dumps({"object": "list", "data": [], "pad": "x" * self.padding})
            writer.answer(Reply(200, body, [JSON]))
        elif obj.get("stream") is True:
            await self._stream(writer, count)
        else:
            answer = {"object": "chat.completion", "choices": [], "usage": {"completion_tokens": count}}
            writer.answer(Reply(200, orjson.dumps(answer), [JSON]))

    async def _stream(self, writer: Writer, count: int) -> None:
        writer.start(200, b"OK", [(b"Content-Type", b"text/event-stream")])
        for i in range(count):
            if self.token_delay:
                # Real time: a replica that generates slowly, as the test asks.
                await asyncio.sleep(self.token_delay)
            if writer.write(b'data: {"object": "chat.completion.chunk", "token": %d}\n\n' % i):
                await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        writer.end()


def _model(body: bytes) -> str | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) else None


@dataclass
class Harness:
    """The client port's server, listening: what a test speaks to."""

    server: Server
    listener: asyncio.Server

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.sockets[0].getsockname()[:2]
        return host, port


@contextlib.asynccontextmanager
async def serving(handler: Handler, **settings: Any) -> AsyncIterator[Harness]:
    """A Server with `handler` listening on 127.0.0.1 port 0; `settings` are Server's keywords."""
    options: dict[str, Any] = {"max_body_bytes": 1 << 20, "header_timeout": 10.0, **settings}
    server = Server(handler, error=server_error, log_exception=_log_exception, **options)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    try:
        yield Harness(server, listener)
    finally:
        listener.close()
        await server.shutdown(0.5)
        await listener.wait_closed()


def _log_exception(message: str) -> None:
    import logging

    logging.getLogger("tests.support.http_harness").exception(message)


StartServer = Callable[..., Awaitable[Harness]]
