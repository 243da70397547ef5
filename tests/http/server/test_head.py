"""The head checks (router/http/server/head.py) as a pure function: head bytes in, a head or a refusal out.

No socket and no server: `read()` judges the first head of some bytes with a
parser of its own, and h11, a strict server, reads the same bytes. They must
agree (tests/support/differential.py names where they may differ, and why):
a head h11 reads is taken, with the same method, target, version, persistence
and framing, unless a policy of the router's allows a refusal; a head h11
rejects is refused, unless RFC 9110 or 9112 lets the router read it (then
it is read as h11 reads the rewritten head); a head still arriving is not
judged yet, unless llhttp already sees it cannot end well.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http.server.head import Refusal, Rules, read, unknown_method
from tests.support.differential import head_policy, tail_policy
from tests.support.h11_reference import Parsed, Reference, h11_one, lenient_reading
from tests.support.streams import request_bytes


def h11_head(data: bytes) -> tuple[str, Parsed | None]:
    """h11's reading of the first head in `data`: ("read" | "rejected" | "partial", the request)."""
    outcome, parsed, _, _ = h11_one(data)
    if parsed is None and outcome == "error" and (rewritten := lenient_reading(data)) is not None:
        outcome, parsed, _, _ = h11_one(rewritten)
    if parsed is not None:
        return "read", parsed
    return ("rejected" if outcome == "error" else "partial"), None


def disagreements(data: bytes) -> list[str]:
    verdict = read(data, Rules())
    outcome, parsed = h11_head(data)
    if outcome == "rejected":
        return [] if isinstance(verdict, Refusal) else [f"h11 rejects the head; read() gives {verdict!r}"]
    if outcome == "partial":
        if verdict is None:
            return []
        if isinstance(verdict, Refusal) and tail_policy(Reference([], "partial", data)) is not None:
            return []
        return [f"h11 waits for more of the head; read() gives {verdict!r}"]
    assert parsed is not None
    if isinstance(verdict, Refusal):
        return [] if head_policy(parsed) is not None else [f"h11 reads the head; read() refuses it: {verdict!r}"]
    if verdict is None:
        return ["h11 reads the head; read() waits for more of it"]
    request, length, chunked, continue_asked, _ = verdict
    problems: list[str] = []
    if request.method.encode() != parsed.method:
        problems.append(f"method {request.method!r}, h11 {parsed.method!r}")
    if request.target != parsed.origin_form:
        problems.append(f"target {request.target!r}, h11 {parsed.origin_form!r}")
    if request.version_11 != (parsed.version != b"1.0"):
        problems.append(f"HTTP/1.1 {request.version_11}, h11 HTTP/{parsed.version.decode()}")
    options = parsed.connection_options()
    persists = b"close" not in options and (parsed.version != b"1.0" or b"keep-alive" in options)
    if request.keep_alive != persists:
        problems.append(f"persists {request.keep_alive}, RFC 9112 9.3 by h11's fields {persists}")
    if chunked != parsed.chunked:
        problems.append(f"chunked {chunked}, h11 {parsed.chunked}")
    lengths = parsed.values(b"content-length")
    if not chunked and length != (int(lengths[0]) if lengths else None):
        problems.append(f"Content-Length {length}, h11 {lengths!r}")
    if continue_asked != parsed.asks_for_100():
        problems.append(f"100-continue asked {continue_asked}, h11's fields {parsed.asks_for_100()}")
    return problems


@settings(max_examples=2000, deadline=None, derandomize=True, database=None)
@given(data=request_bytes(0), cut=st.integers(0, 1 << 16))
def test_a_head_is_judged_as_h11_reads_it(data: bytes, cut: int) -> None:
    """Whole requests, and the same cut anywhere (a head still arriving)."""
    for some in (data, data[:cut]):
        problems = disagreements(some)
        assert not problems, f"read() and h11 disagree on {some!r}:\n- " + "\n- ".join(problems)


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


def test_transfer_codings_over_several_fields_are_one_list() -> None:
    """RFC 9110 5.3: fields of one name are one list: gzip then chunked is a coding the router
    does not decode (501), chunked then chunked is chunked twice (400)."""
    gzip_chunked = read(b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert isinstance(gzip_chunked, Refusal) and (gzip_chunked.status, gzip_chunked.reason) == (
        501,
        "transfer_encoding",
    )
    twice = read(b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert isinstance(twice, Refusal) and (twice.status, twice.reason) == (400, "transfer_encoding")
    assert repr(twice) == "<Refusal 400 transfer_encoding: Transfer-Encoding 'chunked, chunked' applies chunked twice.>"


def test_every_field_a_handler_asked_for_is_picked_out_of_the_head() -> None:
    head = read(
        b"GET / HTTP/1.1\r\nHost: r\r\nx-session-id: s\r\nX-Other: o\r\nX-TENANT: t\r\n\r\n",
        Rules([b"X-Session-Id", b"x-tenant"]),
    )
    assert isinstance(head, tuple)
    assert head[0].captured == {b"x-session-id": b"s", b"x-tenant": b"t"}


def test_an_absolute_form_target_without_a_path_is_the_root() -> None:
    """RFC 9112 3.2.2 and 3.2.1: http://host means the origin's root, /."""
    for target, expected in ((b"http://router", b"/"), (b"HTTP://router?x=1", b"/?x=1"), (b"http://r/a#f", b"/a")):
        head = read(b"GET " + target + b" HTTP/1.1\r\nHost: router\r\n\r\n")
        assert isinstance(head, tuple) and head[0].target == expected, target


def test_the_hosts_found_valid_are_remembered_up_to_a_bound() -> None:
    """A client that sends a new Host on every request is judged every time, and costs no memory."""
    rules = Rules()
    for i in range(300):
        assert isinstance(read(b"GET / HTTP/1.1\r\nHost: h%d.example\r\n\r\n" % i, rules), tuple)
    assert len(rules.hosts) == 256
    refused = read(b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", rules)
    assert isinstance(refused, Refusal) and refused.reason == "host"
