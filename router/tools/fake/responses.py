"""The Responses API, stored in memory as engines keep it: another replica does not know a response.

POST /v1/responses creates one (streamed as the API's typed events, or
whole) and keeps it in the replica's `responses`; a `previous_response_id`
this replica did not make is 404, as vLLM answers it. GET, cancel and
input_items read the store.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

if TYPE_CHECKING:
    from router.tools.fake.replica import FakeReplica


def _not_found(message: str, param: str | None, headers: dict[str, str]) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return web.json_response({"error": error}, status=404, headers=headers)


class ResponsesApi:
    """The Responses API of one replica, over the replica's store."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: stored here, so that only this replica knows it (as in vLLM)."""
        replica = self.replica
        replica.active += 1
        try:
            obj, failure = await replica.begin(request)
            if failure is not None:
                return failure
            previous = obj.get("previous_response_id")
            if previous is not None and previous not in replica.responses:
                return _not_found(
                    f"Response with id '{previous}' not found.", "previous_response_id", replica.headers()
                )
            doc = self._doc(obj)
            replica.responses[doc["id"]] = doc
            if obj.get("stream") is True:
                return await self._stream(request, doc)
            return web.json_response(doc, headers=replica.headers())
        finally:
            replica.active -= 1
            replica.completed += 1

    async def stored(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/responses/{id}, POST .../cancel, GET .../input_items: from the store, or 404."""
        replica = self.replica
        ident = request.match_info["id"]
        if replica.record:
            replica.remember(request, await request.read())
        doc = replica.responses.get(ident)
        if doc is None:
            return _not_found(f"Response '{ident}' not found.", None, replica.headers())
        if request.path.endswith("/cancel"):
            doc = {**doc, "status": "cancelled"}
        elif request.path.endswith("/input_items"):
            return web.json_response({"object": "list", "data": [], "has_more": False}, headers=replica.headers())
        return web.json_response(doc, headers=replica.headers())

    def _doc(self, obj: dict[str, Any]) -> dict[str, Any]:
        replica = self.replica
        n = replica.tokens({"max_tokens": obj.get("max_output_tokens")})
        text = "".join(f"tok{i} " for i in range(n))
        ident = f"resp_{replica.name}_{replica.next_id()}"
        return {
            "id": ident,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": obj.get("model", replica.models[0]),
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

    async def _stream(self, request: web.Request, doc: dict[str, Any]) -> web.StreamResponse:
        """The response as the API's typed events, in the order OpenAI sends them.

        created and in_progress, then the message's output item and its text
        part added, one delta a word, the text, part and item done, and
        completed: what the openai SDK's `client.responses.stream(...)`
        helper needs to build the response as it arrives (it refuses a delta
        for an output item it was not told of).
        """
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self.replica.headers()})
        await resp.prepare(request)
        started = {**doc, "status": "in_progress", "output": []}
        message = doc["output"][0]
        part = message["content"][0]
        text = part["text"]
        at = {"item_id": message["id"], "output_index": 0, "content_index": 0}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": started},
            {"type": "response.in_progress", "response": started},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**message, "status": "in_progress", "content": []},
            },
            {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
            *(
                {"type": "response.output_text.delta", **at, "delta": word + " ", "logprobs": []}
                for word in text.split()
            ),
            {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "part": part},
            {"type": "response.output_item.done", "output_index": 0, "item": message},
            {"type": "response.completed", "response": doc},
        ]
        for number, event in enumerate(events):
            event["sequence_number"] = number
            await resp.write(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n")
        await resp.write_eof()
        return resp
