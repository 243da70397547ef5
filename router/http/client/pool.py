"""The proxy's own HTTP/1.1 client to the replicas: keep-alive pools per origin, and their sweeps.

aiohttp's ClientSession spends more CPU per request than the whole rest of
the router (URL objects, cookie and trace machinery, a request object per
call, a StreamReader per body). A replica speaks plain HTTP/1.1 to one
proxy, so this client does only that: a pool of keep-alive connections per
origin, the request written in one `transport.write()`, the response parsed
by llhttp (httptools), and a stream's chunks handed straight to a sink in
the protocol callback, with no task switch per chunk. Failures are
classified for the proxy's retry rules (errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from router.core.clock import Clock, LoopClock, Timer
from router.http.client.connection import Connection
from router.http.client.errors import ConnectFailed, ConnectionBroken
from router.http.client.exchange import IDLE
from router.http.client.response import Response
from router.http.client.watch import Watch
from router.http.origin import Origin
from router.http.protocol_errors import ProtocolErrors


class Client:
    """Keep-alive connection pools, one per origin, for every replica."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        keepalive_seconds: float,
        idle_timeout: float = 300.0,
        clock: Clock | None = None,
    ) -> None:
        """`clock`: what the keep-alive sweep and the watch on requests in progress read the time
        and set their timers by (the loop's by default; a fake one in tests)."""
        self.clock = clock if clock is not None else LoopClock()
        self.connect_timeout = connect_timeout
        self.keepalive_seconds = keepalive_seconds
        self._idle: dict[str, list[Connection]] = {}
        self._all: set[Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._sweeper: Timer | None = None
        # The one sweep that watches every connection with a request in
        # progress: for its head's deadline, then for the replica's silence in its body.
        self.watch = Watch(self._all, self.clock, idle_timeout)
        self.protocol_errors = ProtocolErrors(logging.getLogger("router.http.client"), level=logging.WARNING)

    async def request(self, origin: Origin, head: bytes, body: bytes, head_timeout: float | None = None) -> Response:
        """Send one request (head already framed) and wait for the response head.

        Raises ConnectFailed; HeadTimeout when no head came within
        `head_timeout` seconds of sending; or ConnectionBroken(before_head=True)
        when the connection ended or garbled before the head (`answered` if
        any of an answer had come). A kept-alive connection that the replica
        closed before the request had gone out whole, or reset with it unread
        (`unsent`), is the one break retried, once, on a fresh connection; one
        the replica had already closed when it was picked is not used at all.
        """
        connection = self._reuse(origin)
        if connection is not None:
            try:
                return await self._exchange(connection, head, body, head_timeout)
            except ConnectionBroken as exc:
                # A request written whole may have been read and acted on,
                # answer or not (a POST, a paid generation, a prompt that
                # kills the engine): never sent again, here or elsewhere.
                if not exc.unsent:
                    raise
                # The keep-alive race: the replica closed the idle connection
                # before it had read the request whole. Once more, on a fresh
                # connection (a refusal now is honest: nothing was sent).
        connection = await self._connect(origin)
        return await self._exchange(connection, head, body, head_timeout)

    async def _exchange(self, connection: Connection, head: bytes, body: bytes, head_timeout: float | None) -> Response:
        # One write for a small request; a big body is not copied into the head.
        future = connection.send(head + body if len(body) < 65536 else head, head_timeout)
        if len(body) >= 65536:
            connection.transport.write(body)
        try:
            return await future
        except BaseException:
            # Cancelled (client gone, first-byte timeout) or broken: the
            # connection is mid-request and can never be reused.
            connection.abandon()
            raise

    def _reuse(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin.key)
        if not idle:
            return None
        cutoff = self.clock.now() - self.keepalive_seconds
        while idle:
            # The most recently used first: the most likely to be open still.
            connection = idle.pop()
            # Anything readable on an idle connection ends it: most often the
            # replica's close, already in the kernel but not yet seen by the
            # event loop. Found now, it costs nothing; found after the request
            # went out, it would cost the request (Go's errServerClosedIdle is
            # the same close, seen by its reader while the connection idles).
            if (
                connection.idle_since >= cutoff
                and connection.exchange.state is IDLE
                and not connection.readable.poll(0)
            ):
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: Connection(self, self.watch, self.protocol_errors, origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection within {self.connect_timeout:g} s") from exc
        except OSError as refused:
            raise ConnectFailed(str(refused) or type(refused).__name__) from refused
        if protocol.exchange.state is not IDLE:
            # Between the connection and this line the replica spoke first
            # (counted, closed) or hung up: nothing was sent yet.
            raise ConnectFailed("the connection ended before the request went out")
        self._all.add(protocol)
        return protocol

    def idle_again(self, connection: Connection) -> None:
        clock = self.clock
        connection.idle_since = now = clock.now()
        self._idle.setdefault(connection.origin.key, []).append(connection)
        if self._sweeper is None:
            self._sweeper = clock.call_at(now + self.keepalive_seconds, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle longer than the keep-alive, before the replica does.

        Each origin's list is replaced before any of its connections is
        closed: close() takes a connection out of the list it is in, and a
        list changed while it is walked skips every other connection, which
        then stays open for good. The next sweep is due when the oldest
        connection left reaches the keep-alive (each list is in the order
        its connections went idle), not a whole period later, so none
        outlives it by more than a timer's lateness.
        """
        self._sweeper = None
        clock = self.clock
        now = clock.now()
        cutoff = now - self.keepalive_seconds
        stale: list[Connection] = []
        due: float | None = None
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if c.idle_since > cutoff and c.exchange.state is IDLE]
            if len(keep) < len(idle):
                stale.extend(c for c in idle if c.idle_since <= cutoff or c.exchange.state is not IDLE)
            if keep:
                self._idle[key] = keep
                oldest = keep[0].idle_since
                due = oldest if due is None else min(due, oldest)
            else:
                del self._idle[key]
        for connection in stale:
            connection.close()
        if due is not None:
            self._sweeper = clock.call_at(max(due + self.keepalive_seconds, now), self._sweep)

    @property
    def watching(self) -> Timer | None:
        """The watch's timer, set while a request is in progress."""
        return self.watch.timer

    @property
    def _watch_every(self) -> float:
        return self.watch.watch_every

    def forget(self, connection: Connection) -> None:
        self._all.discard(connection)
        idle = self._idle.get(connection.origin.key)
        if idle and connection in idle:
            idle.remove(connection)

    @property
    def open_connections(self) -> int:
        return len(self._all)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.watch.stop()
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        # One loop turn so that the transports' close callbacks run.
        await asyncio.sleep(0)
