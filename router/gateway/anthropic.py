"""Anthropic's Messages API: its errors in its own shape, on its own paths.

An Anthropic client (the official SDK, Claude-style agents) reads an error as
`{"type": "error", "error": {"type", "message"}}` and a stream's failure as an
`event: error`. The router's errors are made OpenAI-shaped in one place
(answers.py); on the Anthropic paths (router.core.config.engines.ANTHROPIC_PATHS) the
request's Writer is wrapped in `AnthropicWriter`, which gives every error answer
that Anthropic's shape as it is written: the router's own, and a replica's that
lacks it (vLLM's already has it and passes untouched). Nothing else changes, and
no other path pays for it.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from router.gateway.answers import JSON, content_encoding
from router.http.messages import Reply
from router.http.pipe import Pipe
from router.http.writer import Meter, Writer

# The error types of Anthropic's API reference, by status; any other 4xx is an invalid
# request and any other 5xx an API error.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def reshaped(body: bytes, status: int) -> bytes | None:
    """An error body in Anthropic's shape; None when it has it already, or cannot be read as JSON text."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    message = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            if parsed.get("type") == "error" and isinstance(error.get("type"), str):
                return None
            message = error["message"]
        elif isinstance(error, str):
            message = error
        elif isinstance(parsed.get("message"), str):
            message = parsed["message"]
    if message is None:
        message = body.decode("utf-8", "replace").strip()[:4096] or f"The replica answered {status}."
    return error_body(status, message)


class AnthropicWriter:
    """A request's Writer (router.http.writer), its error answers written in Anthropic's shape."""

    __slots__ = ("_writer",)

    def __init__(self, writer: Writer) -> None:
        self._writer = writer

    @property
    def meter(self) -> Meter | None:
        return self._writer.meter

    @meter.setter
    def meter(self, meter: Meter | None) -> None:
        self._writer.meter = meter

    @property
    def started(self) -> bool:
        return self._writer.started

    def answer(self, reply: Reply) -> None:
        if reply.status >= 400 and content_encoding(reply.headers) is None:
            body = reshaped(reply.body, reply.status)
            if body is not None:
                headers = [h for h in reply.headers if h[0].lower() != b"content-type"]
                headers.append(JSON)
                reply = Reply(reply.status, body, headers, reply.reason)
        self._writer.answer(reply)

    def start(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], *, length: int | None = None
    ) -> None:
        self._writer.start(status, reason, headers, length=length)

    def write(self, data: bytes) -> bool:
        return self._writer.write(data)

    def body_sink(self) -> Callable[[bytes], bool]:
        return self._writer.body_sink()

    def end(self) -> None:
        self._writer.end()

    def abort(self, last_words: bytes = b"") -> None:
        if last_words:
            # The forwarder's error event for a broken stream, `data: {"error": {...}}`,
            # as Anthropic's stream says it: an `error` event.
            start = last_words.find(b"data: ")
            prefix = last_words[:start] if start > 0 else b""
            body = reshaped(last_words[start + 6 :].strip(), 502) if start >= 0 else None
            if body is not None:
                last_words = prefix + b"event: error\ndata: " + body + b"\n\n"
        self._writer.abort(last_words)

    def close_after(self) -> None:
        self._writer.close_after()

    async def drain(self) -> None:
        await self._writer.drain()

    def switch(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> Pipe | None:
        return self._writer.switch(status, reason, headers)
