"""A fake OpenAI replica: good enough to stand in for vLLM in tests, demo, bench.

It answers chat, completions (both streaming, in vLLM's chunk format),
embeddings and models, the Responses API (stored in memory, as engines keep
them: another replica does not know them), and the other endpoints vLLM and
SGLang serve (rerank, score, pooling, classify, tokenize, audio, images) with
an echo that says which replica served and what body arrived (its length and
SHA-256, so that a test can check it came byte for byte), and has switches for the shape of its answers
(tokens, delays) and for failures (a status code, a reset after K chunks, a
stall before the first byte, a short keep-alive). The switches live in a
mutable `Behaviour`, so a test can flip them while the replica runs, and the
replica records what it saw (requests, headers, cancellations).
"""

from __future__ import annotations

import argparse
import asyncio
import email.parser
import email.policy
import hashlib
import itertools
import os
import random
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvloop
from aiohttp import web


@dataclass
class Behaviour:
    tokens: int = 16
    # Seconds before the response head (the replica computing its first token).
    first_token_delay: float = 0.0
    # Seconds between streamed tokens.
    token_delay: float = 0.0
    # Answer every inference request with this status and body instead.
    fail_status: int | None = None
    fail_body: bytes = b'{"error": {"message": "fake failure", "type": "server_error", "param": null, "code": null}}'
    fail_content_type: str = "application/json"
    # Abort the connection after this many streamed chunks.
    reset_after_chunks: int | None = None
    # Never answer (until the client gives up).
    stall: bool = False
    embedding_size: int = 8
    # Streams these bytes verbatim, one write each with a pause between, so
    # that they arrive split exactly there (SSE framing tests).
    raw_stream: list[bytes] | None = None
    # Headers added to every answer (tests of what the router forwards).
    extra_headers: dict[str, str] = field(default_factory=dict)
    # Per model: seconds between streamed tokens, drawn uniformly from
    # (low, high) for each token, like a real engine's uneven pace (bench).
    paced: dict[str, tuple[float, float]] = field(default_factory=dict)
    # A prefix cache like an engine's (vLLM's automatic prefix caching): the
    # prompt in blocks of `cache_block_chars`, an LRU of `prefix_cache_blocks`
    # of them per replica (0: no cache). A block is found only after every
    # block before it (a prefix). The prompt's tokens not found cost
    # `prefill_seconds_per_token` each before the first token; those found
    # are reported in usage.prompt_tokens_details.cached_tokens.
    prefix_cache_blocks: int = 0
    cache_block_chars: int = 64
    prefill_seconds_per_token: float = 0.0


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes
    # Monotonic time the request arrived (ordering checks against pushes).
    at: float = field(default_factory=time.monotonic)


@dataclass
class FakeReplica:
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
    _runner: web.AppRunner | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def app(self) -> web.Application:
        # aiohttp refuses a body of exactly client_max_size bytes.
        app = web.Application(client_max_size=self.max_body_bytes + 1)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{id}", self._stored_response)
        app.router.add_post("/v1/responses/{id}/cancel", self._stored_response)
        app.router.add_get("/v1/responses/{id}/input_items", self._stored_response)
        for path in ECHOED:
            app.router.add_post(path, self._echo)
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            app.router.add_post(path, self._transcribe)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_get("/health", self._health)
        # What SGLang's and vLLM's own routers probe before they route (bench/compare.py).
        app.router.add_get("/get_model_info", self._engine_info)
        app.router.add_get("/get_server_info", self._engine_info)
        app.router.add_get("/model_info", self._engine_info)
        app.router.add_get("/server_info", self._engine_info)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None) -> str:
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, keepalive_timeout=self.keepalive_timeout, access_log=None
        )
        await self._runner.setup()
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(self._runner, sock)
        else:
            site = web.TCPSite(self._runner, host, port, reuse_port=port != 0)
        await site.start()
        bound = self._runner.addresses[-1]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def kill(self) -> None:
        """Stop as a killed engine does: every connection reset at once, nothing finished, the port refusing."""
        runner = self._runner
        if runner is None:
            return
        if runner.server is not None:
            for handler in list(runner.server.connections):
                transport = handler.transport
                if transport is not None:
                    transport.abort()
        # With no connection left, the runner's graceful shutdown has nothing to wait for.
        await runner.cleanup()
        self._runner = None

    # Handlers -------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.behaviour.fail_status is not None:
            return web.Response(status=503, text="unhealthy")
        return web.Response(text="ok")

    async def _engine_info(self, request: web.Request) -> web.Response:
        model = self.models[0]
        info = {"model_path": model, "tokenizer_path": self.tokenizer_path or model, "is_generation": True}
        return web.Response(body=orjson.dumps(info), content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": self.name} for m in self.models]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")

    async def _begin(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        body = await request.read()
        if self.record:
            self.seen.append(Seen(request.path_qs, dict(request.headers), body))
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
        return obj, None

    async def _tracked(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.active += 1
        try:
            obj, failure = await self._begin(request)
            if failure is not None:
                return failure
            if kind == "embeddings":
                return self._embedding_answer(obj)
            prompt = await self._prefill(obj, kind)
            if obj.get("stream") is True:
                return await self._stream(request, obj, kind, prompt)
            return self._whole(obj, kind, prompt)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
            self.completed += 1

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "completions")

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "embeddings")

    # The other endpoints -------------------------------------------------------------

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            body = await request.read()
            if self.record:
                self.seen.append(Seen(request.path_qs, dict(request.headers), body))
            try:
                model = orjson.loads(body).get("model")
            except (orjson.JSONDecodeError, AttributeError):
                model = None
            return web.json_response(
                {"object": "echo", "path": request.path, "model": model, **self._received(body)},
                headers=self._headers(),
            )
        finally:
            self.active -= 1
            self.completed += 1

    def _received(self, body: bytes) -> dict[str, Any]:
        return {"served_by": self.name, "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest()}

    async def _transcribe(self, request: web.Request) -> web.StreamResponse:
        """Multipart form data, as the audio endpoints take it: the model is a field, the audio a file part."""
        body = await request.read()
        if self.record:
            self.seen.append(Seen(request.path_qs, dict(request.headers), body))
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + request.headers.get("Content-Type", "").encode() + b"\r\n\r\n" + body
        )
        fields: dict[str, str] = {}
        file_bytes = 0
        for part in message.iter_parts():
            data = part.get_payload(decode=True)
            assert isinstance(data, bytes)
            if part.get_filename() is not None:
                file_bytes = len(data)
            elif (name := part.get_param("name", header="content-disposition")) is not None:
                fields[str(name)] = data.decode()
        text = f"{file_bytes} bytes of audio heard by {self.name}"
        return web.json_response(
            {"text": text, "model": fields.get("model"), "file_bytes": file_bytes, **self._received(body)},
            headers=self._headers(),
        )

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.record:
            self.seen.append(Seen(request.path_qs, dict(request.headers), body))
        resp = web.StreamResponse(headers={"Content-Type": "audio/mpeg", **self._headers()})
        await resp.prepare(request)
        for i in range(4):
            await resp.write(bytes([i]) * 1024)
        await resp.write_eof()
        return resp

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: stored here, so that only this replica knows it (as in vLLM)."""
        self.active += 1
        try:
            obj, failure = await self._begin(request)
            if failure is not None:
                return failure
            previous = obj.get("previous_response_id")
            if previous is not None and previous not in self.responses:
                return web.json_response(
                    {
                        "error": {
                            "message": f"Response with id '{previous}' not found.",
                            "type": "invalid_request_error",
                            "param": "previous_response_id",
                            "code": None,
                        }
                    },
                    status=404,
                    headers=self._headers(),
                )
            doc = self._response_doc(obj)
            self.responses[doc["id"]] = doc
            if obj.get("stream") is True:
                return await self._stream_response(request, doc)
            return web.json_response(doc, headers=self._headers())
        finally:
            self.active -= 1
            self.completed += 1

    def _response_doc(self, obj: dict[str, Any]) -> dict[str, Any]:
        n = self._tokens({"max_tokens": obj.get("max_output_tokens")})
        text = "".join(f"tok{i} " for i in range(n))
        ident = f"resp_{self.name}_{next(self._ids)}"
        return {
            "id": ident,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": obj.get("model", self.models[0]),
            "previous_response_id": obj.get("previous_response_id"),
            "output": [
                {
                    "id": f"msg_{ident}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 4,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": n,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 4 + n,
            },
        }

    async def _stream_response(self, request: web.Request, doc: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self._headers()})
        await resp.prepare(request)
        started = {**doc, "status": "in_progress", "output": []}
        events: list[dict[str, Any]] = [{"type": "response.created", "response": started}]
        text = doc["output"][0]["content"][0]["text"]
        for i, word in enumerate(text.split()):
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": doc["output"][0]["id"],
                    "output_index": 0,
                    "content_index": 0,
                    "delta": word + " ",
                    "logprobs": [],
                    "sequence_number": i,
                }
            )
        events.append({"type": "response.completed", "response": doc})
        for number, event in enumerate(events):
            event.setdefault("sequence_number", number)
            await resp.write(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n")
        await resp.write_eof()
        return resp

    async def _stored_response(self, request: web.Request) -> web.StreamResponse:
        ident = request.match_info["id"]
        if self.record:
            self.seen.append(Seen(request.path_qs, dict(request.headers), await request.read()))
        doc = self.responses.get(ident)
        if doc is None:
            return web.json_response(
                {
                    "error": {
                        "message": f"Response '{ident}' not found.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                status=404,
                headers=self._headers(),
            )
        if request.path.endswith("/cancel"):
            doc = {**doc, "status": "cancelled"}
        elif request.path.endswith("/input_items"):
            return web.json_response({"object": "list", "data": [], "has_more": False}, headers=self._headers())
        return web.json_response(doc, headers=self._headers())

    def _headers(self) -> dict[str, str]:
        return {"X-Served-By": self.name, **self.behaviour.extra_headers}

    def _tokens(self, obj: dict[str, Any]) -> int:
        wanted = obj.get("max_tokens") or obj.get("max_completion_tokens")
        if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0:
            return min(wanted, self.behaviour.tokens)
        return self.behaviour.tokens

    async def _prefill(self, obj: dict[str, Any], kind: str) -> tuple[int, int]:
        """The prompt's tokens and how many of them the prefix cache held; the rest takes prefill time.

        The answer's blocks are cached too, laid out as the next turn's prompt
        will hold them (an engine keeps the KV of what it generated): a
        conversation's next turn finds everything but its new message.
        """
        b = self.behaviour
        if not b.prefix_cache_blocks:
            return 4, 0
        text = _prompt_of(obj)
        reply = "".join(f"tok{i} " for i in range(self._tokens(obj)))
        answered = text + (f"<|assistant|>{reply}\n" if kind == "chat" else reply)
        size = b.cache_block_chars
        found = 0
        chain = b""
        blocks: list[bytes] = []
        for start in range(0, len(answered) - size + 1, size):
            # Each block's hash covers every block before it: a block is only found after its prefix.
            chain = hashlib.blake2b(chain + answered[start : start + size].encode(), digest_size=16).digest()
            blocks.append(chain)
            if start + size <= len(text) and found == len(blocks) - 1 and chain in self.kv_cache:
                found += 1
        for block in blocks:
            self.kv_cache[block] = None
            self.kv_cache.move_to_end(block)
        while len(self.kv_cache) > b.prefix_cache_blocks:
            self.kv_cache.popitem(last=False)
        # About four characters a token, as the tokenizers of English text make them.
        prompt_tokens = max(1, len(text) // 4)
        cached_tokens = min(prompt_tokens, found * size // 4)
        self.cached_tokens += cached_tokens
        self.prompt_tokens += prompt_tokens
        if b.prefill_seconds_per_token:
            await asyncio.sleep((prompt_tokens - cached_tokens) * b.prefill_seconds_per_token)
        return prompt_tokens, cached_tokens

    def _whole(self, obj: dict[str, Any], kind: str, prompt: tuple[int, int]) -> web.Response:
        n = self._tokens(obj)
        text = "".join(f"tok{i} " for i in range(n))
        model = obj.get("model", self.models[0])
        ident = next(self._ids)
        usage = _usage(prompt, n)
        choice: dict[str, Any]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            doc = {
                "id": f"chatcmpl-{self.name}-{ident}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            doc = {
                "id": f"cmpl-{self.name}-{ident}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=self._headers())

    def _embedding_answer(self, obj: dict[str, Any]) -> web.Response:
        inputs = obj.get("input", "")
        items = inputs if isinstance(inputs, list) else [inputs]
        size = self.behaviour.embedding_size
        data = [
            {"object": "embedding", "index": i, "embedding": [round(0.1 * (i + 1) + j / 100, 4) for j in range(size)]}
            for i in range(len(items))
        ]
        doc = {
            "object": "list",
            "data": data,
            "model": obj.get("model", self.models[0]),
            "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
        }
        return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=self._headers())

    async def _stream(
        self, request: web.Request, obj: dict[str, Any], kind: str, prompt: tuple[int, int]
    ) -> web.StreamResponse:
        try:
            return await self._write_stream(request, obj, kind, prompt)
        except ConnectionError:
            # The reader went away mid-stream: what a real engine sees too.
            self.cancelled += 1
            return web.StreamResponse()

    async def _write_stream(
        self, request: web.Request, obj: dict[str, Any], kind: str, prompt: tuple[int, int]
    ) -> web.StreamResponse:
        b = self.behaviour
        n = self._tokens(obj)
        model = obj.get("model", self.models[0])
        ident = next(self._ids)
        created = int(time.time())
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                **self._headers(),
            }
        )
        await resp.prepare(request)
        if b.raw_stream is not None:
            for piece in b.raw_stream:
                await resp.write(piece)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        chunks = _stream_chunks(
            kind,
            f"{self.name}-{ident}",
            created,
            model,
            n,
            usage=_usage(prompt, n) if (obj.get("stream_options") or {}).get("include_usage") else None,
        )
        pace = b.paced.get(model)
        for index, chunk in enumerate(chunks):
            if b.reset_after_chunks is not None and index >= b.reset_after_chunks:
                if request.transport is not None:
                    request.transport.abort()
                return resp
            if 0 < index < n + 1:
                if pace is not None:
                    await asyncio.sleep(random.uniform(*pace))
                elif b.token_delay:
                    await asyncio.sleep(b.token_delay)
            await resp.write(chunk)
        await resp.write_eof()
        return resp


# Paths answered with an echo of what arrived (JSON bodies).
ECHOED = (
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
    "/v1/images/generations",
)


def _prompt_of(obj: dict[str, Any]) -> str:
    """The prompt as an engine's chat template lays it out: each message's role and text, in order."""
    messages = obj.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"<|{message.get('role')}|>{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = obj.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _usage(prompt: tuple[int, int], n: int) -> dict[str, Any]:
    prompt_tokens, cached_tokens = prompt
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _stream_chunks(
    kind: str, ident: str, created: int, model: str, n: int, *, usage: dict[str, Any] | None
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
        out.append(event([{"index": 0, "delta": {}, "finish_reason": "length"}]))
    else:
        out.append(event([{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]))
    if usage is not None:
        out.append(event([], usage))
    out.append(b"data: [DONE]\n\n")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m router.tools.fake`: serve a fake replica, optionally in several processes."""
    parser = argparse.ArgumentParser(prog="python -m router.tools.fake", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", action="append", dest="models", help="model name to serve (repeatable)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--first-token-delay", type=float, default=0.0)
    parser.add_argument(
        "--paced",
        action="append",
        default=[],
        metavar="MODEL=LOW:HIGH",
        help="stream MODEL's tokens LOW to HIGH seconds apart (repeatable; MODEL is also served)",
    )
    parser.add_argument("--tokenizer-path", default="", help="reported by /get_model_info (for peer routers)")
    parser.add_argument(
        "--prefix-cache-blocks", type=int, default=0, help="a prefix cache of this many blocks (0: none)"
    )
    parser.add_argument("--cache-block-chars", type=int, default=64, help="characters of prompt per cache block")
    parser.add_argument(
        "--prefill-seconds-per-token", type=float, default=0.0, help="time to first token per prompt token not cached"
    )
    parser.add_argument("--processes", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    args = parser.parse_args(argv)
    if args.cache_block_chars < 1 or args.prefix_cache_blocks < 0 or args.prefill_seconds_per_token < 0:
        parser.error(
            "--cache-block-chars must be at least 1; --prefix-cache-blocks and --prefill-seconds-per-token >= 0"
        )
    children: list[int] = []
    for _ in range(max(0, args.processes - 1)):
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)
    # SIGTERM becomes SystemExit so that the finally below stops the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvloop.run(_serve_forever(args))
    except KeyboardInterrupt:
        pass
    finally:
        for pid in children:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass


def _pace(spec: str) -> tuple[str, tuple[float, float]]:
    model, _, span = spec.partition("=")
    low, _, high = span.partition(":")
    try:
        pace = (float(low), float(high or low))
    except ValueError:
        pace = (-1.0, -1.0)
    if not model or not 0 <= pace[0] <= pace[1]:
        raise SystemExit(f"--paced: expected MODEL=LOW:HIGH seconds with 0 <= LOW <= HIGH, got {spec!r}")
    return model, pace


async def _serve_forever(args: argparse.Namespace) -> None:
    paced = dict(_pace(spec) for spec in args.paced)
    models = [*(args.models or ([] if paced else ["fake-model"])), *paced]
    fake = FakeReplica(
        models=tuple(models),
        behaviour=Behaviour(
            tokens=args.tokens,
            token_delay=args.token_delay,
            first_token_delay=args.first_token_delay,
            paced=paced,
            prefix_cache_blocks=args.prefix_cache_blocks,
            cache_block_chars=args.cache_block_chars,
            prefill_seconds_per_token=args.prefill_seconds_per_token,
        ),
        record=False,
        name=f"fake-{args.port}",
        tokenizer_path=args.tokenizer_path,
    )
    await fake.start(args.host, args.port)
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
