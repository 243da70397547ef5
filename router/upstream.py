"""What crosses the proxy's two sides, and the ClientSession for everything else.

Requests to replicas go through router.client; the aiohttp session is for
the health checks and the usage push, where its conveniences cost nothing
that matters. Keep-alive idle timeouts sit below the replicas' own
(vLLM/uvicorn close idle connections after 5 s), and a connection the
replica closed anyway is caught by the proxy's retry before any byte
reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from router.config import Config

# Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, never the
# message; Host and Content-Length are recomputed for the other side.
_NOT_FORWARDED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-connection",
        b"host",
        b"content-length",
        # The router answers Expect itself; the replica gets the body at once.
        b"expect",
    }
)


# A byte tested by its value: `b"_" in x` first tries the argument as an
# integer, raises and clears a TypeError inside, and costs ten times more.
_UNDERSCORE = ord("_")


def _hop_filter(raw: Sequence[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """The end-to-end headers of `raw`: one pass, and a second only if Connection names some."""
    kept: list[tuple[bytes, bytes, bytes]] = []
    named: set[bytes] | None = None
    for name, value in raw:
        lower = name.lower()
        if lower in _NOT_FORWARDED or lower in drop or lower.startswith(b"proxy-"):
            if lower == b"connection":
                tokens = {token.strip().lower() for token in value.split(b",")}
                tokens.discard(b"")
                named = tokens if named is None else named | tokens
            continue
        if _UNDERSCORE in lower:
            # `Content_Length` is `Content-Length` to servers that fold `_`
            # into `-` (CGI, WSGI, some engines' frameworks): a framing or
            # hop-by-hop name spelled so is dropped like the name it copies.
            folded = lower.replace(b"_", b"-")
            if folded in _NOT_FORWARDED or folded in drop or folded.startswith(b"proxy-"):
                continue
        kept.append((name, value, lower))
    if named:
        return [(name, value) for name, value, lower in kept if lower not in named]
    return [(name, value) for name, value, _ in kept]


def request_headers(raw: Sequence[tuple[bytes, bytes]], drop: frozenset[bytes] = frozenset()) -> bytes:
    """The client's end-to-end headers, framed for the replica (each line ends CRLF).

    The parser on the client side has already refused values with CR, LF or
    NUL, so the raw bytes are safe to pass on as they came.
    """
    return b"".join([name + b": " + value + b"\r\n" for name, value in _hop_filter(raw, drop)])


_NOTHING: frozenset[bytes] = frozenset()


def response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The replica's end-to-end headers, for the answer to the client."""
    return _hop_filter(raw, _NOTHING)


def make_session(config: Config) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0,
        keepalive_timeout=config.upstream_keepalive_seconds,
        ttl_dns_cache=10,
    )
    return aiohttp.ClientSession(
        connector=connector,
        # No total timeout: a 10-minute generation is a normal request. The
        # first-byte deadline is applied by the proxy around the request.
        timeout=aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout_seconds, sock_connect=config.connect_timeout_seconds
        ),
        # Bodies pass through as the replica encoded them.
        auto_decompress=False,
        # A Set-Cookie of one replica must never ride along on another client's request.
        cookie_jar=aiohttp.DummyCookieJar(),
    )
