"""What every HTTP/1.1 answer the router writes is made of: reason phrases, the Date field, a head's lines."""

from __future__ import annotations

import email.utils
import time

REASONS = {
    100: b"Continue",
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    501: b"Not Implemented",
    505: b"HTTP Version Not Supported",
}


class _Date:
    """The Date header's line, formatted once a second rather than per answer."""

    __slots__ = ("line", "second")

    def __init__(self) -> None:
        self.second = -1
        self.line = b""


_date = _Date()


def frame_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
    """An answer's head: the status line, `headers` as given (a Date added unless one is there),
    then `framing`, the lines the writer owns (length or chunks, persistence), blank line included."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    has_date = False
    for name, value in headers:
        # (Lowered only when it may be Date: a lowered copy of every name costs more.)
        if not has_date and len(name) == 4 and name.lower() == b"date":
            has_date = True
        lines.append(name + b": " + value + b"\r\n")
    if not has_date:
        now = int(time.time())
        if now != _date.second:
            _date.second = now
            _date.line = b"Date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        lines.append(_date.line)
    lines.append(framing)
    return b"".join(lines)
