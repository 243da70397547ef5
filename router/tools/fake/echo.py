"""The other endpoints the engines serve (rerank, score, pooling, classify, tokenize, audio, images, ...).

Each answers with an echo that says which replica served and what body
arrived: its length and SHA-256, so that a test can check it came byte
for byte. The transcription endpoints read multipart form data as the
audio endpoints take it; speech streams a few bytes of "audio".
"""

from __future__ import annotations

import email.parser
import email.policy
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from router.core.config.engines import ROUTED_PATHS

if TYPE_CHECKING:
    from router.tools.fake.replica import FakeReplica

TRANSCRIBED = ("/v1/audio/transcriptions", "/v1/audio/translations", "/audio/transcriptions")
# The routed paths with an answer of their own (inference.py, responses.py, messages.py, speech below).
_ANSWERED = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/audio/speech",
        *TRANSCRIBED,
    }
)
# Every other path an engine serves (router.core.config.engines) is answered with an echo of what arrived (JSON bodies).
ECHOED = tuple(path for path in ROUTED_PATHS if path not in _ANSWERED)


class Echo:
    """The echoing endpoints of one replica."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    async def echo(self, request: web.Request) -> web.StreamResponse:
        replica = self.replica
        replica.active += 1
        try:
            body = await request.read()
            if replica.record:
                replica.remember(request, body)
            try:
                model = orjson.loads(body).get("model")
            except (orjson.JSONDecodeError, AttributeError):
                model = None
            return web.json_response(
                {"object": "echo", "path": request.path, "model": model, **replica.received(body)},
                headers=replica.headers(),
            )
        finally:
            replica.active -= 1
            replica.completed += 1

    async def transcribe(self, request: web.Request) -> web.StreamResponse:
        """Multipart form data, as the audio endpoints take it: the model is a field, the audio a file part."""
        replica = self.replica
        body = await request.read()
        if replica.record:
            replica.remember(request, body)
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
        text = f"{file_bytes} bytes of audio heard by {replica.name}"
        return web.json_response(
            {"text": text, "model": fields.get("model"), "file_bytes": file_bytes, **replica.received(body)},
            headers=replica.headers(),
        )

    async def speech(self, request: web.Request) -> web.StreamResponse:
        replica = self.replica
        body = await request.read()
        if replica.record:
            replica.remember(request, body)
        resp = web.StreamResponse(headers={"Content-Type": "audio/mpeg", **replica.headers()})
        await resp.prepare(request)
        for i in range(4):
            await resp.write(bytes([i]) * 1024)
        await resp.write_eof()
        return resp
