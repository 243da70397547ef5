"""The prefix cache an engine keeps (vLLM's automatic prefix caching), and the prompt it is keyed by."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any


def prompt_of(obj: dict[str, Any]) -> str:
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


def look_up(cache: OrderedDict[bytes, None], capacity: int, size: int, text: str, answered: str) -> int:
    """How many blocks of `size` characters of the prompt `text` the cache held, as a prefix.

    `answered` is the prompt followed by the answer, laid out as the next
    turn's prompt will hold them: its blocks are cached (an engine keeps the
    KV of what it generated), so a conversation's next turn finds everything
    but its new message. The cache keeps the `capacity` blocks used last.
    """
    found = 0
    chain = b""
    blocks: list[bytes] = []
    for start in range(0, len(answered) - size + 1, size):
        # Each block's hash covers every block before it: a block is only found after its prefix.
        chain = hashlib.blake2b(chain + answered[start : start + size].encode(), digest_size=16).digest()
        blocks.append(chain)
        if start + size <= len(text) and found == len(blocks) - 1 and chain in cache:
            found += 1
    for block in blocks:
        cache[block] = None
        cache.move_to_end(block)
    while len(cache) > capacity:
        cache.popitem(last=False)
    return found
