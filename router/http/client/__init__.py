"""The proxy's own HTTP/1.1 client to the replicas (pool.py), on asyncio.Protocol and llhttp.

Failures are classified for the proxy's retry rules (errors.py); a replica
that misbehaves costs its connection (connection.py), never the next
request's answer, and is counted by reason in `Client.protocol_errors`;
the request in progress on a connection is its Exchange (exchange.py); an
answer is read by the connection's reader (reader.py) and handed over as a
Response (response.py); one sweep on the client's clock watches for late
heads and silent bodies (watch.py).
"""

from router.http.client.errors import (
    BodyTooLarge,
    ConnectFailed,
    ConnectionBroken,
    HeadTimeout,
    HeadTooLarge,
    UpstreamIdle,
)
from router.http.client.pool import Client
from router.http.client.reader import MAX_HEAD_BYTES, MAX_HEAD_LINE
from router.http.client.response import Response

__all__ = [
    "MAX_HEAD_BYTES",
    "MAX_HEAD_LINE",
    "BodyTooLarge",
    "Client",
    "ConnectFailed",
    "ConnectionBroken",
    "HeadTimeout",
    "HeadTooLarge",
    "Response",
    "UpstreamIdle",
]
