"""The client port's HTTP/1.1 parsing, fuzzed against h11 as the reference: what both fuzzes share.

Hypothesis writes byte streams for one client connection (tests/support/streams.py):
valid, near-valid and hostile requests, several pipelined. Each stream goes to
a live server (tests/http/server/test_differential.py: the server alone, with
a stub handler; tests/gateway/test_differential.py: a router in front of a fake
replica) and, in this process, through h11 acting as a strict server, which
says where each request begins and ends and which one is the first it rejects.
The server must agree with it:

- every request h11 accepts before its first error is answered, in order,
  with the answer the router's handler gives that request; a chat request
  for model "m" reaches the handler (or the replica) with the same target
  (less the fragment), the same body bytes and no trailer field in its head
  (and the replica, no hop-by-hop or framing header of the client's);
- the request h11 rejects is refused (an error answer or a closed
  connection), and neither it nor anything after it is handled.

Where the two may differ, by an RFC's leave or a policy the router documents
(router/http/server/), the difference is named with its reference, in
h11_reference.py's `lenient_reading` (the router accepts what h11 refuses, never
about where a message ends) and below in `refusal_policy` (the router refuses what h11 accepts; allowed
only as a refusal: such a request is never handled, nor anything after it).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tests.support.h11_reference import (
    ANSWER_SECONDS,
    MAX_BODY,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_LINE,
    QUIET_SECONDS,
    REFUSALS,
    Parsed,
    Reference,
    expected_status,
    forwarded,
    forwarded_stream,
    h11_one,
    lenient_reading,
    reference,
)

# Where the router may refuse what h11 accepts ---------------------------------------------------

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~]|\\[\t -~])*"'
# RFC 9112 7.1 with llhttp's strictness: no whitespace around the size or the
# extensions (the BWS RFC 9112 7.1.1 tolerates is a known smuggling vector).
_STRICT_CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]+)(?:;" + _TOKEN + rb"(?:=(?:" + _TOKEN + rb"|" + _QUOTED + rb")?)?)*\r\n"
)
_STRICT_FIELD = re.compile(_TOKEN + rb":[ \t]*(?:[!-~\x80-\xff]+(?:[ \t]+[!-~\x80-\xff]+)*)?[ \t]*")
_BARE_LF = re.compile(rb"(?<!\r)\n")
_BARE_CR = re.compile(rb"\r(?!\n)")
_OBS_FOLD = re.compile(rb"\n[ \t]")
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# uri-host [ ":" port ] (RFC 9110 7.2, RFC 3986 3.2.2), written here apart from the router's.
_URI_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?")
_STANDARD_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE"})
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding"})


def _raw_fields(head: bytes) -> list[tuple[bytes, bytes]]:
    lines = re.split(rb"\r?\n", head)[1:]
    return [
        (name.strip().lower(), value.strip()) for name, _, value in (line.partition(b":") for line in lines if line)
    ]


def head_policy(p: Parsed) -> str | None:
    head = p.head
    if _BARE_LF.search(head):
        return "bare LF line end: RFC 9112 2.2 lets a recipient take it (MAY); strict llhttp does not"
    if _BARE_CR.search(head):
        return "bare CR: invalid by RFC 9112 2.2"
    if _OBS_FOLD.search(head):
        return "obs-fold: RFC 9112 5.2 lets a server reject it with 400"
    if _CTL.search(head.replace(b"\r\n", b"").replace(b"\t", b"")):
        return "control character in a field value: invalid by RFC 9110 5.5 (h11 allows all but NUL)"
    fields = _raw_fields(head)
    if len(p.target) > MAX_LINE:
        return "target over 8190 bytes: 414 (RFC 9110 15.5.15), the router's limit"
    if (
        any(len(line) > MAX_LINE - 64 for line in head.split(b"\n"))
        or len(head) > MAX_HEAD - 1024
        or len(fields) > MAX_HEADERS
    ):
        return "header line, head or field count over the router's limit: 431 (RFC 6585 5)"
    if not p.version.startswith(b"1."):
        # (A higher 1.x is served as 1.1, RFC 9110 2.5, as h11 reads it: no refusal allowed.)
        return "HTTP major version other than 1: 505 (RFC 9110 15.6.6); h11 takes any digit.digit"
    if p.method == b"CONNECT":
        return "CONNECT: 405, the router is no forward proxy (RFC 9110 9.3.6)"
    if p.method not in _STANDARD_METHODS:
        # llhttp knows a fixed list of methods and refuses the rest.
        return "a method outside RFC 9110's: RFC 9110 9.1 lets a server refuse one it does not recognise"
    if re.match(rb"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@]*@", p.target):
        return "userinfo in an absolute-form target: RFC 9110 4.2.4, to be treated as an error"
    if any(_URI_HOST.fullmatch(value) is None for value in p.values(b"host")):
        return "invalid Host value: 400 (RFC 9112 3.2); h11 does not check it"
    lengths = [value for name, value in fields if name == b"content-length"]
    if len(lengths) > 1 or any(b"," in value for value in lengths):
        return "repeated Content-Length: RFC 9112 6.3 lets a recipient reject it (h11 takes one value)"
    if lengths and lengths[0].isdigit() and int(lengths[0]) > MAX_BODY:
        return "Content-Length over max_body_bytes: 413 (RFC 9110 15.5.14)"
    if p.chunked and p.version == b"1.0":
        return "Transfer-Encoding on HTTP/1.0: faulty framing by RFC 9112 6.1"
    if p.chunked and lengths:
        return "Transfer-Encoding with Content-Length: RFC 9112 6.1 lets a server reject it"
    return None


def chunked_policy(body: bytes) -> str | None:
    """Why llhttp may refuse a chunked body h11 reads (wholly or so far)."""
    pos = 0
    total = 0
    while True:
        line = _STRICT_CHUNK_LINE.match(body, pos)
        if line is None:
            rest = body[pos:]
            if b"\n" in rest or not (
                _STRICT_CHUNK_LINE.fullmatch(rest + b"\r\n") or _STRICT_CHUNK_LINE.fullmatch(rest + b"0\r\n")
            ):
                return "chunk-size line outside llhttp's strict grammar (whitespace, extensions: RFC 9112 7.1.1)"
            return None
        digits = line.group(1).lstrip(b"0")
        if len(digits) > 16:
            return "chunk size over 64 bits: llhttp refuses it"
        size = int(line.group(1), 16)
        total += size
        if total > MAX_BODY:
            return "chunked body over max_body_bytes: 413 (RFC 9110 15.5.14)"
        pos = line.end()
        if size == 0:
            break
        pos += size + 2
        if pos > len(body):
            return None
    while True:
        end = body.find(b"\r\n", pos)
        field = body[pos:] if end < 0 else body[pos:end]
        if end >= 0 and not field:
            return None
        if _BARE_LF.search(field) or _BARE_CR.search(field) or field[:1] in (b" ", b"\t"):
            return "bare LF or obs-fold in the trailer section (RFC 9112 2.2, 5.2)"
        if end >= 0 and _STRICT_FIELD.fullmatch(field) is None:
            return "trailer field outside the field grammar (RFC 9110 5.5)"
        if field.partition(b":")[0].lower() in _FRAMING_FIELDS:
            return "framing field in the trailer section: RFC 9110 6.5.1 forbids sending it; llhttp refuses it"
        if end < 0:
            return None
        pos = end + 2


def refusal_policy(p: Parsed) -> str | None:
    head = head_policy(p)
    if head is not None:
        return head
    return chunked_policy(p.raw[len(p.head) :]) if p.chunked else None


_COMPLETIONS = (
    b"\r\n\r\n",
    b"\r\n",
    b"\nHost: router\r\n\r\n",
    b": v\r\n\r\n",
    b" HTTP/1.1\r\nHost: router\r\n\r\n",
    b"1\r\nHost: router\r\n\r\n",
    b" / HTTP/1.1\r\nHost: router\r\n\r\n",
)


def tail_policy(ref: Reference) -> str | None:
    """Why the router may refuse the request h11 has not finished reading."""
    if ref.unfinished is not None:
        return refusal_policy(ref.unfinished)
    # llhttp checks bytes as they come; h11 a line once it ends. The router
    # may refuse an unfinished head if every way h11 could go on fails, or
    # if a way h11 goes on shows a reason to refuse.
    for completion in _COMPLETIONS:
        data = ref.tail + completion
        _, parsed, _, _ = h11_one(data)
        if parsed is None and (lenient := lenient_reading(data)) is not None:
            _, parsed, _, _ = h11_one(lenient)
        if parsed is not None:
            return refusal_policy(parsed)
    return "an unfinished head that h11 rejects however it goes on"


class Live(Protocol):
    """A server on its own event loop, spoken to over blocking sockets."""

    @property
    def address(self) -> tuple[str, int]: ...

    def reset(self) -> None:
        """Forget what was handled and refused so far."""

    def settled(self) -> tuple[list[Any], int]:
        """What was handled (the chat requests for model "m", in order) and refused, once the connection is gone."""

    def forwarding(self, p: Parsed, seen: Any) -> list[str]:
        """What is wrong with how a request h11 read reached the handler (or the replica), if anything."""


# What the router did -----------------------------------------------------------------------------


@dataclass
class Answer:
    """One answer the live server gave, parsed from its bytes."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool

    @property
    def close(self) -> bool:
        return b"close" in {t.strip().lower() for t in self.headers.get(b"connection", b"").split(b",")}


@dataclass
class Observed:
    """What a live server did with one stream: its answers, whether it closed, what it refused and handled."""

    answers: list[Answer]
    interim: int
    closed: bool
    refusals: int
    seen: list[Any]
    leftover: bytes


_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([0-9]{3}) ")


def parse_answers(buf: bytes, heads: list[bool], eof: bool) -> tuple[list[Answer], int, bytes]:
    """The whole answers at the start of `buf` (heads[i]: the i-th answers a HEAD), 1xx counted apart."""
    answers: list[Answer] = []
    interim = 0
    pos = 0
    while (end := buf.find(b"\r\n\r\n", pos)) >= 0:
        lines = buf[pos:end].split(b"\r\n")
        status_line = _STATUS_LINE.match(lines[0])
        if status_line is None:
            # Not an answer where one should begin: left over, and reported.
            break
        status = int(status_line.group(1))
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        start = end + 4
        if 100 <= status < 200:
            interim += 1
            pos = start
            continue
        length = int(headers.get(b"content-length", b"-1"))
        head_only = len(answers) < len(heads) and heads[len(answers)]
        if head_only and eof and length > 0 and len(buf) - start == length:
            # A refused request that began "HEAD " but whose request line the
            # router could not read: the refusal, the last answer, has its body.
            head_only = False
        if head_only or status in (204, 304):
            answers.append(Answer(status, headers, b"", True))
            pos = start
        elif length >= 0:
            if len(buf) - start < length:
                if eof:
                    answers.append(Answer(status, headers, buf[start:], False))
                    pos = len(buf)
                break
            answers.append(Answer(status, headers, buf[start : start + length], True))
            pos = start + length
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body, after = _dechunk(buf, start)
            if after < 0:
                if eof:
                    answers.append(Answer(status, headers, body, False))
                    pos = len(buf)
                break
            answers.append(Answer(status, headers, body, True))
            pos = after
        else:
            if not eof:
                break
            answers.append(Answer(status, headers, buf[start:], True))
            pos = len(buf)
    return answers, interim, buf[pos:]


def _dechunk(buf: bytes, pos: int) -> tuple[bytes, int]:
    body = bytearray()
    while True:
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return bytes(body), -1
        size = int(buf[pos:end].split(b";", 1)[0], 16)
        pos = end + 2
        if size == 0:
            return (bytes(body), pos + 2) if buf[pos : pos + 2] == b"\r\n" else (bytes(body), -1)
        if len(buf) < pos + size + 2:
            return bytes(body), -1
        body += buf[pos : pos + size]
        pos += size + 2


def exchange(live: Live, stream: bytes, ref: Reference) -> Observed:
    """Send `stream` on one connection; read what the router answers until it closes or owes nothing more."""
    heads = [p.method == b"HEAD" for p in ref.requests]
    # The request h11 rejected may still be a HEAD: its refusal is a head only (RFC 9110 9.3.2).
    heads.append(ref.tail.lstrip(b"\r\n").startswith(b"HEAD "))
    owed = len(ref.requests) + (1 if ref.end == "error" else 0)
    live.reset()
    buf = b""
    eof = False
    with socket.create_connection(live.address, timeout=ANSWER_SECONDS) as sock:
        try:
            sock.sendall(stream)
        except OSError:
            # The router closed after a refusal, before taking every byte.
            pass
        deadline = time.monotonic() + ANSWER_SECONDS
        while not eof and (remaining := deadline - time.monotonic()) > 0:
            answers, _, _ = parse_answers(buf, heads, eof=False)
            last = answers[-1] if answers else None
            if last is not None and last.close and last.status in (413, 503):
                # A refused body is read on and dropped for a while: no close to wait for.
                break
            quiet = len(answers) >= owed and (last is None or not last.close)
            sock.settimeout(min(QUIET_SECONDS, remaining) if quiet else remaining)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                if quiet:
                    break
                continue
            except ConnectionResetError:
                eof = True
                break
            eof = not data
            buf += data
    seen, refusals = live.settled()
    answers, interim, leftover = parse_answers(buf, heads, eof=eof)
    return Observed(answers, interim, eof, refusals, seen, leftover)


# The verdict ----------------------------------------------------------------------------------


def disagreements(ref: Reference, got: Observed, forwarding: Callable[[Parsed, Any], list[str]]) -> list[str]:
    problems: list[str] = []
    answers = got.answers
    refused = got.refusals > 0
    refusal_answered = refused and bool(answers) and answers[-1].status in REFUSALS and answers[-1].close
    accepted = len(answers) - (1 if refusal_answered else 0)
    n = len(ref.requests)
    if got.leftover:
        problems.append(f"bytes after the last whole answer: {got.leftover[:200]!r}")
    if any(not answer.complete for answer in answers):
        problems.append("an answer ended before its end")
    # RFC 9110 10.1.1 and 15.2: only an HTTP/1.1 (or later) request that asks
    # for it may get a 100 (Continue); h11 waits for the body of no other.
    heads = [*ref.requests, *([ref.unfinished] if ref.unfinished is not None else [])]
    asked = [p for p in heads if p.asks_for_100()]
    if got.interim > len(asked):
        problems.append(f"{got.interim} interim answers to {len(asked)} requests that asked for a 100 (Continue)")
    if accepted > n:
        problems.append(
            f"the router answered {accepted} requests as read; h11 reads {n} before {ref.end!r} {ref.error}"
        )
    for i, (p, answer) in enumerate(zip(ref.requests, answers[:accepted], strict=False)):
        if answer.status != expected_status(p):
            problems.append(
                f"request {i} ({p.method!r} {p.target[:80]!r}): answered {answer.status}, expected {expected_status(p)}"
            )
    owed = [p for p in ref.requests[: min(accepted, n)] if forwarded(p)]
    if len(got.seen) != len(owed):
        problems.append(f"the replica received {len(got.seen)} requests, expected {len(owed)}")
    for i, (p, seen) in enumerate(zip(owed, got.seen, strict=False)):
        problems += [f"forwarded request {i}: {problem}" for problem in forwarding(p, seen)]
    if accepted < n:
        p = ref.requests[accepted]
        if not (refused and (refusal_answered or got.closed)):
            problems.append(f"the router stopped at request {accepted} ({p.head[:80]!r}) without refusing it")
        elif refusal_policy(p) is None:
            problems.append(
                f"the router refused request {accepted}, which h11 accepts, for no allowed reason: {p.raw!r}"
            )
    elif accepted == n:
        if ref.end == "error":
            if not refused:
                problems.append(f"h11 rejects request {n} ({ref.error}) but the router did not refuse it")
            elif not (refusal_answered or got.closed):
                problems.append("the router neither answered its refusal nor closed")
        elif ref.end == "partial":
            if refused and tail_policy(ref) is None:
                problems.append(f"the router refused an unfinished request with no allowed reason: {ref.tail!r}")
        elif refused and not ref.closed_by_stream:
            problems.append("the router refused bytes h11 reads as whole requests")
        if ref.end == "close" and not got.closed:
            problems.append("the router kept the connection open after its last request ended it (RFC 9112 9.6)")
        if ref.end in ("idle", "partial") and not refused and got.closed:
            problems.append("the router closed a connection that persists (RFC 9112 9.3)")
    return problems


def check(live: Live, stream: bytes) -> None:
    ref = reference(stream, forwarded_stream)
    got = exchange(live, stream, ref)
    problems = disagreements(ref, got, live.forwarding)
    assert not problems, (
        f"router and h11 disagree on {stream!r}\n"
        f"h11: {len(ref.requests)} requests then {ref.end!r} {ref.error}\n"
        f"router: answers {[a.status for a in got.answers]}, closed={got.closed}, "
        f"refusals={got.refusals}, forwarded {[(s.path, s.body[:40]) for s in got.seen]}\n- " + "\n- ".join(problems)
    )
