"""The client port's server: the protocol factory its listener calls, and shutdown.

What every connection shares (the handler, the limits, the sweep) is the
Port it builds (port.py); each accepted connection is a Connection
(connection.py) on that port.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from router.http.messages import Reply
from router.http.server.connection import Connection
from router.http.server.port import Port
from router.http.writer import Handler, HeadCheck, UpgradeCheck


class Server:
    """Owns the client connections: builds their Port, makes each one, and shuts them down."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        header_timeout: float,
        error: Callable[..., Reply],
        log_exception: Callable[[str], None],
        keepalive_timeout: float = 75.0,
        body_timeout: float = 60.0,
        write_stall_timeout: float = 30.0,
        max_buffered_body_bytes: int = 1 << 30,
        captured: Iterable[bytes] = (),
        head_check: HeadCheck | None = None,
        upgrade_check: UpgradeCheck | None = None,
    ) -> None:
        """`captured`: header names whose values the handler reads (Request.captured), picked out
        in the pass over the head that the server makes anyway, instead of a search per request.
        `head_check`: see HeadCheck; None costs nothing per request.
        `upgrade_check`: see UpgradeCheck; None: every Upgrade is ignored (RFC 9110 7.8)."""
        self.port = port = Port(
            handler,
            max_body_bytes=max_body_bytes,
            header_timeout=header_timeout,
            error=error,
            log_exception=log_exception,
            keepalive_timeout=keepalive_timeout,
            body_timeout=body_timeout,
            write_stall_timeout=write_stall_timeout,
            max_buffered_body_bytes=max_buffered_body_bytes,
            captured=captured,
            head_check=head_check,
            upgrade_check=upgrade_check,
        )
        # The port's, named here for the server's owner: its connections, their bodies' budget, its errors.
        self.connections = port.connections
        self.budget = port.budget
        self.protocol_errors = port.protocol_errors

    def __call__(self) -> Connection:
        return Connection(self.port)

    async def shutdown(self, grace: float) -> None:
        """Close idle connections, let requests finish within `grace`, then cancel them."""
        port = self.port
        port.stopping = True
        for connection in list(port.connections):
            connection.close_if_idle()
        deadline = time.monotonic() + grace
        while (running := [c.task for c in port.connections if c.task is not None]) and time.monotonic() < deadline:
            # A pipelined request may start as one ends: look again until none runs.
            await asyncio.wait(running, timeout=max(0.0, deadline - time.monotonic()))
        tasks = [c.task for c in port.connections if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        port.sweep.stop()
        for connection in list(port.connections):
            connection.transport.abort()
        await asyncio.sleep(0)
