"""The shared client port, held for the workers before any of them starts."""

from __future__ import annotations

import socket


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold the client port for the workers (and learn it when `port` is 0).

    First a plain bind, which fails if anything listens there already, so
    that two routers never share a port by accident; then a socket in the
    SO_REUSEPORT group the workers join. It never listens, so it takes no
    connections.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        port = probe.getsockname()[1]
    hold = socket.socket(family, kind, proto)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind((address[0], port, *address[2:]))
    return hold


def check_free(host: str, port: int) -> None:
    """OSError if something listens on the address already: known before any worker starts, not after."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
