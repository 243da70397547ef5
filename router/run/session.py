"""The aiohttp ClientSession for everything but the data path.

Requests to replicas go through router.http.client; the aiohttp session is for
the health checks, the usage push and the wake calls, where its conveniences
cost nothing that matters. Keep-alive idle timeouts sit below the replicas' own
(vLLM/uvicorn close idle connections after 5 s).
"""

from __future__ import annotations

import aiohttp

from router.core.config.settings import Config


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
