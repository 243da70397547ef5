"""The shared upstream ClientSession and what crosses the proxy's two sides.

One session for every replica keeps connections alive between requests; its
idle timeout sits below the replicas' own (vLLM/uvicorn close idle
connections after 5 s), and a connection the replica closed anyway is caught
by the proxy's retry before any byte reaches the client.
"""

from __future__ import annotations

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from router.config import Config

# Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, never the
# message; Host and Content-Length are recomputed for the other side.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
        "host",
        "content-length",
        # aiohttp answers Expect itself; the replica gets the body at once.
        "expect",
    }
)


def _connection_named(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> frozenset[str]:
    values = headers.getall("Connection", ())
    if not values:
        return frozenset()
    return frozenset(token.strip().lower() for value in values for token in value.split(",") if token.strip())


def end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """The headers of `headers` that belong to the message, not the hop."""
    named = _connection_named(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _NOT_FORWARDED or lower.startswith("proxy-") or lower in named or lower in drop:
            continue
        out.add(name, value)
    return out


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
