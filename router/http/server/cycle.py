"""One request's cycle on its connection: its handler run, its answer made whole, its body let go.

A connection is not a request (uvicorn's RequestResponseCycle apart from its
protocol): a Cycle is one request and its answer, and, as uvicorn's cycle is
its own `send`, it is the request's writer (an Http11Writer, writer.py),
with `run()` the task the connection starts per request, in the order the
requests came. Whatever the handler does, the request ends answered: a
handler that answered nothing gets a 500; one that began a stream and failed
leaves it broken (never passed off as whole); an answer the client does not
read is not kept forever (drain, cut off after write_stall_timeout). The
connection is reached through two methods (Answered), and the writer's own
interface (writer.Written).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from router.http.messages import Request, current_request_id
from router.http.server.flow import Holding
from router.http.server.port import Port
from router.http.server.writer import DONE, NEW, Http11Writer, Written


class Answered(Protocol):
    """What a cycle needs of its connection once its answer is written: to wait until the client takes
    it, and to hand the connection on (the next request, or its close)."""

    async def drain(self) -> None: ...
    def answered(self, keep_alive: bool) -> None: ...


class Turn(Written, Answered, Protocol):
    """The connection a cycle runs on: written on, and handed on."""


class Cycle(Http11Writer):
    """One request and its answer: the request's writer, and `run()`, its handler's task."""

    __slots__ = ("_holding", "_next", "_port", "_request")

    def __init__(self, connection: Turn, holding: Holding, port: Port, request: Request) -> None:
        # Http11Writer.__init__'s fields, set here rather than by super().__init__(): this runs
        # for every request, and the call would cost about as much as setting them.
        self._connection = connection
        self._transport = connection.transport
        self._flow = connection.flow
        self._head_only = request.method == "HEAD"
        self._request_id = request.request_id
        self._version_11 = request.version_11
        self.keep_alive = request.keep_alive and not port.stopping
        self.phase = NEW
        self.meter = None
        self._next: Answered = connection
        self._holding = holding
        self._port = port
        self._request = request

    async def run(self) -> None:
        """Run the handler for the request, then hand the connection on (Connection.answered)."""
        port = self._port
        request = self._request
        # For the log lines the handler causes (router/run/logs.py), in this task and
        # the tasks it starts; set once per request, since each request has its task.
        current_request_id.set(request.request_id)
        try:
            await port.handler(request, self)
        except asyncio.CancelledError:
            self._holding.release(request.reserved)
            raise
        except Exception:  # noqa: BLE001 (the root of a request: answered 500, logged, connection lives on)
            port.log_exception("request handler failed")
        # Its body is let go as soon as its handler is done with it.
        self._holding.release(request.reserved)
        request.body = b""
        phase = self.phase
        if phase is not DONE:
            if phase is NEW:
                self.answer(port.internal_error())
            else:
                # Bytes of a stream are out: a 500 now would corrupt it; it ends broken.
                self.abort()
        if self._flow.paused:
            try:
                await self._next.drain()
            except ConnectionError:
                # Gone, or cut off (a closed connection's drain says so at once): nothing more is answered here.
                self._next.answered(False)
                return
        self._next.answered(self.keep_alive)
