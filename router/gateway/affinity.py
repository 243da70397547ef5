"""A request's affinity key, for the models routed by session or by prompt prefix.

The key decides which replica a request prefers (router.core.pool.picking's
BoundedHashRing): requests with the same key meet on one replica, whose
engine then finds their shared prefix in its KV cache. Only models with
`routing = "session"` or `"prefix"` pay for the key; least-loaded ones never
reach this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from router.core.config.models import ModelConfig
from router.core.pool.picking import affinity_key
from router.http.messages import Request


class Affinity:
    """How one model's requests are keyed."""

    __slots__ = ("_by_prefix", "_header", "_prefix_chars", "_spread")

    def __init__(self, model: ModelConfig) -> None:
        self._by_prefix = model.routing == "prefix"
        self._header = model.session_header.lower().encode("ascii")
        self._prefix_chars = model.prefix_chars
        # Sessions spread over a few replicas of their prompt's prefix (prefix_replicas).
        self._spread = model.prefix_replicas > 0

    def key(self, request: Request, obj: dict[str, Any]) -> bytes | None:
        """The request's key, or None when it has none (it then goes to the least loaded replica)."""
        if self._by_prefix:
            text = prompt_text(obj, self._prefix_chars)
            return affinity_key(text[: self._prefix_chars].encode()) if text else None
        session = self._session(request, obj)
        if session is None or not self._spread:
            return session
        # The prefix's key, then the session's: the ring places the session near the prefix (BoundedHashRing._start).
        text = prompt_text(obj, self._prefix_chars)
        return affinity_key(text[: self._prefix_chars].encode()) + session if text else session

    def _session(self, request: Request, obj: dict[str, Any]) -> bytes | None:
        # The session header was picked out as the server read the head (Server's `captured`).
        captured = request.captured
        value = captured.get(self._header) if captured is not None else None
        if value:
            return affinity_key(value)
        for field in ("user", "previous_response_id"):
            named = obj.get(field)
            if isinstance(named, str) and named:
                return affinity_key(named.encode())
        return None


def prompt_text(obj: dict[str, Any], limit: int) -> str:
    """The prompt in the order the engine reads it, at least `limit` characters of it where there are.

    Chat: each message's role and text (the text parts of a multi-part
    content), in order. Completions: the prompt (the first of a batch).
    Responses: the instructions, then the input. What the engine's chat
    template adds is the same for every request, so it changes no key.
    """
    pieces: list[str] = []
    size = 0
    for text in _prompt_pieces(obj):
        pieces.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(pieces)


def _prompt_pieces(obj: dict[str, Any]) -> Iterator[str]:
    instructions = obj.get("instructions")
    if isinstance(instructions, str):
        yield "system:" + instructions + "\n"
    for name in ("messages", "input"):
        messages = obj.get(name)
        if isinstance(messages, str):
            yield "user:" + messages + "\n"
        elif isinstance(messages, list):
            for message in messages:
                if isinstance(message, dict):
                    # Only a string is a role: anything else would be formatted
                    # whole, and a list nested a thousand deep cannot be.
                    role = message.get("role")
                    yield f"{role if isinstance(role, str) else ''}:{_content_text(message.get('content'))}\n"
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], str | list) else prompt
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, list):
        # Token ids: the same ids make the same key (anything else in the list
        # is no token, and is not formatted: it may be nested without end).
        yield ",".join(str(token) if isinstance(token, int) else "?" for token in prompt)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""
