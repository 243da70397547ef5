"""A request head judged by RFC 9110 and 9112: its fields in, a Head or a Refusal out.

No socket, no connection, no clock: `judge()` takes what llhttp read of one
head (method, version, target, fields) and says what the request is (a Head:
its version, persistence, framing and the fields the server reads) or why it
is refused (a Refusal: the status, the reason counted, the message); `read()`
does the same from the head's bytes, with a parser of its own, so that the
checks can be fuzzed against another reading of the same bytes (h11's) with
nothing else around them. The byte bounds on a head (its lines, its size, its
fields) are the reader's, checked as the bytes arrive (reader.py).

The rules, each where llhttp's strict mode leaves them: one valid Host on
HTTP/1.1 (400), no userinfo in the target (400), Transfer-Encoding on HTTP/1.0
(400), a final coding other than chunked or chunked twice (400), any coding
but chunked (501), a method other than RFC 9110's and PATCH (501), HTTP/1.x
above 1.1 served as 1.1 and other majors refused (505), CONNECT (405); an
Upgrade is ignored and the request answered as HTTP/1.1 (RFC 9110 7.8);
persistence is read from Connection alone (RFC 9112 9.3), never from llhttp's
view, which heeds Proxy-Connection and trailers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import Protocol

import httptools

from router.http.messages import Reply, Request

# RFC 9110's methods and PATCH (RFC 5789): any other is one the router does not
# implement, 501 (RFC 9110 9.1); llhttp knows more (WebDAV's, QUERY, ...) and
# refuses the rest outright.
METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"})
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
# A request line (RFC 9112 3, split on runs of SP as RFC 9112 3 allows), and
# the start of one: a method token and the space after it.
_REQUEST_LINE = re.compile(_TOKEN + rb" +[!-~]+ +HTTP/[0-9]\.[0-9]")
_METHOD_SP = re.compile(_TOKEN + rb" ")
# An absolute-form target with userinfo (RFC 9110 4.2.4: to be treated as an error).
_USERINFO = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@]*@")
# uri-host [ ":" port ] (RFC 9110 7.2, RFC 3986 3.2.2): a reg-name, an IPv4
# address or a bracketed IP literal. Empty is allowed (no authority).
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.vV]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::[0-9]*)?")
# A client's X-Request-Id is kept when it is short and visible ASCII; else the server makes one.
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")

# Bytes tested by value (`b"#" in x` raises and clears a TypeError inside).
_HASH = ord("#")
_SLASH = ord("/")

# llhttp's settings, the same for every parser of a request stream. Whether a
# connection persists is decided from the head (RFC 9112 9.3): llhttp's own
# view heeds Proxy-Connection and trailers. Versions and transfer codings are
# judged here (RFC 9110 2.5: HTTP/1.2 is served as 1.1; RFC 9112 6.1 and 6.3),
# never left to llhttp's lenient reading: a request whose coding llhttp does
# not take for chunked, but RFC 9110 does (OWS, an empty list element), is read
# as chunked by a fresh parser (reader.py).
LENIENCIES = {"lenient_keep_alive": True, "lenient_version": True, "lenient_transfer_encoding": True}

# The request fields the server itself reads, by name as sent (the usual
# spellings) or lowered; any other name is passed over with one lookup.
_F_HOST, _F_LENGTH, _F_CODINGS, _F_EXPECT, _F_CONNECTION, _F_UPGRADE, _F_REQUEST_ID, _F_CAPTURED = range(8)
_FIELDS: dict[bytes, int] = {}


def _spellings(lower: bytes) -> tuple[bytes, bytes]:
    """A lowered name as clients usually send it: lowered, and capitalized (Content-Length)."""
    return lower, b"-".join(part.capitalize() for part in lower.split(b"-"))


for _kind, _name in (
    (_F_HOST, b"host"),
    (_F_LENGTH, b"content-length"),
    (_F_CODINGS, b"transfer-encoding"),
    (_F_EXPECT, b"expect"),
    (_F_CONNECTION, b"connection"),
    (_F_UPGRADE, b"upgrade"),
    (_F_REQUEST_ID, b"x-request-id"),
):
    for _spelling in _spellings(_name):
        _FIELDS[_spelling] = _kind


class Refusal:
    """Why a request is refused: it gets `status`, then the connection closes.

    `reason` names the protocol error counted and logged (none for a head check's
    refusal, `reply`, which is no protocol error); `request_id` is the refused
    request's own, when it got one.
    """

    __slots__ = ("code", "message", "reason", "reply", "request_id", "status")

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        code: str | None = None,
        *,
        reply: Reply | None = None,
        request_id: bytes = b"",
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.code = code
        self.reply = reply
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"<Refusal {self.status} {self.reason or 'head check'}: {self.message}>"


# A head the server takes: the request it begins (without its body, its client's
# address and, when the client sent none it may keep, its id: the server adds
# them); its Content-Length; whether its body is chunked (then the length is
# None); whether it asked for 100 (Continue) on HTTP/1.1 (a 1xx is never sent to
# HTTP/1.0, RFC 9110 15.2); and whether llhttp acted on an Upgrade the server
# ignores (its body is then read anew after it). A plain tuple: an instance of a
# class costs more than the rest of judging the head, once per request.
Head = tuple[Request, int | None, bool, bool, bool]


class Upgrades(Protocol):
    """The one thing judge() asks the parser, and only for CONNECT or an Upgrade field."""

    def should_upgrade(self) -> bool: ...


class Rules:
    """What judge() reads by: the fields the server reads, and those a handler asked for (`captured`)."""

    __slots__ = ("fields", "hosts", "lengths")

    def __init__(self, captured: Iterable[bytes] = ()) -> None:
        self.fields = dict(_FIELDS)
        for name in captured:
            for spelling in _spellings(name.lower()):
                self.fields.setdefault(spelling, _F_CAPTURED)
        self.lengths = frozenset(len(name) for name in self.fields)
        # Host values already found valid: a connection sends the same one on every request.
        self.hosts: set[bytes] = set()

    def valid_host(self, value: bytes) -> bool:
        """Whether `value` is a uri-host [":" port]; judge() asks only for a value not yet in `hosts`."""
        if _HOST.fullmatch(value) is None:
            return False
        if len(self.hosts) < 256:
            self.hosts.add(value)
        return True


def judge(  # noqa: PLR0917 (a pure function of the head's parts, called once per request)
    rules: Rules,
    method: bytes,
    version: str,
    target: bytes,
    fields: list[tuple[bytes, bytes]],
    upgrades: Upgrades,
) -> Head | Refusal:
    """The head llhttp read (`target` as sent), by RFC 9110 and 9112: the Head, or why it is refused."""
    if version == "1.1":
        version_11 = True
    elif version == "1.0":
        version_11 = False
    elif version[:2] == "1.":
        # RFC 9110 2.5: a higher minor version is read as the highest one the
        # router speaks, and answered in it.
        version_11 = True
    else:
        return Refusal(505, "http_version", f"HTTP/{version} is not supported; use HTTP/1.1.")
    if method not in METHODS:
        shown = method.decode("latin-1")
        return Refusal(501, "unknown_method", f"The method {shown!r} is not implemented.")
    if target and target[0] != _SLASH and _USERINFO.match(target):
        return Refusal(400, "userinfo", "The request target has userinfo (user@host): refused.")
    # One pass over the names: most are none of these, told by one lookup.
    hosts = 0
    host = b""
    request_id = b""
    captured: dict[bytes, bytes] | None = None
    table = rules.fields
    length: int | None = None
    codings: list[bytes] | None = None
    expect = False
    upgrade = False
    connection: bytes | None = None
    for name, value in fields:
        kind = table.get(name)
        if kind is None:
            if len(name) not in rules.lengths:
                continue
            kind = table.get(name.lower())
            if kind is None:
                continue
        if kind == _F_HOST:
            hosts += 1
            host = value
        elif kind == _F_LENGTH:
            # llhttp has checked the digits; leading zeros are no part of the
            # value (RFC 9110 8.6), and int() reads at most 4,300 digits.
            length = int(value.lstrip(b"0") or b"0")
        elif kind == _F_CODINGS:
            if codings is None:
                codings = []
            # A list (RFC 9110 5.6.1): OWS around elements, empty elements ignored.
            codings += [c.strip(b" \t") for c in value.lower().split(b",") if c.strip(b" \t")]
        elif kind == _F_EXPECT:
            # A list (RFC 9110 10.1.1), over one field or several: 100-continue
            # among its members asks for a 100 whatever else it asks.
            expect = expect or b"100-continue" in [e.strip(b" \t") for e in value.lower().split(b",")]
        elif kind == _F_CONNECTION:
            connection = value.lower() if connection is None else connection + b"," + value.lower()
        elif kind == _F_UPGRADE:
            upgrade = True
        elif kind == _F_REQUEST_ID:
            if _REQUEST_ID.fullmatch(value):
                request_id = value
        elif captured is None:
            captured = {name.lower(): value}
        else:
            captured[name.lower()] = value
    if hosts != 1:
        if version_11 or hosts:
            detail = "no Host header" if hosts == 0 else f"{hosts} Host headers"
            return Refusal(400, "host", f"The request has {detail}; HTTP/1.1 requires exactly one.")
    elif host not in rules.hosts and not rules.valid_host(host):
        return Refusal(400, "host", "The Host header is not a valid host[:port].")
    # RFC 9112 9.3, from the head alone (not llhttp's view, which heeds
    # Proxy-Connection and trailers): close wins; HTTP/1.1 persists
    # unless told to close; HTTP/1.0 only when it asks for keep-alive.
    if connection is None:
        keep_alive = version_11
    else:
        tokens = {t.strip() for t in connection.split(b",")}
        keep_alive = b"close" not in tokens and (version_11 or b"keep-alive" in tokens)
    if codings is not None:
        if not version_11:
            return Refusal(400, "transfer_encoding_http_1_0", "Transfer-Encoding is not allowed in HTTP/1.0.")
        if codings != [b"chunked"]:
            return _codings_refused(codings)
    # llhttp upgrades on CONNECT, and on Upgrade with Connection: upgrade.
    upgrading = (upgrade or method == b"CONNECT") and upgrades.should_upgrade()
    if upgrading and method == b"CONNECT":
        return Refusal(405, "connect", "CONNECT is not supported: this is not a forward proxy.")
    request = Request(
        "",
        method.decode("ascii", "replace"),
        # (The usual target is in origin form already, and has no fragment: no call for it.)
        target if target[0] == _SLASH and _HASH not in target else target_for_handler(target),
        fields,
        b"",
        keep_alive,
        version_11,
        0,
        request_id,
        captured,
    )
    return request, length, codings is not None, expect and version_11, upgrading


def _codings_refused(codings: list[bytes]) -> Refusal:
    shown = ", ".join(c.decode("latin-1") for c in codings) or "(none)"
    if not codings or codings[-1] != b"chunked":
        # RFC 9112 6.3: the body's length cannot be known: 400, then close.
        return Refusal(400, "transfer_encoding", f"Transfer-Encoding {shown!r} does not end in chunked: no length.")
    if b"chunked" in codings[:-1]:
        # RFC 9112 6.1: never chunked twice (one reader would decode it once, another twice).
        return Refusal(400, "transfer_encoding", f"Transfer-Encoding {shown!r} applies chunked twice.")
    # RFC 9112 6.1: a coding the router does not decode (forwarding the body would mislabel it).
    return Refusal(501, "transfer_encoding", f"Transfer-Encoding {shown!r} is not supported; only chunked.")


def target_for_handler(target: bytes) -> bytes:
    """The target as the handler gets it: no fragment, in origin form."""
    if _HASH in target:
        # A fragment is the client's own business (RFC 9110 7.1).
        target = target.split(b"#", 1)[0]
    if target and target[0] != _SLASH and target[:4].lower() == b"http":
        target = _origin_form(target)
    return target


def _origin_form(target: bytes) -> bytes:
    """`http://host/path?q` as `/path?q`: a server MUST accept the absolute form (RFC 9112 3.2.2)."""
    # (llhttp takes a target that starts with a letter only as scheme "://" ...)
    rest = target[target.index(b"://") + 3 :]
    ends = [i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0]
    if not ends:
        return b"/"
    start = min(ends)
    return rest[start:] if rest[start : start + 1] == b"/" else b"/" + rest[start:]


def parse_failed(exc: httptools.HttpParserError, data: bytes, at_boundary: bool) -> Refusal:
    """What llhttp's refusal of `data` (read from a message boundary or not) is answered with."""
    if isinstance(exc, httptools.HttpParserInvalidMethodError) and at_boundary and unknown_method(data):
        return Refusal(501, "unknown_method", "The request's method is not implemented.")
    return Refusal(400, "invalid_http", f"The request is not valid HTTP/1.1: {exc}.")


class _Begins:
    """A probe parser's protocol: counts the messages begun."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def on_message_begin(self) -> None:
        self.count += 1


def _begins(data: bytes) -> int:
    counter = _Begins()
    parser = httptools.HttpRequestParser(counter)
    parser.set_dangerous_leniencies(**LENIENCIES)
    with contextlib.suppress(httptools.HttpParserError, httptools.HttpParserUpgrade):
        parser.feed_data(data)
    return counter.count


def unknown_method(data: bytes) -> bool:
    """`data` was read from a message boundary, and llhttp refused a method in it: is that
    method a token, in a request line (or the start of one still arriving)? Then it is a
    method the router does not know (501), not bytes that are no request at all (400).

    llhttp says neither where the refused message began nor what its method was; a
    probe parser fed ever longer starts of `data` finds the byte that began it. This runs
    only for a refused method, at most a dozen probes over a read's 4 KiB slice. (A
    method split across reads before its space is judged as it stands, and is 400.)
    """
    total = _begins(data)
    low, high = 1, len(data)
    while low < high:
        middle = (low + high) // 2
        if _begins(data[:middle]) >= total:
            high = middle
        else:
            low = middle + 1
    start = low - 1
    end = data.find(b"\r\n", start)
    if end < 0:
        return _METHOD_SP.match(data, start) is not None
    return _REQUEST_LINE.fullmatch(data, start, end) is not None


class _OneHead:
    """read()'s parser protocol: one head's method, target and fields, then the verdict."""

    __slots__ = ("parser", "rules", "target", "fields", "verdict")

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(**LENIENCIES)
        self.target: list[bytes] = []
        self.fields: list[tuple[bytes, bytes]] = []
        self.verdict: Head | Refusal | None = None

    def on_url(self, url: bytes) -> None:
        self.target.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self.verdict = judge(
            self.rules, parser.get_method(), parser.get_http_version(), b"".join(self.target), self.fields, parser
        )
        raise _Done


class _Done(Exception):
    """Raised by read()'s protocol at the end of the head: nothing after it is parsed."""


def read(data: bytes, rules: Rules | None = None) -> Head | Refusal | None:
    """The first request head in `data`, judged: a Head, a Refusal (llhttp's own included), or None
    while the head is not whole. Only the head is read; what follows it is not looked at."""
    head = _OneHead(rules if rules is not None else Rules())
    try:
        head.parser.feed_data(data)
    except httptools.HttpParserCallbackError as exc:
        # judge() itself failed (a Content-Length of more digits than int() reads): as the reader answers it.
        return head.verdict if head.verdict is not None else parse_failed(exc, data, True)
    except httptools.HttpParserError as failure:
        return parse_failed(failure, data, True)
    return head.verdict
