"""The client port's server: its connections, their handler and limits, and shutdown."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable

from router.http.messages import Reply
from router.http.protocol_errors import ProtocolErrors
from router.http.server.connection import Connection
from router.http.server.deadlines import Sweep
from router.http.server.flow import Budget
from router.http.server.head import Rules
from router.http.writer import Handler, HeadCheck, UpgradeCheck

# The client port's protocol errors are counted and logged under this name.
log = logging.getLogger("router.http.server")


class Server:
    """Owns the client connections: the handler, the limits, and shutdown."""

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
        self.handler = handler
        self.head_check = head_check
        self.upgrade_check = upgrade_check
        # How heads are judged: the fields the server reads, and those it captures for the handler.
        self.rules = Rules(captured)
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self.write_stall_timeout = write_stall_timeout
        # Request body bytes held by every connection together, and the limits on them.
        self.budget = Budget(max_body_bytes, max_buffered_body_bytes)
        # error(status, message, code=...) -> an OpenAI-shaped Reply.
        self.error = error
        self.log_exception = log_exception
        self.protocol_errors = ProtocolErrors(log)
        self.connections: set[Connection] = set()
        self.stopping = False
        # Deadlines are checked this often: a few times per the shortest of them.
        shortest = min(header_timeout, keepalive_timeout, body_timeout, write_stall_timeout)
        self.sweep = Sweep(self.connections, max(0.05, min(1.0, shortest / 4)))
        # Request ids this server makes are UUIDs (version 4 shape): engines validate the header
        # (llama.cpp's server answers 400 with an empty body to anything else). Random per
        # process, then a counter in the last group: unique, and cheap to make (no uuid4 per request).
        seed = bytearray(os.urandom(10))
        seed[6] = 0x40 | (seed[6] & 0x0F)
        seed[8] = 0x80 | (seed[8] & 0x3F)
        hexed = seed.hex().encode()
        self._id_prefix = b"%s-%s-%s-%s-" % (hexed[:8], hexed[8:12], hexed[12:16], hexed[16:20])
        self._ids = itertools.count(1)

    def __call__(self) -> Connection:
        return Connection(self)

    def new_request_id(self) -> bytes:
        return self._id_prefix + b"%012x" % (next(self._ids) & 0xFFFF_FFFF_FFFF)

    def internal_error(self) -> Reply:
        return self.error(500, "The router failed to handle the request.", code="internal_error")

    async def shutdown(self, grace: float) -> None:
        """Close idle connections, let requests finish within `grace`, then cancel them."""
        self.stopping = True
        for connection in list(self.connections):
            connection.close_if_idle()
        deadline = time.monotonic() + grace
        while (running := [c.task for c in self.connections if c.task is not None]) and time.monotonic() < deadline:
            # A pipelined request may start as one ends: look again until none runs.
            await asyncio.wait(running, timeout=max(0.0, deadline - time.monotonic()))
        tasks = [c.task for c in self.connections if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sweep.stop()
        for connection in list(self.connections):
            connection.transport.abort()
        await asyncio.sleep(0)
