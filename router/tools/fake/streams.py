"""Streamed answers as vLLM frames them, and the writer that sends them as the switches say.

The framing: a role chunk (chat), one chunk per token, a finish chunk, a
usage chunk when the client asked for one, `[DONE]`. The writer paces the
tokens (a fixed delay, or a per-model range drawn for each token), aborts
the connection after K chunks, or sends raw bytes split exactly where a
test wants them.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
from aiohttp import web

from router.tools.fake.switches import Behaviour


def usage(prompt: tuple[int, int], n: int) -> dict[str, Any]:
    """The usage object of an answer of `n` tokens to a prompt of (tokens, of which cached)."""
    prompt_tokens, cached_tokens = prompt
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def stream_chunks(
    kind: str, ident: str, created: int, model: str, n: int, *, usage: dict[str, Any] | None, finish: str = "length"
) -> list[bytes]:
    """vLLM's framing: a role chunk (chat), one chunk per token, a finish chunk, [DONE]."""
    out: list[bytes] = []

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        doc: dict[str, Any] = {
            "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + ident,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage is not None:
            doc["usage"] = usage
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    if kind == "chat":
        out.append(event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
    for i in range(n):
        if kind == "chat":
            out.append(event([{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]))
        else:
            out.append(event([{"index": 0, "text": f"tok{i} ", "logprobs": None, "finish_reason": None}]))
    if kind == "chat":
        out.append(event([{"index": 0, "delta": {}, "finish_reason": finish}]))
    else:
        out.append(event([{"index": 0, "text": "", "logprobs": None, "finish_reason": finish}]))
    if usage is not None:
        out.append(event([], usage))
    out.append(b"data: [DONE]\n\n")
    return out


async def write_stream(
    request: web.Request,
    behaviour: Behaviour,
    chunks: list[bytes],
    *,
    tokens: int,
    pace: tuple[float, float] | None,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Send `chunks` (of an answer of `tokens` tokens) as an event stream, as `behaviour` says."""
    b = behaviour
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    if b.raw_stream is not None:
        for piece in b.raw_stream:
            await resp.write(piece)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp
    for index, chunk in enumerate(chunks):
        if b.reset_after_chunks is not None and index >= b.reset_after_chunks:
            if request.transport is not None:
                request.transport.abort()
            return resp
        # The pause comes before each token's chunk and the finish chunk, not the role chunk.
        if 0 < index < tokens + 1:
            if pace is not None:
                await asyncio.sleep(random.uniform(*pace))
            elif b.token_delay:
                await asyncio.sleep(b.token_delay)
        await resp.write(chunk)
    await resp.write_eof()
    return resp
