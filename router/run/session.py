"""The aiohttp ClientSession for everything but the data path.

Requests to replicas go through router.http.client; the aiohttp session is for
the health checks, the usage push and the wake calls, where its conveniences
cost nothing that matters. Keep-alive idle timeouts sit below the replicas' own
(vLLM/uvicorn close idle connections after 5 s).
"""

from __future__ import annotations

import aiohttp

from router.core.config.settings import Config
from router.core.pool.sleep import EngineCallFailed


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


class SessionCall:
    """The sleep tier's engine calls (router.core.pool.sleep.EngineCall) on this session."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def __call__(self, method: str, url: str, body: bytes | None, seconds: float) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            async with self._session.request(
                method, url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=seconds)
            ) as resp:
                # An engine's sleep answers are small: read whole up to a bound (a body cut short is a
                # failure, not an answer), never a body sent to exhaust memory.
                answer = bytearray()
                while len(answer) < _ANSWER_LIMIT and (piece := await resp.content.read(_ANSWER_LIMIT - len(answer))):
                    answer += piece
                return resp.status, bytes(answer)
        except TimeoutError:
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise EngineCallFailed(f"{method} {url}: {exc or type(exc).__name__}") from exc


_ANSWER_LIMIT = 64 * 1024
