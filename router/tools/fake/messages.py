"""Anthropic's Messages API as vLLM and llama.cpp serve it: /v1/messages (whole or streamed) and count_tokens.

A stream is Anthropic's own events (`event: message_start`, `content_block_delta`,
..., `message_stop`), not OpenAI's chunks, so that a test can see them cross the
router untouched; errors are Anthropic-shaped, `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

if TYPE_CHECKING:
    from router.tools.fake.replica import FakeReplica


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _input_tokens(obj: dict[str, Any]) -> int:
    """A count the tests can predict: one token per whitespace-separated word of every text."""
    words = 0
    system = obj.get("system")
    if isinstance(system, str):
        words += len(system.split())
    for message in obj.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words += len(content.split())
        elif isinstance(content, list):
            words += sum(len(str(block.get("text", "")).split()) for block in content if isinstance(block, dict))
    return words


def _error(status: int, kind: str, message: str) -> web.Response:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class Messages:
    """The Messages endpoints of one replica."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    async def create(self, request: web.Request) -> web.StreamResponse:
        replica = self.replica
        replica.active += 1
        try:
            obj, failure = await replica.begin(request)
            if failure is not None:
                return failure
            problem = self._check(obj)
            if problem is not None:
                return problem
            n = replica.tokens({"max_tokens": obj.get("max_tokens")})
            ident = f"msg_{replica.name}_{replica.next_id()}"
            usage_in = _input_tokens(obj)
            if obj.get("stream") is True:
                return await self._stream(request, obj, ident, n, usage_in)
            doc = {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "model": obj["model"],
                "content": [{"type": "text", "text": "".join(f"tok{i} " for i in range(n))}],
                "stop_reason": "max_tokens" if replica.cut_short(obj, n) else "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": usage_in, "output_tokens": n},
            }
            return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=replica.headers())
        except asyncio.CancelledError:
            replica.cancelled += 1
            raise
        finally:
            replica.active -= 1
            replica.completed += 1

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        obj, failure = await self.replica.begin(request)
        if failure is not None:
            return failure
        problem = self._check(obj)
        if problem is not None:
            return problem
        body = orjson.dumps({"input_tokens": _input_tokens(obj)})
        return web.Response(body=body, content_type="application/json", headers=self.replica.headers())

    def _check(self, obj: dict[str, Any]) -> web.Response | None:
        """What vLLM checks before it runs: a model it serves, and messages."""
        if obj.get("model") not in self.replica.models:
            return _error(404, "not_found_error", f"The model `{obj.get('model')}` does not exist.")
        if not isinstance(obj.get("messages"), list):
            return _error(400, "invalid_request_error", "messages: Field required")
        return None

    async def _stream(
        self, request: web.Request, obj: dict[str, Any], ident: str, n: int, usage_in: int
    ) -> web.StreamResponse:
        replica = self.replica
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **replica.headers()})
        await resp.prepare(request)
        message = {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": obj["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": usage_in, "output_tokens": 0},
        }
        await resp.write(_event("message_start", {"message": message}))
        await resp.write(_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        await resp.write(_event("ping", {}))
        delay = replica.behaviour.token_delay
        reset = replica.behaviour.reset_after_chunks
        for i in range(n):
            if reset is not None and i >= reset:
                # Reset mid-stream, as an engine that dies does.
                if request.transport is not None:
                    request.transport.abort()
                return resp
            if delay:
                await asyncio.sleep(delay)
            delta = {"index": 0, "delta": {"type": "text_delta", "text": f"tok{i} "}}
            await resp.write(_event("content_block_delta", delta))
        await resp.write(_event("content_block_stop", {"index": 0}))
        reason = "max_tokens" if self.replica.cut_short(obj, n) else "end_turn"
        stop = {"delta": {"stop_reason": reason, "stop_sequence": None}, "usage": {"output_tokens": n}}
        await resp.write(_event("message_delta", stop))
        await resp.write(_event("message_stop", {}))
        await resp.write_eof()
        return resp
