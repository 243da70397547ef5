"""A fake replica's answers when it runs a simulated engine (router.tools.fake.engine): tokens as the engine makes them.

Chat and completions go into the engine's queue; a stream writes each token
as the engine emits it, a whole answer waits for the last one. Usage says
the prompt's tokens and those the prefix cache held, as vLLM reports them.
A client that leaves takes its sequence out of the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from router.tools.fake.engine import Engine, Sequence
from router.tools.fake.prefix import prompt_of
from router.tools.fake.streams import usage

if TYPE_CHECKING:
    from router.tools.fake.replica import FakeReplica


async def simulated(
    replica: FakeReplica, engine: Engine, request: web.Request, obj: dict[str, Any], kind: str
) -> web.StreamResponse:
    """Answer `obj` (a chat or completions request) with the engine's tokens."""
    seq = engine.submit(prompt_of(obj), replica.tokens(obj))
    asked = obj.get("max_tokens") or obj.get("max_completion_tokens")
    answer = _Answer(
        seq,
        asked if isinstance(asked, int) and not isinstance(asked, bool) else None,
        kind == "chat",
        f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{replica.name}-{replica.next_id()}",
        int(time.time()),
        obj.get("model", replica.models[0]),
        {**replica.headers(), **replica.load_headers(request)},
    )
    try:
        if obj.get("stream") is True:
            return await answer.stream(request, bool((obj.get("stream_options") or {}).get("include_usage")))
        return await answer.whole()
    finally:
        # Gone before its end (the client left, the task cancelled): out of the engine.
        engine.abort(seq)


@dataclass(frozen=True, slots=True)
class _Answer:
    """One answer's framing, as vLLM frames chat and completions, whole or streamed."""

    seq: Sequence
    # The request's own limit of tokens (None: it set none): an answer that reaches it ends with
    # "length", one that ends before (the fake's answer is `behaviour.tokens` long) with "stop".
    limit: int | None
    chat: bool
    ident: str
    created: int
    model: str
    headers: dict[str, str]

    def _doc(self, choices: list[dict[str, Any]], *, whole: bool = False, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.chat else "text_completion"
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _choice(self, text: str | None, finish: str | None, *, whole: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}

    def _usage(self, count: int) -> dict[str, Any]:
        return usage((self.seq.prompt_tokens, self.seq.cached_tokens), count)

    def _finish(self, count: int) -> str:
        return "length" if self.limit is not None and count >= self.limit else "stop"

    async def whole(self) -> web.Response:
        count = 0
        while await self.seq.tokens.get() is not None:
            count += 1
        text = "".join(f"tok{i} " for i in range(count))
        doc = self._doc([self._choice(text, self._finish(count), whole=True)], whole=True, usage=self._usage(count))
        return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=self.headers)

    async def stream(self, request: web.Request, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", **self.headers}
        )
        # As vLLM's (Starlette's StreamingResponse): the head at once, the first token after the prefill.
        await resp.prepare(request)
        if self.chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            await resp.write(_event(self._doc([role])))
        count = 0
        while (token := await self.seq.tokens.get()) is not None:
            await resp.write(_event(self._doc([self._choice(f"tok{token} ", None)])))
            count += 1
        await resp.write(_event(self._doc([self._choice(None if self.chat else "", self._finish(count))])))
        if include_usage:
            await resp.write(_event(self._doc([], usage=self._usage(count))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"
