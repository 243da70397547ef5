"""What a test can switch on a running fake replica, and what the replica records of each request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Behaviour:
    """The shape of the answers (tokens, delays) and the failures (a status, a reset, a stall).

    Mutable on purpose: a test flips a switch while the replica runs, and the
    next request sees it.
    """

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
    # Send a stream's usage chunk whether its client asked or not: vLLM's
    # --enable-force-include-usage, SGLang's --stream-response-default-include-usage.
    force_include_usage: bool = False


@dataclass
class Seen:
    """One request a fake replica received: its path, headers and body."""

    path: str
    headers: dict[str, str]
    body: bytes
    # Monotonic time the request arrived (ordering checks against pushes).
    at: float = field(default_factory=time.monotonic)
