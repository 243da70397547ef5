"""One request's cycle on its connection: its handler run, its answer made whole, its body let go.

A connection is not a request (uvicorn's RequestResponseCycle apart from its
protocol): this is the task the connection starts per request, in the order
the requests came. Whatever the handler does, the request ends answered: a
handler that answered nothing gets a 500; one that began a stream and failed
leaves it broken (never passed off as whole); an answer the client does not
read is not kept forever (drain, cut off after write_stall_timeout).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from router.http.messages import Request, current_request_id
from router.http.server.states import Answering
from router.http.server.writer import DONE, NEW, Http11Writer

if TYPE_CHECKING:
    from router.http.server.connection import Connection

_CLOSED = Answering.CLOSED


async def answer(connection: Connection, request: Request) -> None:
    """Run the handler for `request`, then hand the connection on (Connection.answered)."""
    server = connection.server
    writer = Http11Writer(
        connection,
        request.method == "HEAD",
        request.request_id,
        request.version_11,
        request.keep_alive and not server.stopping,
    )
    # For the log lines the handler causes (router/run/logs.py), in this task and
    # the tasks it starts; set once per request, since each request has its task.
    current_request_id.set(request.request_id)
    try:
        await server.handler(request, writer)
    except asyncio.CancelledError:
        connection.release(request.reserved)
        raise
    except Exception:  # noqa: BLE001 (the root of a request: answered 500, logged, connection lives on)
        server.log_exception("request handler failed")
    # Its body is let go as soon as its handler is done with it.
    connection.release(request.reserved)
    request.body = b""
    phase = writer.phase
    if phase is not DONE:
        if phase is NEW:
            writer.answer(server.internal_error())
        else:
            # Bytes of a stream are out: a 500 now would corrupt it; it ends broken.
            writer.abort()
    if connection.flow.paused and connection.answering is not _CLOSED:
        try:
            await connection.drain()
        except ConnectionError:
            # Gone, or cut off: nothing more is answered here.
            connection.answered(False)
            return
    connection.answered(writer.keep_alive)
