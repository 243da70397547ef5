"""The head checks (router/http/server/head.py) as a pure function: head bytes in, a head or a refusal out."""

from __future__ import annotations

import pytest

from router.http.server.head import unknown_method


@pytest.mark.parametrize(
    ("data", "unknown"),
    [
        (b"FOO /v1/models HTTP/1.1\r\nHost: r\r\n\r\n", True),
        # The line still arriving: a method token and its space are enough.
        (b"FOO /v1/mo", True),
        (b"FO", False),
        (b"GARBAGE\r\n\r\n", False),
        (b"NOT HTTP AT ALL\r\n\r\n", False),
        (b"\r\nget /v1/models HTTP/1.1\r\n", True),
        # Behind a whole request: the refused one begins where that one ends ...
        (b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\nFOO / HTTP/1.1\r\n\r\n", True),
        # ... not at a request line inside that one's body.
        (b"POST / HTTP/1.1\r\nHost: r\r\nContent-Length: 16\r\n\r\nFOO / HTTP/1.1\r\n{ / HTTP/1.1\r\n", False),
    ],
)
def test_a_refused_method_is_told_apart_from_bytes_that_are_no_request(data: bytes, unknown: bool) -> None:
    """llhttp refuses both; a method token in a request line is 501, anything else 400."""
    assert unknown_method(data) is unknown
