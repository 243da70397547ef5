"""Byte streams for one client connection, for the differential fuzzes against h11 (tests/support/differential.py):
valid, near-valid and hostile requests, several pipelined; and one stream per rule, pinned."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import orjson
from hypothesis import strategies as st

from tests.support.h11_reference import CHAT_PATH, MAX_BODY, MAX_HEADERS, MAX_LINE, MODELS_PATH

T = TypeVar("T")

# The streams -----------------------------------------------------------------------------------


def _weighted(*choices: tuple[int, T]) -> st.SearchStrategy[T]:
    """A choice with weights; the first (the ordinary one) is what Hypothesis shrinks towards."""
    return st.sampled_from([value for weight, value in choices for _ in range(weight)])


def _chat(index: int, **extra: object) -> bytes:
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": f"hi {index}"}], "max_tokens": 2, **extra}
    )


_EMBEDDED = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"


@st.composite
def _body(draw: st.DrawFn, index: int) -> bytes:
    kind = draw(
        _weighted(
            (8, "chat"),
            (1, "stream"),
            (1, "other model"),
            (1, "not json"),
            (1, "empty"),
            (1, "binary"),
            (1, "embedded"),
        )
    )
    if kind == "chat":
        return _chat(index)
    if kind == "stream":
        return _chat(index, stream=True)
    if kind == "other model":
        return orjson.dumps({"model": "x", "messages": []})
    if kind == "not json":
        return b"{not json"
    if kind == "empty":
        return b""
    if kind == "binary":
        return draw(st.binary(min_size=1, max_size=24))
    # A body that holds a request: what a wrong length would expose as one.
    return _chat(index) + _EMBEDDED


_LENGTH_FORMS: dict[str, Callable[[int], list[bytes]]] = {
    "plain": lambda n: [b"Content-Length: %d" % n],
    "zeros": lambda n: [b"Content-Length: 000%d" % n],
    "spaces": lambda n: [b"Content-Length: \t %d \t" % n],
    "plus": lambda n: [b"Content-Length: +%d" % n],
    "minus": lambda n: [b"Content-Length: -%d" % n],
    "list": lambda n: [b"Content-Length: %d, %d" % (n, n)],
    "twice": lambda n: [b"Content-Length: %d" % n, b"Content-Length: %d" % n],
    "conflict": lambda n: [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 1)],
    "conflict list": lambda n: [b"Content-Length: %d, %d" % (n, n + 1)],
    "empty": lambda n: [b"Content-Length:"],
    "hex": lambda n: [b"Content-Length: 0x%x" % n],
    "inner space": lambda n: [b"Content-Length: 1 %d" % n],
    "over limit": lambda n: [b"Content-Length: %d" % (MAX_BODY + 1)],
    "64 bits": lambda n: [b"Content-Length: 18446744073709551615"],
    "over 64 bits": lambda n: [b"Content-Length: 18446744073709551616"],
    "21 digits": lambda n: [b"Content-Length: 000000000000000000001"],
}

_CODINGS = (
    b"chunked",
    b"Chunked",
    b" chunked ",
    b", chunked",
    b"chunked, identity",
    b"gzip, chunked",
    b"identity, chunked",
    b"identity",
    b"chunked, chunked",
    b"chunked;q=1",
    b"x, chunked",
    b"chunked\t",
    b"chunked,",
    b"\tchunked , ",
    b"",
)

_SIZE_FORMS: dict[str, Callable[[int], bytes]] = {
    "plain": lambda n: b"%x" % n,
    "upper": lambda n: b"%X" % n,
    "zeros": lambda n: b"000%x" % n,
    "extension": lambda n: b"%x;ext=1" % n,
    "bare extension": lambda n: b"%x;e" % n,
    "quoted extension": lambda n: b'%x;e="a b"' % n,
    "space extension": lambda n: b"%x ;e=1" % n,
    "loose extension": lambda n: b"%x; e = 1" % n,
    "trailing space": lambda n: b"%x " % n,
    "trailing tab": lambda n: b"%x\t" % n,
    "plus": lambda n: b"+%x" % n,
    "0x": lambda n: b"0x%x" % n,
    "too big": lambda n: b"%x" % (n + 1),
    "too small": lambda n: b"%x" % max(n - 1, 0),
    "not hex": lambda n: b"g%x" % n,
    "huge": lambda n: b"1%016x" % n,
    "over limit": lambda n: b"%x" % (MAX_BODY + 1),
    "extension CR": lambda n: b"%x;e=\r" % n,
}

_TRAILERS = (
    b"X-Trailer: t",
    b"Authorization: Bearer sk-smuggled",
    b"Content-Length: 5",
    b"Transfer-Encoding: chunked",
    b"Connection: close",
    b"Host: evil",
    b"X-Fold: a\r\n b",
    b"X-Ctl: a\x01",
    b"X-Obs: \xe9",
    b"X-Space : v",
)


@st.composite
def _chunked(draw: st.DrawFn, body: bytes) -> bytes:
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=2)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    out = bytearray()
    for piece in pieces:
        if not piece:
            continue
        form = draw(_weighted((30, "plain"), *((1, name) for name in _SIZE_FORMS if name != "plain")))
        end = draw(_weighted((40, b"\r\n"), (1, b"\n"), (1, b"\r")))
        after = draw(_weighted((40, b"\r\n"), (1, b"\n"), (1, b""), (1, b"xx\r\n")))
        out += _SIZE_FORMS[form](len(piece)) + end + piece + after
    out += draw(_weighted((20, b"0\r\n"), (1, b"000\r\n"), (1, b"0;x=y\r\n"), (1, b"0\n")))
    trailers = draw(st.lists(st.sampled_from(_TRAILERS), max_size=2, unique=True)) if draw(st.booleans()) else []
    out += b"".join(trailer + b"\r\n" for trailer in trailers)
    out += draw(_weighted((30, b"\r\n"), (1, b""), (1, b"\n")))
    return bytes(out)


# Fields a client may well send, the router drops or passes on.
_FIELDS: tuple[tuple[bytes, ...], ...] = (
    (b"Content-Type: application/json",),
    (b"Connection: close",),
    (b"Connection: keep-alive",),
    (b"Connection: Keep-Alive",),
    (b"Connection: x-drop", b"X-Drop: dropped"),
    (b"Connection: upgrade", b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA"),
    (b"Connection: Upgrade", b"Upgrade: websocket"),
    (b"Upgrade: websocket",),
    (b"Expect: 100-continue",),
    (b"Expect: nope",),
    (b"TE: trailers",),
    (b"Trailer: X-Trailer",),
    (b"Keep-Alive: timeout=5",),
    (b"Proxy-Connection: keep-alive",),
    (b"Proxy-Authorization: Basic eDp4",),
    (b"Content_Length: 99",),
    (b"Transfer_Encoding: chunked",),
    (b"X-Obs: caf\xc3\xa9 \xff",),
    (b"X-Empty:",),
    (b"X-Ws: \t v \t",),
)

# Fields that make a head invalid, or its meaning unclear.
_HOSTILE_FIELDS: tuple[tuple[bytes, ...], ...] = (
    (b"Connection: keep-alive, close",),
    (b"Connection: close, keep-alive",),
    (b"Connection: keep-alive", b"Connection: close"),
    (b"Proxy-Connection: close",),
    (b"X-Ctl: a\x01b",),
    (b"X-Del: a\x7fb",),
    (b"X-Nul: a\x00b",),
    (b"X-Cr: a\rb",),
    (b"X-Fold: a", b" b"),
    (b"X-Space : v",),
    (b" X-Lead: v",),
    (b"Host: router",),
)

_LIMITS: tuple[tuple[bytes, ...], ...] = (
    (b"X-Long: " + b"v" * (MAX_LINE + 100),),
    tuple(b"X-Many-%d: v" % i for i in range(MAX_HEADERS + 1)),
    tuple(b"X-Big-%d: %b" % (i, b"v" * 1000) for i in range(70)),
)


@st.composite
def request_bytes(draw: st.DrawFn, index: int) -> bytes:
    method = draw(
        _weighted(
            (20, b"POST"),
            (5, b"GET"),
            (3, b"HEAD"),
            (1, b"PUT"),
            (1, b"OPTIONS"),
            (1, b"CONNECT"),
            (1, b"QUERY"),
            (1, b"FOO"),
            (1, b"get"),
        )
    )
    path = draw(
        _weighted(
            (14, CHAT_PATH),
            (4, MODELS_PATH),
            (1, b"/nope"),
            (1, b"*"),
            (1, b"http://router/v1/chat/completions"),
            (1, b"http://user@router/v1/chat/completions"),
            (1, b"/v1/chat/completions?q=" + b"a" * (MAX_LINE + 10)),
            (1, b"/v1/chat/completions?\x7f"),
            (1, b"/v1/chat/completions?\xff"),
        )
    )
    query = draw(_weighted((6, b""), (1, b"?a=1"), (1, b"?x=%41&y=-._~"), (1, b"?a=b?c")))
    fragment = draw(_weighted((6, b""), (1, b"#frag"), (1, b"#a?b#c")))
    before, after = draw(_weighted((40, (b" ", b" ")), (1, (b"  ", b" ")), (1, (b" ", b"   ")), (1, (b"\t", b" "))))
    version = draw(
        _weighted(
            (30, b"HTTP/1.1"),
            (8, b"HTTP/1.0"),
            (1, b"HTTP/2.0"),
            (1, b"HTTP/1.2"),
            (1, b"HTTP/0.9"),
            (1, b"HTTP/1.10"),
            (1, b"http/1.1"),
        )
    )
    host = draw(
        _weighted(
            (30, (b"Host: router",)),
            (2, ()),
            (1, (b"Host: a", b"Host: b")),
            (1, (b"Host: router", b"Host: router")),
            (1, (b"Host: a/b@c",)),
            (1, (b"Host: [::1]:8080",)),
            (1, (b"Host:",)),
            (1, (b"Host: a b",)),
            (1, (b"Host: router:80x",)),
        )
    )
    fields = [*host, b"X-Req: %d" % index]
    for extra in draw(st.lists(st.sampled_from(_FIELDS), max_size=3, unique=True)):
        fields += extra
    if draw(_weighted((4, False), (1, True))):
        fields += draw(st.sampled_from(_HOSTILE_FIELDS))
    if draw(_weighted((40, False), (1, True))):
        fields += draw(st.sampled_from(_LIMITS))
    body = draw(_body(index))
    framing = draw(
        _weighted(
            (10, "length"), (4, "chunked"), (3, "none"), (1, "none with body"), (1, "short"), (1, "long"), (1, "both")
        )
    )
    payload = body
    if framing == "length":
        form = draw(_weighted((40, "plain"), *((1, name) for name in _LENGTH_FORMS if name != "plain")))
        fields += _LENGTH_FORMS[form](len(body))
    elif framing in ("short", "long"):
        if framing == "short":
            cut = draw(st.sampled_from([len(_EMBEDDED), 1, len(body)])) if body.endswith(_EMBEDDED) else 1
            size = max(len(body) - cut, 0)
        else:
            size = len(body) + draw(st.sampled_from([1, 10, len(_EMBEDDED)]))
        fields.append(b"Content-Length: %d" % size)
    elif framing in ("chunked", "both"):
        codings = draw(
            _weighted((30, (b"chunked",)), *((1, (c,)) for c in _CODINGS[1:]), (1, (b"chunked", b"chunked")))
        )
        fields += [b"Transfer-Encoding: " + coding for coding in codings]
        if framing == "both":
            fields.append(b"Content-Length: %d" % len(body))
        payload = draw(_chunked(body))
    elif framing == "none":
        payload = b""
    order = draw(st.permutations(range(len(fields))))
    ends = draw(_weighted((40, "crlf"), (1, "lf"), (1, "one lf"), (1, "cr crlf")))
    lines = [method + before + path + query + fragment + after + version] + [fields[i] for i in order] + [b""]
    out = bytearray()
    odd = draw(st.integers(0, len(lines) - 1))
    for i, line in enumerate(lines):
        if ends == "lf" or (ends == "one lf" and i == odd):
            out += line + b"\n"
        elif ends == "cr crlf" and i == odd:
            out += line + b"\r\r\n"
        else:
            out += line + b"\r\n"
    return bytes(out) + payload


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    count = draw(_weighted((3, 2), (2, 1), (2, 3)))
    out = bytearray()
    for index in range(count):
        if index:
            out += draw(
                _weighted(
                    (30, b""),
                    (2, b"\r\n"),
                    (1, b"\n"),
                    (1, b"\r"),
                    (1, b"\r\n\r\n"),
                    (1, b" "),
                    (1, b"NOT HTTP\r\n\r\n"),
                )
            )
        out += draw(request_bytes(index))
    if draw(_weighted((11, False), (1, True))):
        del out[draw(st.integers(0, len(out) - 1)) :]
    return bytes(out)


_GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"

# One stream per rule, checked by the same verdict as the fuzzed ones. Those
# marked "router bug" fail until router/http/server/ is fixed; the rest pin
# each difference allowed above to the case that shows it.
PINNED = {
    # RFC 9110 7.8: an Upgrade is ignored, its request's body read, the next request read.
    "upgrade with a body": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b'Content-Length: 13\r\n\r\n{"model":"m"}' + _GET_MODELS
    ),
    # Router bug: the body of an ignored Upgrade is read by a fresh parser fed a
    # POST head, and the request takes that parser's method: a GET is
    # forwarded as a chat request (it is a 405), ...
    "upgrade with a body on a GET": (
        b"GET /v1/chat/completions HTTP/1.1\r\nHost: r\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b'Content-Length: 13\r\n\r\n{"model":"m"}'
    ),
    # ... and a HEAD is answered with a body, which the client takes for the next answer.
    "upgrade with a body on a HEAD": (
        b"HEAD /v1/models HTTP/1.1\r\nHost: r\r\nConnection: upgrade\r\nUpgrade: h2c\r\nContent-Length: 1\r\n\r\nx"
        + _GET_MODELS
    ),
    # RFC 9112 9.3 and C.2.2: an HTTP/1.0 connection persists with keep-alive (h11 never keeps one).
    "HTTP/1.0 keep-alive": b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + _GET_MODELS,
    # Router bug: close wins over keep-alive (RFC 9112 9.3), and the server
    # must process no further request (RFC 9112 9.6); llhttp keeps HTTP/1.0 alive.
    "HTTP/1.0 keep-alive, close": b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n" + _GET_MODELS,
    # Router bug: Proxy-Connection is no Connection (RFC 9112 9.3 reads only
    # Connection); llhttp takes it for one, closing here without an answer to
    # the second request ...
    "Proxy-Connection: close": b"GET /v1/models HTTP/1.1\r\nHost: r\r\nProxy-Connection: close\r\n\r\n" + _GET_MODELS,
    # ... and reading on after an HTTP/1.0 request that ends the connection.
    "Proxy-Connection: keep-alive on HTTP/1.0": (
        b"GET /v1/models HTTP/1.0\r\nProxy-Connection: keep-alive\r\n\r\n" + _GET_MODELS
    ),
    # Router bug: a trailer field is not merged into the head (RFC 9110
    # 6.5.1, and server.py says so); llhttp takes a trailer Connection: close
    # for the head's and the next request is refused.
    "Connection: close as a trailer field": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\nConnection: close\r\n\r\n" + _GET_MODELS
    ),
    # Router bug: a transfer coding other than chunked is not implemented, so
    # the request is refused (RFC 9112 6.1: 501); the router forwards the
    # body still gzip-coded, as if it were not, where h11 refuses it.
    "Transfer-Encoding: gzip, chunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b'd\r\n{"model":"m"}\r\n0\r\n\r\n'
    ),
    # Router bug: an HTTP/1.0 client gets no 1xx, and its Expect: 100-continue
    # is ignored (RFC 9110 15.2 and 10.1.1); the router sends it a 100.
    "Expect: 100-continue on HTTP/1.0": (
        b'POST /v1/chat/completions HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 13\r\n\r\n{"model":"m"}'
    ),
    # Router bug: a bare CR is no line end (RFC 9112 2.2); llhttp skips it before a request line.
    "bare CR before a request line": b"\r" + _GET_MODELS,
    # RFC 9112 2.2: empty lines before a request line are ignored, CRLF or LF.
    "empty lines before a request": b"\r\n\n" + _GET_MODELS + b"\r\n" + _GET_MODELS,
    # RFC 9112 3: the request-line may be split on runs of SP.
    "runs of SP in the request line": b"GET  /v1/models  HTTP/1.1\r\nHost: r\r\n\r\n" + _GET_MODELS,
    # RFC 9110 5.6.1: an empty list element is no coding.
    "empty element in Transfer-Encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: , chunked\r\n\r\n"
        b'd\r\n{"model":"m"}\r\n0\r\n\r\n' + _GET_MODELS
    ),
    # RFC 9110 8.6: any number of leading zeros (h11 stops at 20 digits).
    "long Content-Length": (
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 0000000000000000000013\r\n\r\n{"model":"m"}'
    ),
    # Trailer fields are dropped, never forwarded (RFC 9110 6.5.1).
    "trailer fields": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'd;ext=1\r\n{"model":"m"}\r\n0\r\nX-Trailer: t\r\nAuthorization: Bearer sk-smuggled\r\n\r\n' + _GET_MODELS
    ),
    # Refused, each as the policy it names allows, and nothing after it read:
    "Content-Length and Transfer-Encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n" + _GET_MODELS
    ),
    "repeated Content-Length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 13\r\nContent-Length: 13\r\n\r\n"
        b'{"model":"m"}' + _GET_MODELS
    ),
    "Transfer-Encoding on HTTP/1.0": (
        b'POST /v1/chat/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\nd\r\n{"model":"m"}\r\n0\r\n\r\n'
    ),
    "obs-fold": b"GET /v1/models HTTP/1.1\r\nHost: r\r\nX-Fold: a\r\n b\r\n\r\n" + _GET_MODELS,
    "bare LF": b"GET /v1/models HTTP/1.1\nHost: r\n\n" + _GET_MODELS,
    "control character": b"GET /v1/models HTTP/1.1\r\nHost: r\r\nX-Ctl: a\x01b\r\n\r\n" + _GET_MODELS,
    "invalid Host": b"GET /v1/models HTTP/1.1\r\nHost: a/b@c\r\n\r\n" + _GET_MODELS,
    "HTTP/2.0 request line": b"GET /v1/models HTTP/2.0\r\nHost: r\r\n\r\n" + _GET_MODELS,
    # RFC 9110 2.5: a higher minor version is served as HTTP/1.1, and the connection persists.
    "HTTP/1.2 request line": b"GET /v1/models HTTP/1.2\r\nHost: r\r\n\r\n" + _GET_MODELS,
    # RFC 9110 5.5 and 5.6.1: OWS and empty elements around chunked leave it chunked
    # (llhttp reads them as another coding; the router reads the body anew as chunked).
    "OWS after chunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\t\r\n\r\n"
        b'd\r\n{"model":"m"}\r\n0\r\n\r\n' + _GET_MODELS
    ),
    "a comma after chunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked,\r\n\r\n"
        b'd\r\n{"model":"m"}\r\n0\r\n\r\n' + _GET_MODELS
    ),
    "unknown method behind a request": _GET_MODELS + b"FOO /v1/models HTTP/1.1\r\nHost: r\r\n\r\n" + _GET_MODELS,
    "userinfo in an absolute-form target": b"GET http://u:p@r/v1/models HTTP/1.1\r\nHost: r\r\n\r\n" + _GET_MODELS,
    "unknown method": b"FOO /v1/models HTTP/1.1\r\nHost: r\r\n\r\n" + _GET_MODELS,
    "CONNECT": b"CONNECT /v1/models HTTP/1.1\r\nHost: r\r\n\r\n" + _GET_MODELS,
    "whitespace after a chunk size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'd \r\n{"model":"m"}\r\n0\r\n\r\n'
    ),
    "Content-Length in the trailer section": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'd\r\n{"model":"m"}\r\n0\r\nContent-Length: 13\r\n\r\n'
    ),
    "Content-Length over the limit": b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 99999\r\n\r\n",
    "target over 8190 bytes": b"GET /v1/models?" + b"a" * MAX_LINE + b" HTTP/1.1\r\nHost: r\r\n\r\n",
    # Refused by both: where h11 stops, the router stops.
    "conflicting Content-Length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 13\r\nContent-Length: 14\r\n\r\n"
        b'{"model":"m"}' + _GET_MODELS
    ),
    "chunk size not hex": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'z\r\n{"model":"m"}\r\n0\r\n\r\n'
    ),
    "no Host": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "a smuggled request in a body": (
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 13\r\n\r\n{"model":"m"}'
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n\r\n" + _GET_MODELS
    ),
}
