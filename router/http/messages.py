"""What crosses between the client port and its handler: a Request in, a Reply out.

Neither knows the transport: a request carries its client's address (`peer`),
not its connection, so that a second transport would hand a handler the same
object.
"""

from __future__ import annotations

from contextvars import ContextVar

from router.http.wire import REASONS

# The id of the request whose handler runs in the current task (b"": none), for
# its log lines: set once per request by the server, read only when a line is written.
current_request_id: ContextVar[bytes] = ContextVar("current_request_id", default=b"")


class Request:
    """One parsed request, body included."""

    __slots__ = (
        "body",
        "keep_alive",
        "method",
        "path",
        "peer",
        "captured",
        "raw_headers",
        "request_id",
        "reserved",
        "target",
        "version_11",
    )

    def __init__(  # noqa: PLR0917 (a value object: its fields in order, made on the request path)
        self,
        peer: str,
        method: str,
        target: bytes,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        version_11: bool,
        reserved: int = 0,
        request_id: bytes = b"",
        captured: dict[bytes, bytes] | None = None,
    ) -> None:
        # The client's address as "host:port" (for the access log); "" when the transport has none.
        self.peer = peer
        self.method = method
        # The request target as sent (path and query), passed on as it is.
        self.target = target
        self.path = target.split(b"?", 1)[0].decode("utf-8", "surrogateescape")
        self.raw_headers = raw_headers
        self.body = body
        self.keep_alive = keep_alive
        self.version_11 = version_11
        # Body bytes counted against the server's max_buffered_body_bytes until it ends.
        self.reserved = reserved
        # The client's X-Request-Id, or one the server made: on every answer and log line.
        self.request_id = request_id
        # The server's `captured` headers this request has, by lowered name; None: none of them.
        self.captured = captured

    def header(self, lower_name: bytes) -> bytes | None:
        for name, value in self.raw_headers:
            if name.lower() == lower_name:
                return value
        return None


class Reply:
    """A whole answer: written in one piece, Content-Length and Date added."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]], reason: bytes | None = None
    ) -> None:
        self.status = status
        self.body = body
        # End-to-end headers only; the server adds the framing ones.
        self.headers = headers
        self.reason = reason if reason is not None else REASONS.get(status, b"Unknown")
