"""Chat, completions and embeddings: the requests a router routes most, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from router.tools.fake.prefix import look_up, prompt_of
from router.tools.fake.simulated import simulated
from router.tools.fake.streams import stream_chunks, usage, write_stream

if TYPE_CHECKING:
    from router.tools.fake.replica import FakeReplica


class Inference:
    """The inference endpoints of one replica; what they count and cache is the replica's."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "embeddings")

    async def _tracked(self, request: web.Request, kind: str) -> web.StreamResponse:
        replica = self.replica
        replica.active += 1
        try:
            obj, failure = await replica.begin(request)
            if failure is not None:
                return failure
            if kind == "embeddings":
                return self._embedding_answer(obj)
            if replica.engine is not None:
                return await simulated(replica, replica.engine, request, obj, kind)
            prompt = await self._prefill(obj, kind)
            if obj.get("stream") is True:
                return await self._stream(request, obj, kind, prompt)
            return self._whole(obj, kind, prompt)
        except asyncio.CancelledError:
            replica.cancelled += 1
            raise
        finally:
            replica.active -= 1
            replica.completed += 1

    async def _prefill(self, obj: dict[str, Any], kind: str) -> tuple[int, int]:
        """The prompt's tokens and how many of them the prefix cache held; the rest takes prefill time."""
        replica = self.replica
        b = replica.behaviour
        if not b.prefix_cache_blocks:
            return 4, 0
        text = prompt_of(obj)
        reply = "".join(f"tok{i} " for i in range(replica.tokens(obj)))
        answered = text + (f"<|assistant|>{reply}\n" if kind == "chat" else reply)
        size = b.cache_block_chars
        found = look_up(replica.kv_cache, b.prefix_cache_blocks, size, text, answered)
        # About four characters a token, as the tokenizers of English text make them.
        prompt_tokens = max(1, len(text) // 4)
        cached_tokens = min(prompt_tokens, found * size // 4)
        replica.cached_tokens += cached_tokens
        replica.prompt_tokens += prompt_tokens
        if b.prefill_seconds_per_token:
            await asyncio.sleep((prompt_tokens - cached_tokens) * b.prefill_seconds_per_token)
        return prompt_tokens, cached_tokens

    def _whole(self, obj: dict[str, Any], kind: str, prompt: tuple[int, int]) -> web.Response:
        replica = self.replica
        n = replica.tokens(obj)
        text = "".join(f"tok{i} " for i in range(n))
        model = obj.get("model", replica.models[0])
        ident = replica.next_id()
        finish = "length" if replica.cut_short(obj, n) else "stop"
        choice: dict[str, Any]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            doc = {
                "id": f"chatcmpl-{replica.name}-{ident}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage(prompt, n),
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            doc = {
                "id": f"cmpl-{replica.name}-{ident}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage(prompt, n),
            }
        return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=replica.headers())

    def _embedding_answer(self, obj: dict[str, Any]) -> web.Response:
        replica = self.replica
        inputs = obj.get("input", "")
        items = inputs if isinstance(inputs, list) else [inputs]
        size = replica.behaviour.embedding_size
        data = [
            {"object": "embedding", "index": i, "embedding": [round(0.1 * (i + 1) + j / 100, 4) for j in range(size)]}
            for i in range(len(items))
        ]
        doc = {
            "object": "list",
            "data": data,
            "model": obj.get("model", replica.models[0]),
            "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
        }
        return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=replica.headers())

    async def _stream(
        self, request: web.Request, obj: dict[str, Any], kind: str, prompt: tuple[int, int]
    ) -> web.StreamResponse:
        replica = self.replica
        n = replica.tokens(obj)
        model = obj.get("model", replica.models[0])
        chunks = stream_chunks(
            kind,
            f"{replica.name}-{replica.next_id()}",
            int(time.time()),
            model,
            n,
            usage=usage(prompt, n)
            if replica.behaviour.force_include_usage or (obj.get("stream_options") or {}).get("include_usage")
            else None,
            finish="length" if replica.cut_short(obj, n) else "stop",
        )
        try:
            return await write_stream(
                request,
                replica.behaviour,
                chunks,
                tokens=n,
                pace=replica.behaviour.paced.get(model),
                headers=replica.headers(),
            )
        except ConnectionError:
            # The reader went away mid-stream: what a real engine sees too.
            replica.cancelled += 1
            return web.StreamResponse()
