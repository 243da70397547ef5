"""The reference of the differential HTTP/1.1 fuzzes (differential.py): h11 as a strict server.

What h11 makes of a client's byte stream: where each request begins and
ends, which one is the first it rejects, and what the router is to answer
each one it accepts. `lenient_reading` names where the router may accept
what h11 refuses (never about where a message ends), by an RFC's leave.
The router's limits (MAX_*) are stated here, as its module docstring states them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import h11
import orjson

# The router's limits as its module docstring states them; MAX_BODY is this
# test's max_body_bytes, small so that a length over it costs no bytes sent.
MAX_LINE = 8190
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
MAX_BODY = 64 * 1024

# How long to wait for answers owed, and for more once all of them arrived
# on a connection that stays open (a stricter or more lenient router would
# send them at once: they never wait on a timer).
ANSWER_SECONDS = 2.0
QUIET_SECONDS = 0.04

# Statuses the client port answers a request it refuses to read with.
REFUSALS = frozenset({400, 405, 408, 413, 414, 431, 501, 503, 505})

CHAT_PATH = b"/v1/chat/completions"
MODELS_PATH = b"/v1/models"
INFERENCE_PATHS = frozenset({CHAT_PATH, b"/v1/completions", b"/v1/embeddings"})

# What the router takes off a request before it forwards it (router/http/headers.py).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
        "expect",
    }
)


# The reference: h11 as a server -------------------------------------------------------------


@dataclass
class Parsed:
    """One request as h11 read it, and the bytes it was read from."""

    method: bytes
    target: bytes
    version: bytes
    # Names as sent; h11 has stripped the values' surrounding whitespace.
    headers: list[tuple[bytes, bytes]]
    body: bytes
    trailers: list[tuple[bytes, bytes]]
    # The head as sent, blank line included, and the whole request as sent.
    head: bytes
    raw: bytes

    def values(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key.lower() == name]

    def connection_options(self) -> set[bytes]:
        return {token.strip().lower() for value in self.values(b"connection") for token in value.split(b",")}

    def asks_for_100(self) -> bool:
        """Expect is a list (RFC 9110 10.1.1), and a 1xx is for HTTP/1.1 and later only (15.2)."""
        members = {token.strip().lower() for value in self.values(b"expect") for token in value.split(b",")}
        return self.version >= b"1.1" and b"100-continue" in members

    @property
    def origin_form(self) -> bytes:
        """The target as the router forwards it: no fragment, and an absolute form made
        origin-form (RFC 9112 3.2.2: a server MUST accept the absolute form)."""
        target = self.target.split(b"#", 1)[0]
        match = re.fullmatch(rb"[hH][tT][tT][pP][sS]?://[^/?]*(.*)", target)
        if match is not None:
            rest = match.group(1)
            target = rest if rest.startswith(b"/") else b"/" + rest
        return target

    @property
    def path(self) -> bytes:
        return self.origin_form.split(b"?", 1)[0]

    @property
    def chunked(self) -> bool:
        return bool(self.values(b"transfer-encoding"))


@dataclass
class Reference:
    """What h11 makes of a whole stream."""

    requests: list[Parsed]
    # "error": h11 rejects the request after `requests`; "close": the last of
    # `requests` ends the connection; "idle": all bytes read, the connection
    # stays open; "partial": the request after `requests` is incomplete.
    end: str
    # The bytes from the start of the request h11 rejected or did not finish.
    tail: bytes = b""
    # That request, when h11 read its head but not its whole body.
    unfinished: Parsed | None = None
    error: str = ""
    # The connection closes because the last answer is a stream on HTTP/1.0:
    # the router may have read (and refused) what followed without answering.
    closed_by_stream: bool = False


def h11_one(data: bytes) -> tuple[str, Parsed | None, int, str]:
    """The first request of `data` by h11: ("complete" | "partial" | "error", request, bytes read, error)."""
    # No size limit of h11's own: the router's limits are checked as policies.
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=len(data) + 1)
    conn.receive_data(data)
    request: h11.Request | None = None
    head_size = 0
    body = bytearray()
    while True:
        consumed = len(data) - len(conn.trailing_data[0])
        parsed = (
            None
            if request is None
            else Parsed(
                request.method,
                request.target,
                request.http_version,
                list(request.headers.raw_items()),
                bytes(body),
                [],
                data[:head_size],
                data[:consumed],
            )
        )
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return "error", parsed, consumed, str(exc)
        if isinstance(event, h11.Request):
            request = event
            head_size = len(data) - len(conn.trailing_data[0])
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert parsed is not None
            parsed.body = bytes(body)
            parsed.trailers = list(event.headers.raw_items())
            parsed.raw = data[: len(data) - len(conn.trailing_data[0])]
            return "complete", parsed, len(parsed.raw), ""
        else:
            # NEED_DATA: the router is not told of an end either (no half-close).
            return "partial", parsed, consumed, ""


_HEAD_END = re.compile(rb"\n\r?\n")
_REQUEST_LINE = re.compile(rb"([!-~]+) +([!-~]+) +(HTTP/[0-9]\.[0-9])(\r?)")
_TE_LINE = re.compile(rb"(?im)^(transfer-encoding:)([^\r\n]*)")
_CL_ZEROS = re.compile(rb"(?im)^(content-length:[ \t]*)0+([0-9])")


def lenient_reading(data: bytes) -> bytes | None:
    """`data` with its first head rewritten as the router reads it, where h11 is stricter than the RFC.

    Neither rewrite moves a message boundary.
    """
    end = _HEAD_END.search(data)
    if end is None:
        return None
    head, rest = data[: end.end()], data[end.end() :]
    first, newline, fields = head.partition(b"\n")
    # RFC 9112 3: recipients MAY parse the request-line on whitespace-delimited
    # word boundaries; llhttp takes runs of SP (h11 wants exactly one).
    line = _REQUEST_LINE.fullmatch(first)
    if line is not None and b"  " in first:
        first = b" ".join(line.group(1, 2, 3)) + line.group(4)

    # RFC 9110 5.6.1: a recipient MUST accept empty list elements, so
    # "Transfer-Encoding: , chunked" is chunked (h11 compares the whole value).
    def chunked_only(match: re.Match[bytes]) -> bytes:
        codings = [c.strip().lower() for c in match.group(2).split(b",") if c.strip()]
        return match.group(1) + b" chunked" if codings == [b"chunked"] else match.group(0)

    fields = _TE_LINE.sub(chunked_only, fields)
    # RFC 9110 8.6: Content-Length is 1*DIGIT, leading zeros and all; h11 caps
    # it at 20 digits, a limit of its own.
    fields = _CL_ZEROS.sub(rb"\1\2", fields)
    rewritten = first + newline + fields + rest
    return rewritten if rewritten != data else None


# RFC 9112 2.2: a server SHOULD ignore at least one empty line before a
# request-line, and MAY take a bare LF for a line end; llhttp ignores both.
# llhttp also skips a lone CR there, which RFC 9112 2.2 does not make a line
# end: allowed, because no boundary moves (the CR belongs to no request, and
# the router frames each request anew for the replica, so nothing downstream
# can read the stray byte differently).
_EMPTY_LINES = re.compile(rb"[\r\n]*")


def reference(stream: bytes, forwarded_stream: Callable[[Parsed], bool]) -> Reference:
    """h11's reading of `stream`, request by request, as the router's connection would go on."""
    requests: list[Parsed] = []
    offset = 0
    while True:
        empty = _EMPTY_LINES.match(stream, offset)
        assert empty is not None
        offset = empty.end()
        if offset == len(stream):
            return Reference(requests, "idle")
        data = stream[offset:]
        outcome, parsed, consumed, error = h11_one(data)
        if outcome == "error" and parsed is None and (lenient := lenient_reading(data)) is not None:
            outcome, parsed, consumed, error = h11_one(lenient)
            shift = len(data) - len(lenient)
            if parsed is not None:
                # Back to the bytes as sent: only the head was rewritten.
                head = data[: len(parsed.head) + shift]
                parsed.raw = head + parsed.raw[len(parsed.head) :]
                parsed.head = head
                consumed += shift
        if outcome == "error":
            return Reference(requests, "error", data, unfinished=parsed, error=error)
        if outcome == "partial":
            if parsed is not None:
                # All the router has of it, including a line h11 has not taken yet.
                parsed.raw = data
            return Reference(requests, "partial", data, unfinished=parsed)
        assert parsed is not None
        requests.append(parsed)
        offset += consumed
        options = parsed.connection_options()
        if parsed.method == b"CONNECT":
            # What follows a CONNECT is a tunnel's bytes, not HTTP.
            return Reference(requests, "close")
        # h11 pauses after a request with Upgrade until the server answers; the
        # router ignores Upgrade (RFC 9110 7.8), as h11 does once declined: the
        # next request follows. Persistence is RFC 9112 9.3's, where h11 never
        # keeps an HTTP/1.0 connection (keep-alive, RFC 9112 C.2.2).
        if b"close" in options or (parsed.version < b"1.1" and b"keep-alive" not in options):
            return Reference(requests, "close")
        if parsed.version < b"1.1" and forwarded_stream(parsed):
            # An HTTP/1.0 stream is delimited by the close (RFC 9112 6.3).
            return Reference(requests, "close", closed_by_stream=True)


# What the router's handler answers a request it read -----------------------------------------


def model_of(body: bytes) -> str | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    model = obj.get("model")
    return model if isinstance(model, str) and model else None


def forwarded(p: Parsed) -> bool:
    return p.method == b"POST" and p.path == CHAT_PATH and model_of(p.body) == "m"


def forwarded_stream(p: Parsed) -> bool:
    if not forwarded(p):
        return False
    obj = orjson.loads(p.body)
    return isinstance(obj, dict) and obj.get("stream") is True


def expected_status(p: Parsed) -> int:
    """The status router/gateway/dispatch.py gives a request it read (the replica answers 200)."""
    if p.method == b"POST" and p.path in INFERENCE_PATHS:
        model = model_of(p.body)
        if model is None:
            return 400
        return 200 if model == "m" else 404
    if p.path == MODELS_PATH and p.method in (b"GET", b"HEAD"):
        return 200
    if p.path in INFERENCE_PATHS or p.path == MODELS_PATH:
        return 405
    return 404
