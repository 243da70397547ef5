"""Where a replica listens, parsed once from its base URL: what the upstream client connects to and sends as Host.

The core knows a replica by its base URL alone; the gateway asks `origin_of`
for the Origin of that URL on each attempt, parsed once and kept (a bounded
cache: a fleet that changes over months never grows it without end).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens, parsed once from its base URL."""

    host: str
    port: int
    tls: bool
    # Path prefix of the base URL (b"" or b"/prefix"), put before the client's path.
    prefix: bytes
    host_header: bytes
    # What the connection pools are keyed by: a str hashes once and compares
    # in C, where the dataclass would build tuples on every lookup.
    key: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname or ""
        shown = f"[{host}]" if ":" in host else host
        default = 443 if tls else 80
        header = shown if port == default else f"{shown}:{port}"
        key = f"{'https' if tls else 'http'}://{shown}:{port}"
        return cls(host, port, tls, parts.path.rstrip("/").encode(), header.encode("idna"), key)


# Far above any fleet's size: replicas are parsed once each, and a churning
# fleet's old URLs fall out least recently used first.
origin_of = functools.lru_cache(maxsize=1 << 16)(Origin.parse)
