"""WebSocket sessions (vLLM's /v1/realtime): routed by the query's model, then bytes both ways.

A GET that asks to upgrade to a WebSocket, on a path of `upgrade_paths`, is
routed by the query's `model` (else default_model, else the only model
served), relayed to a replica of that model, and after the replica's 101 the
two connections are joined: whatever either side sends reaches the other,
until either closes. The session counts as a request in flight on its replica
for its whole length (the replica is in use: never idle while it is open),
and a draining router waits for it as for a stream. Both idle rules hold: no
byte either way for upstream_idle_timeout_seconds, or a side that takes none
of what it is sent for write_stall_timeout_seconds, ends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import parse_qsl, quote, unquote_to_bytes

from router.core.config.settings import Config
from router.core.errors import (
    BadRequest,
    ClientFacingError,
    ModelNotFound,
    NoReplicaAvailable,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
    quoted,
)
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.gateway.access_log import current_entry
from router.gateway.answers import JSON, error_body, error_response, replica_answer
from router.gateway.catalog import Routes
from router.gateway.keys import ApiKeys
from router.http.client import ConnectFailed, ConnectionBroken, HeadTimeout
from router.http.client.upgrade import Answer, Streamed, names_protocol, upgrade
from router.http.headers import RESPONSE_HEADERS, HeaderFilter
from router.http.messages import Reply, Request
from router.http.origin import origin_of
from router.http.pipe import Pipe
from router.http.writer import Writer

log = logging.getLogger("router.gateway.tunnel")

WEBSOCKET = b"websocket"


def asks_websocket(request: Request) -> bool:
    """The server's upgrade check for upgrade_paths: an HTTP/1.1 GET whose Upgrade names the WebSocket protocol.

    (An HTTP/1.0 request's Upgrade is ignored, RFC 9110 7.8; `notwebsocket` is another protocol.)
    """
    value = request.header(b"upgrade")
    return request.method == "GET" and request.version_11 and value is not None and names_protocol(value, WEBSOCKET)


def with_model(target: bytes, model: str) -> bytes:
    """`target` with its query's `model` field naming `model`: every other byte of it as the client sent it."""
    path, mark, query = target.partition(b"?")
    if not mark:
        return target
    fields = query.split(b"&")
    named = quote(model, safe="").encode("ascii")
    for i, field in enumerate(fields):
        name, equals, _ = field.partition(b"=")
        if equals and unquote_to_bytes(name.replace(b"+", b" ")) == b"model":
            fields[i] = name + b"=" + named
    return path + b"?" + b"&".join(fields)


class Tunnels:
    """WebSocket sessions: routed by the query's model, relayed to a replica, then bytes both ways."""

    def __init__(self, config: Config, pool: Pool, routes: Routes, keys: ApiKeys, forwarded: HeaderFilter) -> None:
        self.pool = pool
        self.routes = routes
        self.keys = keys
        self.forwarded = forwarded
        self._connect_timeout = config.connect_timeout_seconds
        self._head_timeout = config.first_byte_timeout_seconds
        self._idle = config.upstream_idle_timeout_seconds
        self._stall = config.write_stall_timeout_seconds
        self._attempts = config.max_attempts
        # The engines' own keys and headers, as the forwarder sends them (router.core.config.upstream).
        self._credentials = {name: m.upstream.lines for name, m in config.models.items() if m.upstream is not None}

    async def serve(self, request: Request, writer: Writer) -> None:
        try:
            self.keys.check(request)
            if not asks_websocket(request):
                # The server did not hold this connection for a switch: no replica is asked for one.
                writer.answer(_upgrade_required())
                return
            requested, model, query = self._model(request)
            if (entry := current_entry.get()) is not None:
                entry.model = requested
            refused: set[Replica] = set()
            last = ""
            for _ in range(self._attempts):
                replica = self.pool.acquire(model, None, refused, None)
                if replica is None:
                    break
                try:
                    answer = await self._open(request, replica, model, requested, query)
                    if answer is None:
                        refused.add(replica)
                        last = f"cannot connect to replica {replica.id}"
                        continue
                    await self._answered(writer, replica, answer)
                    return
                finally:
                    self.pool.release(replica)
            raise NoReplicaAvailable(
                f"No replica of {quoted(model)} can take the session now"
                + (f" (last failure: {last})." if last else "."),
                retry_after=self.pool.ejections.retry_after((model,)),
            )
        except ClientFacingError as exc:
            # Every refusal of the router's own, a missing or wrong key's 401 included.
            writer.answer(error_response(exc))

    def _model(self, request: Request) -> tuple[str, str, list[tuple[str, str]]]:
        """(the name asked for, the model it leads to, the query's fields)."""
        _, _, raw = request.target.partition(b"?")
        query = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
        named = next((value for name, value in query if name == "model"), None)
        requested = named or self.routes.unnamed(self.pool)
        model = self.routes.aliases.get(requested, requested)
        if not self.pool.serves(model) and model not in self.routes.declared:
            raise ModelNotFound(f"The model {quoted(requested)} does not exist or no replica serves it.", param="model")
        return requested, model, query

    async def _open(
        self, request: Request, replica: Replica, model: str, requested: str, query: list[tuple[str, str]]
    ) -> Answer | None:
        """The replica's answer to the upgrade; None when it cannot be reached (another may be tried)."""
        target = request.target
        if requested != model and query:
            # The engine must see the name it serves, as a body's model is rewritten.
            target = with_model(target, model)
        origin = origin_of(replica.base_url)
        head = b"".join(
            (
                b"GET ",
                origin.prefix,
                target,
                b" HTTP/1.1\r\nHost: ",
                origin.host_header,
                b"\r\nX-Request-Id: ",
                request.request_id,
                b"\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n",
                own.lines if (own := replica.config.upstream) is not None else self._credentials.get(model, b""),
                self.forwarded.framed(request.raw_headers),
                b"\r\n",
            )
        )
        if (entry := current_entry.get()) is not None:
            entry.attempts += 1
            entry.served_model = model
            entry.replica = replica.id
        try:
            answer = await upgrade(
                origin, head, connect_timeout=self._connect_timeout, head_timeout=self._head_timeout, protocol=WEBSOCKET
            )
        except ConnectFailed:
            # Nothing reached the replica: not one of its requests.
            replica.connects_failed += 1
            self.pool.count_failure(replica, "connect")
            self.pool.record_failure(replica)
            return None
        except (ConnectionBroken, HeadTimeout) as exc:
            # It had the request: one of its requests, and a failure as a reset or silent stream is.
            replica.requests += 1
            error: UpstreamError = (
                UpstreamTimeout(f"Replica {replica.id} did not answer the upgrade: {exc}")
                if isinstance(exc, HeadTimeout)
                else UpstreamResetError(f"Replica {replica.id} broke off the upgrade: {exc}")
            )
            self.pool.count_failure(replica, error.reason)
            self.pool.record_failure(replica)
            raise error from exc
        replica.requests += 1
        return answer

    async def _answered(self, writer: Writer, replica: Replica, answer: Answer) -> None:
        self.pool.count_response(replica, answer.status)
        pipe = answer.pipe
        if answer.streamed is not None:
            await self._relay(writer, replica, answer, answer.streamed)
            return
        if pipe is None:
            # The replica would not switch: its answer is the client's.
            writer.answer(
                replica_answer(answer.status, answer.reason, answer.body, RESPONSE_HEADERS.kept(answer.headers))
            )
            return
        self.pool.record_success(replica)
        headers = RESPONSE_HEADERS.kept(answer.headers)
        upgraded = next((value for name, value in answer.headers if name.lower() == b"upgrade"), b"websocket")
        headers += [(b"Connection", b"Upgrade"), (b"Upgrade", upgraded)]
        client = writer.switch(101, answer.reason, headers)
        if client is None:
            pipe.close()
            writer.answer(error_response(BadRequest("This request cannot be switched to a WebSocket.")))
            return
        await self._join(client, pipe, replica)

    async def _relay(self, writer: Writer, replica: Replica, answer: Answer, body: Streamed) -> None:
        """An answer that did not switch and is no error (an event stream): passed on as it arrives."""
        self.pool.record_success(replica)
        length = answer.header(b"content-length")
        writer.start(
            answer.status,
            answer.reason,
            RESPONSE_HEADERS.kept(answer.headers),
            length=int(length) if length is not None and length.isdigit() else None,
        )
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle):
                        data = await body.read()
                except TimeoutError:
                    if (entry := current_entry.get()) is not None:
                        entry.outcome = "timeout"
                    self.pool.count_failure(replica, "timeout")
                    writer.abort()
                    return
                if not data:
                    break
                if writer.write(data):
                    await writer.drain()
        except ConnectionError:
            # The client went away, or took nothing for the write-stall timeout (the server cut it off).
            if (entry := current_entry.get()) is not None and entry.outcome == "ok":
                entry.outcome = "client_gone"
            return
        finally:
            body.abort()
        if body.whole:
            writer.end()
        else:
            if (entry := current_entry.get()) is not None:
                entry.outcome = "upstream_reset"
            self.pool.count_failure(replica, "reset")
            self.pool.record_failure(replica)
            writer.abort()

    async def _join(self, client: Pipe, upstream: Pipe, replica: Replica) -> None:
        """Both ways until either side ends, or the session goes idle, or a side stalls."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._carry(client, upstream)), loop.create_task(self._carry(upstream, client))]
        watch = loop.create_task(self._watch_idle(client, upstream))
        try:
            await asyncio.wait([*tasks, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*tasks, watch):
                task.cancel()
            await asyncio.gather(*tasks, watch, return_exceptions=True)
            # A side that stalled is cut off at once; the other's last bytes get as long to go out.
            upstream.close(linger=self._stall)
            client.close(linger=self._stall)
            log.debug("session on replica %s ended", replica.id)

    async def _carry(self, source: Pipe, sink: Pipe) -> None:
        """`source`'s bytes to `sink`, as they come, until `source` ends; a stalled sink ends it."""
        while data := await source.read():
            if sink.write(data):
                try:
                    async with asyncio.timeout(self._stall):
                        await sink.drain()
                except TimeoutError:
                    if (entry := current_entry.get()) is not None:
                        entry.outcome = "stalled"
                    return

    async def _watch_idle(self, client: Pipe, upstream: Pipe) -> None:
        """Returns once neither side has sent a byte for the idle timeout."""
        every = min(max(self._idle / 4, 0.05), 5.0)
        seen = (client.received, upstream.received)
        since = time.monotonic()
        while True:
            await asyncio.sleep(every)
            now = (client.received, upstream.received)
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > self._idle:
                if (entry := current_entry.get()) is not None:
                    entry.outcome = "timeout"
                return


def _upgrade_required() -> Reply:
    """A request on an upgrade path that cannot switch (no WebSocket Upgrade, or HTTP/1.0): RFC 9110 15.5.22."""
    body = error_body(
        426,
        "This path serves WebSocket sessions only: send an HTTP/1.1 GET with 'Upgrade: websocket'.",
        "invalid_request_error",
        "upgrade_required",
    )
    return Reply(426, body, [JSON, (b"Upgrade", WEBSOCKET), (b"Connection", b"Upgrade")])
