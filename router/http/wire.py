"""What every HTTP/1.1 answer the router writes is made of: reason phrases, the Date field, a head's lines."""

from __future__ import annotations

import email.utils
import time

_REASONS = {
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


def reason_of(status: int) -> bytes:
    return _REASONS.get(status, b"Unknown")


class _Date:
    """The Date header, formatted once a second rather than per answer."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode()
        return self._value


http_date = _Date()


def frame_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
    """An answer's head: the status line, `headers` as given (a Date added unless one is there),
    then `framing`, the lines the writer owns (length or chunks, persistence), blank line included."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    has_date = False
    for name, value in headers:
        if not has_date and name.lower() == b"date":
            has_date = True
        lines.append(name + b": " + value + b"\r\n")
    if not has_date:
        lines.append(b"Date: " + http_date() + b"\r\n")
    lines.append(framing)
    return b"".join(lines)
