"""What every connection of the client port shares: the handler, the rules and limits, the sweep, the ids.

The connections' modules reach this, never the Server that builds it
(server.py): the server owns the listening side and shutdown, and imports
them; they import only this, so no module of the package imports another
in a circle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Protocol

from router.http.messages import Reply
from router.http.protocol_errors import ProtocolErrors
from router.http.server.deadlines import Sweep, Watched
from router.http.server.flow import Budget
from router.http.server.head import Rules
from router.http.server.states import ConnectionState
from router.http.writer import Handler, HeadCheck, UpgradeCheck

# The client port's protocol errors are counted and logged under this name.
log = logging.getLogger("router.http.server")


class Member(Watched, Protocol):
    """A connection as the port keeps it: its deadlines (Watched), its state, its request's task, its transport."""

    state: ConnectionState
    task: asyncio.Task[None] | None
    transport: asyncio.Transport

    def close_if_idle(self) -> None: ...


class Port:
    """The handler, the limits, the deadlines' lengths and sweep, and the request ids: every connection's."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        header_timeout: float,
        error: Callable[..., Reply],
        log_exception: Callable[[str], None],
        keepalive_timeout: float,
        body_timeout: float,
        write_stall_timeout: float,
        max_buffered_body_bytes: int,
        captured: Iterable[bytes],
        head_check: HeadCheck | None,
        upgrade_check: UpgradeCheck | None,
    ) -> None:
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
        self.connections: set[Member] = set()
        # Set at shutdown: answers close their connections.
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

    def new_request_id(self) -> bytes:
        return self._id_prefix + b"%012x" % (next(self._ids) & 0xFFFF_FFFF_FFFF)

    def internal_error(self) -> Reply:
        return self.error(500, "The router failed to handle the request.", code="internal_error")
