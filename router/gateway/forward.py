"""One attempt: a request to one replica, its answer classified and passed to the client.

`Forwarder.attempt()` frames the request for the replica, sends it, and
either answers the client through its Writer (a whole answer, or a stream
passed through as it arrives) and returns None, or returns a `Failed`: what
went wrong, whether another attempt may follow (nothing reached the client
and the replica did not take the request), and the replica's own answer to
give if none does. What it came to is written to every ledger in one step
(router.gateway.outcomes: `Ledgers.record`), as soon as it is known: at the
head, and again if the answer breaks off after it.

A try of a cold model's replica that finds it still loading (no connection,
a 503) is a probe when the request is held: not one of the request's
attempts, nor an upstream error, but `router_hold_probes_total`. Whether it
is held is known only after its tries, so such a try (`probe`) is left for
the caller to count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from urllib.parse import quote

from router.core.clock import perf_counter
from router.core.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
)
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.core.pool.reports import from_orca
from router.gateway.access_log import Entry
from router.gateway.answers import error_body, replica_answer
from router.gateway.call import Call
from router.gateway.codings import StreamDecoder, decoded
from router.gateway.metrics import DataPathMetrics
from router.gateway.outcomes import ANSWERED, ASLEEP, BROKEN, CUT_OFF, REFUSED, SILENT, UNREACHABLE, Failed, Ledgers
from router.gateway.sleepers import Sleepers
from router.gateway.tokens import whole_answer_tokens
from router.http.client import Client, ConnectFailed, ConnectionBroken, HeadTimeout, Response, UpstreamIdle
from router.http.headers import RESPONSE_HEADERS
from router.http.messages import Reply
from router.http.origin import origin_of
from router.http.writer import WriteStalled

log = logging.getLogger("router.gateway.forward")

# A replica answering these is busy or broken, not saying no to the request:
# another replica may well serve it.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Answers that never have a body, whatever the request asked for.
_NO_BODY = frozenset({204, 304})
# A small answer is read whole and written in one piece (and an error answer
# given OpenAI's shape); a larger one passes through as it arrives, and an
# error answer larger than this is not an error message: 502. Either way no
# answer is held whole in memory past this.
WHOLE_ANSWER_BYTES = 1 << 20
# What the responses memory reads of an answer for its id: a stream's first
# bytes, up to its first whole event; a whole answer, decoded, up to the
# larger bound (a compressed 1 MiB may well be a few MiB of JSON).
FIRST_BYTES = 65536
ID_READ_BYTES = 4 << 20


class _Counted:
    """A counted stream's sink: it keeps the stream's first read (and when it came) and its last
    two, then writes.

    References, no copies: what a stream says of its tokens is in its last events, maybe split
    over two reads, or followed by [DONE] in a read of its own; its first read holds an
    Anthropic stream's prompt and marks the time to first token (router.gateway.tokens). One
    object per counted stream, where closures over the same took two and their cells; its
    bound `take` is the sink, not the object itself: pure, a call of an object's __call__
    costs twice a bound method's, whose call the interpreter makes inline.
    """

    __slots__ = ("before_last", "first", "first_at", "last", "write")

    # Where each read goes on to: the writer's body sink, set once the answer's head is written.
    write: Callable[[bytes], bool]

    def __init__(self) -> None:
        self.first: bytes | None = None
        self.first_at = 0.0
        self.before_last = b""
        self.last = b""

    def take(self, chunk: bytes) -> bool:
        if self.first is None:
            self.first = chunk
            self.first_at = perf_counter()
        self.before_last = self.last
        self.last = chunk
        return self.write(chunk)


class _Remembering:
    """A stream's sink that hands its first bytes to `remember`, then only writes.

    Up to the first whole event, or the end of a body without one (a JSON
    answer passed through); read under the answer's Content-Encoding, so
    that a gzipped answer's id is found too, or knowingly not (an unknown
    coding gives `remember` nothing to read).
    """

    __slots__ = ("_decoder", "_done", "_first", "_remember", "_write")

    def __init__(
        self, write: Callable[[bytes], bool], remember: Callable[[bytes], None], content_encoding: bytes | None
    ) -> None:
        self._write = write
        self._remember = remember
        self._first = bytearray()
        self._done = False
        self._decoder = None if content_encoding is None else StreamDecoder(content_encoding, FIRST_BYTES + 1)

    def __call__(self, chunk: bytes) -> bool:
        if not self._done:
            piece = chunk if self._decoder is None else self._decoder.feed(chunk)
            if piece is None:
                self.end()
            else:
                first = self._first
                first.extend(piece)
                if first.find(b"\n\n") >= 0 or len(first) > FIRST_BYTES:
                    self.end()
        return self._write(chunk)

    def end(self) -> None:
        """The body ended whole: what was gathered is all there is."""
        if not self._done:
            self._done = True
            self._remember(bytes(self._first))


def answer_failed(call: Call, failed: Failed) -> None:
    """The client gets what failed (the replica's own answer, or the router's error); the access log, how."""
    failed.outcome_in(call.entry)
    call.writer.answer(failed.reply())


def _is_sse(resp: Response) -> bool:
    return (resp.header(b"content-type") or b"").startswith(b"text/event-stream")


def read_orca(pool: Pool, replica: Replica, resp: Response) -> None:
    """The engine's load in the answer's ORCA header, to the pool; the header itself, off the client's answer."""
    headers = resp.headers
    for index, (name, value) in enumerate(headers):
        if len(name) == 21 and name.lower() == b"endpoint-load-metrics":
            del headers[index]
            reading = from_orca(value)
            loads = pool.engine_loads
            if reading is not None and loads is not None:
                loads.record(replica, reading.waiting, reading.running, reading.kv, "orca")
            return


class Forwarder:
    """One attempt at a time: a request sent to one replica, its answer classified and passed to the client."""

    def __init__(
        self,
        pool: Pool,
        client: Client,
        metrics: DataPathMetrics,
        *,
        first_byte_timeout: float,
        write_stall_timeout: float,
        expose_replica: bool = False,
        credentials: Mapping[str, bytes] | None = None,
        count_tokens: bool = False,
    ) -> None:
        self.pool = pool
        # Each model's engines' key and headers ([models."NAME"] upstream_*); a replica's own comes first.
        self._credentials = dict(credentials or {})
        self.client = client
        self.metrics = metrics
        self.ledgers = Ledgers(pool, metrics)
        # The sleep tier's request side: a 503 "sleeping" marks its replica asleep (None: not recognised).
        self.sleepers: Sleepers | None = None
        self._first_byte_timeout = first_byte_timeout
        self._write_stall_timeout = write_stall_timeout
        # X-Router-Replica on the answers replicas give (config expose_replica_header).
        self._expose_replica = expose_replica
        # Each answer's usage read (config count_tokens): off, nothing of it runs.
        self._count_tokens = count_tokens

    async def attempt(  # noqa: PLR0917 (positional from the retry chain: called once per attempt)
        self,
        call: Call,
        replica: Replica,
        model: str,
        extra: list[tuple[bytes, bytes]] | None = None,
        remember: Callable[[bytes], None] | None = None,
        probe: bool = False,
    ) -> Failed | None:
        """Send `call` to `replica`, as a request for `model`; None once the client was answered, else what failed.

        `extra`: headers of the router's own added to the answer (X-Router-Held-Seconds).
        `remember`: given the answer's first bytes (a /v1/responses answer: its id).
        `probe`: a try of a model that holds requests (chain.py, hold.py): a failure
        that says the replica is still loading (no connection, a 503) is left for the
        caller to count, as a probe (Failed.replica set) or as an attempt (count_tried).
        """
        entry = call.entry
        request = call.request
        body = request.body if model == call.requested else call.body_for(model)  # (body_for(), written out)
        origin = origin_of(replica.base_url)
        method = request.method
        # vLLM says its queue and KV cache in a whole answer when asked (ORCA): a busy replica's reading
        # comes free with it. Asked once its reading is an interval old (every answer costs a third more
        # per request for readings a moment apart), and kept from the client unless it asked itself.
        loads = self.pool.engine_loads
        orca = (
            replica.engine == "vllm"
            and loads is not None
            and not call.stream
            # loads.view.wants(replica), written out: this runs on every whole request.
            and ((reading := replica.load) is None or self.pool.clock.now() - reading.at >= loads.view.fresh_for)
            and request.header(b"endpoint-load-metrics-format") is None
        )
        head = b"".join(
            (
                b"POST " if method == "POST" else method.encode("ascii") + b" ",
                origin.prefix,
                request.target,
                b" HTTP/1.1\r\nHost: ",
                origin.host_header,
                b"\r\nX-Request-Id: ",
                request.request_id,
                b"\r\nendpoint-load-metrics-format: TEXT\r\n" if orca else b"\r\n",
                # A traced request's attempt: its span's traceparent, so that the engine's spans join the trace.
                b"" if entry is None or (trace := entry.trace) is None else trace.attempt(replica, model),
                # The engine's own key and headers: the replica's, else its model's, else none.
                own.lines
                if (own := replica.config.upstream) is not None
                else (creds.get(model, b"") if (creds := self._credentials) else b""),
                call.headers,
                b"Content-Length: %d\r\n\r\n" % len(body) if body or method == "POST" else b"\r\n",
            )
        )
        began = perf_counter()
        call.sent = True
        try:
            # The connect timeout is the client's own; the first-byte deadline
            # runs from the request going out.
            resp = await self.client.request(origin, head, body, self._first_byte_timeout)
        except HeadTimeout:
            self.ledgers.record(entry, replica, model, SILENT)
            timeout = self._first_byte_timeout
            return Failed(UpstreamTimeout(f"Replica {replica.id} sent no response within {timeout:g} s."), False)
        except ConnectFailed as not_connected:
            # Nothing reached the replica: not one of its requests. A probe's is
            # an engine still loading, as the hold expects: not an attempt nor an error.
            self.ledgers.record(entry, replica, model, UNREACHABLE, probe=probe)
            refused = UpstreamConnectError(f"Cannot connect to replica {replica.id}: {not_connected}")
            return Failed(refused, True, replica=replica if probe else None)
        except ConnectionBroken as exc:
            # The replica took the request and ended the connection, or answered
            # part of it: it may have acted on it (a paid generation, a prompt
            # that crashes it), so it is never sent again, here or elsewhere.
            # (A reused connection that the replica closed before it read the
            # request whole is the one case the client itself tries again,
            # once; a refusal of that second connect is a ConnectFailed.)
            self.ledgers.record(entry, replica, model, BROKEN)
            return Failed(UpstreamResetError(f"Replica {replica.id} failed before its answer: {exc}"), False)
        try:
            ttfb = perf_counter() - began
            status = resp.status
            if orca:
                read_orca(self.pool, replica, resp)
            if status in RETRY_STATUSES:
                return await self._refused(entry, replica, resp, model, ttfb=ttfb, probe=probe)
            self.ledgers.record(entry, replica, model, ANSWERED, status, ttfb)
            out_headers = RESPONSE_HEADERS.kept(resp.headers)
            if extra:
                out_headers += extra
            if self._expose_replica:
                # Percent-encoded: an id is any string, a header value is not.
                out_headers.append((b"X-Router-Replica", quote(replica.id, safe="/:@-._~").encode()))
            # Passed through as it arrives: a stream, or anything without a length (_is_sse(), written out).
            # A replica's error answer is read whole, to give it OpenAI's shape.
            length = resp.content_length
            whole = not call.stream and length is not None and length <= WHOLE_ANSWER_BYTES
            if (
                status < 400
                and status not in _NO_BODY
                and (not whole or (resp.header(b"content-type") or b"").startswith(b"text/event-stream"))
            ):
                await self._stream(call, replica, resp, out_headers, remember)
                return None
            try:
                data = await resp.read(WHOLE_ANSWER_BYTES)
            except UpstreamIdle as idle:
                self.ledgers.record(entry, replica, model, CUT_OFF, reason="timeout")
                return Failed(UpstreamTimeout(f"Replica {replica.id} stopped sending its answer: {idle}"), False)
            except ConnectionBroken as exc:
                self.ledgers.record(entry, replica, model, CUT_OFF, reason="reset")
                return Failed(UpstreamResetError(f"Replica {replica.id} broke off its answer: {exc}"), False)
            if status < 400:
                if remember is not None:
                    text = decoded(data, resp.header(b"content-encoding"), ID_READ_BYTES)
                    if text is not None:
                        remember(text)
                call.writer.answer(Reply(status, data, out_headers, resp.reason_bytes))
                if self._count_tokens and call.metered and status < 300:
                    self.ledgers.tokens(call, model, whole_answer_tokens(data))
            else:
                call.writer.answer(replica_answer(status, resp.reason_bytes, data, out_headers))
            return None
        finally:
            # Back to the pool after a complete answer; closed if the answer
            # was cut short, so a half-read stream never lingers.
            resp.release()

    async def _refused(
        self, entry: Entry | None, replica: Replica, resp: Response, model: str, *, ttfb: float, probe: bool
    ) -> Failed:
        """A 429/502/503/504: keep the answer for the client in case no one else serves."""
        status = resp.status
        try:
            data = await resp.read(WHOLE_ANSWER_BYTES)
        except ConnectionBroken:
            data = b""
        answer = replica_answer(status, resp.reason_bytes, data, RESPONSE_HEADERS.kept(resp.headers))
        error = UpstreamError(f"Replica {replica.id} answered {status}.")
        # A 503 "sleeping" is asleep, not failing; a held request's try finding the engine loading, a probe.
        asleep = status == 503 and self.sleepers is not None and self.sleepers.found_asleep(replica, data)
        loading = probe and status == 503 and not asleep
        outcome = ASLEEP if asleep else REFUSED
        self.ledgers.record(entry, replica, model, outcome, status=status, ttfb=ttfb, probe=loading)
        return Failed(error, retryable=True, answer=answer, replica=replica if loading else None, asleep=asleep)

    async def _stream(
        self,
        call: Call,
        replica: Replica,
        resp: Response,
        headers: list[tuple[bytes, bytes]],
        remember: Callable[[bytes], None] | None = None,
    ) -> None:
        """Pass the body through as it arrives, each piece written in the replica's callback.

        Nothing runs per chunk but the write and a buffer check: when the
        client stops taking bytes, the replica's connection stops being read
        (TCP pushes back to the replica) and this task waits on the drain,
        which the server cuts off after write_stall_timeout_seconds.
        """
        writer = call.writer
        entry = call.entry
        counted = _Counted() if self._count_tokens and call.metered else None

        try:
            # A known length passes through as a length, the writer holding the
            # body to it (an event stream's length is not kept: it may end in an
            # error event of the router's own).
            length = resp.content_length
            if length is not None and _is_sse(resp):
                length = None
            writer.start(resp.status, resp.reason_bytes, headers, length=length)
            write = writer.body_sink()
            remembering: _Remembering | None = None
            if remember is not None:
                write = remembering = _Remembering(write, remember, resp.header(b"content-encoding"))
            if counted is not None:
                counted.write = write
                write = counted.take
            try:
                await resp.pipe(write, writer.drain)
            except ConnectionBroken as exc:
                # Bytes already reached the client: no retry, and the answer
                # must look broken, never complete: an SSE stream gets an
                # error event the SDKs raise, then the connection closes
                # without the last-chunk; any other body just closes.
                self.ledgers.record(entry, replica, replica.model, CUT_OFF, reason="reset")
                log.warning("replica %s broke off an answer: %s", replica.id, exc)
                if counted is not None:
                    # A broken answer says nothing of its tokens: unknown.
                    self.ledgers.tokens(call, replica.model, None)
                if entry is not None:
                    entry.outcome = "timeout" if isinstance(exc, UpstreamIdle) else "upstream_reset"
                # A stream under a content coding (gzip) gets no event: plain
                # text inside the coded bytes would only be garbage to the
                # client's decoder, where the missing last-chunk says enough.
                if _is_sse(resp) and resp.header(b"content-encoding") is None:
                    event = b"data: " + error_body(
                        502, f"Replica {replica.id} broke off the stream: {exc}", "server_error", "upstream_error"
                    )
                    # A blank line first closes a half-sent event, so that the error is an event of
                    # its own; after a whole one it dispatches nothing (an event stream's blank line
                    # with no field before it is ignored: WHATWG HTML, 9.2.6), so no read is kept for it.
                    writer.abort(b"\n\n" + event + b"\n\n")
                else:
                    writer.abort()
                return
            if remembering is not None:
                remembering.end()
            writer.end()
            if counted is not None and resp.status < 300:
                self.ledgers.stream_ended(
                    call, replica, counted.before_last, counted.last, counted.first, counted.first_at
                )
        except WriteStalled:
            if entry is not None:
                entry.outcome = "stalled"
            self.pool.tallies.client_stalled(replica.model)
            if counted is not None:
                self.ledgers.tokens(call, replica.model, None)
            log.warning(
                "cut off a client that read nothing of its %s stream for %gs", replica.model, self._write_stall_timeout
            )
        except ConnectionError:
            # The client went away. Nothing more to send; release() in the
            # caller closes the half-read upstream connection at once.
            if entry is not None:
                entry.outcome = "client_gone"
            if counted is not None:
                self.ledgers.tokens(call, replica.model, None)
            writer.close_after()
