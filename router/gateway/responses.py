"""Responses live on the replica that made them: which replica that is, remembered.

Engines keep stored responses in memory, so `previous_response_id`,
`GET /v1/responses/{id}` and the rest must reach the replica that made the
response. The router remembers `response id -> replica` for the responses it
passed, the last `remembered_responses` of them; an id it never saw, or whose
replica is gone, is 404 response_not_found. A request for a response whose
replica is only busy waits in that replica's queue (chain.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import orjson

from router.core.errors import ResponseNotFound, quoted
from router.core.pool.replicas import Replica
from router.core.pool.tallies import MAX_NAME_BYTES


def response_id(first_bytes: bytes) -> str | None:
    """A /v1/responses answer's id: the JSON body's `id`, or the first event's `response.id`."""
    text = first_bytes.lstrip()
    if text.startswith(b"{"):
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        ident = doc.get("id") if isinstance(doc, dict) else None
        return ident if isinstance(ident, str) else None
    for line in text.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            response = event.get("response") if isinstance(event, dict) else None
            ident = response.get("id") if isinstance(response, dict) else None
            return ident if isinstance(ident, str) else None
    return None


class ResponsesMemory:
    """Response id -> the id of the replica that made it and keeps it, least recently used first."""

    def __init__(self, remembered: int) -> None:
        self.remembered = remembered
        self.makers: OrderedDict[str, str] = OrderedDict()

    def maker_of(self, response_id: object) -> str:
        """The id of the replica that made `response_id`; 404 if this router did not see it."""
        replica_id = self.makers.get(response_id) if isinstance(response_id, str) else None
        if replica_id is None:
            raise ResponseNotFound(
                f"No response {quoted(response_id)} was made through this router (or it is no longer remembered).",
                param="previous_response_id",
            )
        self.makers.move_to_end(response_id)  # type: ignore[arg-type]
        return replica_id

    def remember(self, replica: Replica) -> Callable[[bytes], None]:
        """What reads a /v1/responses answer's id (its JSON body's, or its first event's) and keeps it."""

        def seen(first_bytes: bytes) -> None:
            ident = response_id(first_bytes)
            if ident is None or len(ident) > MAX_NAME_BYTES:
                # The memory is bounded in entries; an id past any engine's
                # (vLLM's are 37 characters) would unbound it in bytes.
                return
            makers = self.makers
            makers[ident] = replica.id
            makers.move_to_end(ident)
            while len(makers) > self.remembered:
                makers.popitem(last=False)

        return seen


def lost(response_id: object, replica_id: str) -> ResponseNotFound:
    """The 404 for a response whose replica is gone: only that replica ever knew it."""
    return ResponseNotFound(
        f"The replica that made response {quoted(response_id)} ({replica_id}) is gone "
        "or takes no new requests; the response is lost with it.",
        param="previous_response_id",
    )
