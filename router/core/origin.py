"""Where a replica listens, parsed once from its base URL: a plain value, shared by the core and the client."""

from __future__ import annotations

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
