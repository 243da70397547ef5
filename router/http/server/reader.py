"""llhttp's reading of one client connection: each request's head, body and trailers, within their byte bounds.

Requests are parsed by llhttp in strict mode (the parser aiohttp uses):
conflicting lengths, bare LF, obs-fold, NUL, a negative length are refused.
Heads are bounded as their bytes arrive, not once a field is complete
(httptools joins a field's pieces with `+=`, quadratic for an endless line):
a target over 8 KiB is 414, a header line over 8 KiB, a head over 64 KiB or
more than 100 fields 431. Chunk framing and trailers are bounded the same
way, and trailer fields are dropped, never merged into the head (RFC 9110
6.5.1). Bodies are bounded per request (`max_body_bytes`: 413) and across
all connections together (`max_buffered_body_bytes`: 503), counted as their
bytes arrive. A head judged acceptable (head.py) is handed on (intake.py),
and so is the request read whole.

Two cases need llhttp read anew from a point: an Upgrade the router ignores
(llhttp hands what follows the head over as another protocol's bytes), and a
chunked coding llhttp does not take for chunked where RFC 9110 does (OWS, an
empty list element; llhttp reads such a body to the close). A fresh parser
is then primed with the framing of the body still to come, and fed on.

RequestReader is the object llhttp calls back, one per connection; what it
finds goes to the connection's Intake (intake.py), called as the concrete
class it is. The connection feeds llhttp its reads (connection.py); when to
read anew is the intake's to decide, and the fresh parser is made here
(renew()).
"""

from __future__ import annotations

from typing import Final

import httptools

from router.http.messages import Request
from router.http.server.deadlines import ReadDeadline
from router.http.server.flow import Holding, buffers_full
from router.http.server.head import LENIENCIES, Refusal, judge
from router.http.server.intake import Intake
from router.http.server.port import Port
from router.http.server.states import R_BODY, R_DISCARD, R_HEAD, R_STOPPED, ConnectionState

# (Final: a compiled module reads them as constants, not from its dict.)
MAX_LINE: Final = 8190
MAX_HEAD: Final = 64 * 1024
MAX_HEADERS: Final = 100
# The method, spaces and version around a target: a request line longer than
# the longest target by more than this is a header line, answered 431.
_REQUEST_LINE_SLACK: Final = 32


class _Stop(Exception):
    """Raised in a parser callback to stop llhttp; why is in the reader (a refusal, raw chunks) or its state."""


class RequestReader:
    """What llhttp calls back on one client connection: each request gathered within its bounds, and handed on."""

    # Slots: thousands of connections may wait at once (held requests, open
    # streams), and a dict per connection would be most of their memory.
    __slots__ = (
        "_body",
        "_chunked",
        "_fields",
        "_framed",
        "_framing",
        "_line",
        "_priming",
        "_refusal",
        "_request",
        "_target",
        "_target_size",
        "_unframed",
        "_upgrade_framing",
        "body_size",
        "deadline",
        "holding",
        "intake",
        "parser",
        "port",
        "state",
        "switching",
    )

    def __init__(
        self, port: Port, state: ConnectionState, deadline: ReadDeadline, holding: Holding, intake: Intake
    ) -> None:
        self.port = port
        self.state = state
        self.deadline = deadline
        # Body bytes this connection holds in the budget every connection shares.
        self.holding = holding
        self.intake = intake
        self.parser = new_parser(self)
        self._target: list[bytes] = []
        self._target_size = 0
        self._fields: list[tuple[bytes, bytes]] = []
        # The request whose head was taken, its body still to come.
        self._request: Request | None = None
        self._body: list[bytes] = []
        self.body_size = 0
        # The line still arriving of a head (or of a chunked body's framing): its bytes so far.
        self._line = 0
        # The body being read is chunked; bytes of framing read since its last data.
        self._chunked = False
        self._framing = 0
        # llhttp has read a chunk-size line of the chunked body being read (on_chunk_header):
        # until then, body bytes may be the raw chunks of a coding llhttp did not take for
        # chunked, and are handed to a fresh parser that does (_unframed).
        self._framed = False
        self._unframed: bytes | None = None
        # An ignored Upgrade: llhttp hands the body over as the new protocol's
        # bytes, so a fresh parser is fed this framing to read it as a body.
        self._upgrade_framing: bytes | None = None
        # A fresh parser is being fed that framing: its callbacks are not a request's.
        self._priming = False
        # Set by a parser callback that refuses the request, before it stops llhttp.
        self._refusal: Refusal | None = None
        # A request that may switch protocols was read (the port's upgrade_check): the bytes
        # after its head, the new protocol's, held here until its handler switches or answers.
        self.switching: bytearray | None = None

    def drop_body(self) -> None:
        """The request is refused: nothing of its body is kept, nor read anew."""
        self._body = []
        self._upgrade_framing = None
        self.holding.drop_current()

    def refused_head_only(self) -> bool:
        """Whether the request being refused is a HEAD, whose answer is a head only (RFC 9110 9.3.2).

        llhttp keeps the previous request's method until a new one is read:
        only a request line begun, its target arriving, has its own.
        """
        return bool(self._target) and self.parser.get_method() == b"HEAD"

    # Reading anew (intake.py) ---------------------------------------------------------------

    def take_refusal(self) -> Refusal | None:
        """The refusal a callback stopped llhttp for, if one did: handed over once."""
        refusal, self._refusal = self._refusal, None
        return refusal

    def take_unframed(self) -> bytes | None:
        """The raw chunks of a coding llhttp did not take for chunked, if it stopped at them: handed
        over once, and the next fresh parser primed to read them as chunked."""
        unframed, self._unframed = self._unframed, None
        if unframed is not None:
            self._upgrade_framing = b"Transfer-Encoding: chunked\r\n"
        return unframed

    def renew(self) -> bool:
        """A fresh parser after an ignored Upgrade, primed to read the request's body if it has
        one (the same for a body to be read anew); True when primed."""
        framing = self._upgrade_framing
        self._upgrade_framing = None
        self.parser = new_parser(self)
        if framing is None or self.state.reading is not R_BODY:
            return False
        self._priming = True
        # Ours and valid: llhttp takes it whole, and only its framing matters.
        self.parser.feed_data(b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n")
        return True

    def bound(self, data: bytes, body_before: int) -> None:
        """A read that left a request unfinished (its head, or a chunked body): bounded now.
        `body_before`: the body's size before the read."""
        reading = self.state.reading
        if reading is R_HEAD:
            self._bound_head(data)
        elif reading is R_BODY and self._chunked:
            if self.body_size != body_before:
                self._framing = 0
            else:
                self._bound_framing(data)

    # Byte bounds ----------------------------------------------------------------------

    def _head_size(self) -> int:
        """Bytes of the head's fields so far: counted only when it matters, not per field."""
        return self._target_size + sum(len(name) + len(value) + 4 for name, value in self._fields)

    def _bound_head(self, data: bytes) -> None:
        """A read that left a head unfinished: its current line and whole size are bounded now."""
        newline = data.rfind(b"\n")
        self._line = len(data) - newline - 1 if newline >= 0 else self._line + len(data)
        if self._line > MAX_LINE + _REQUEST_LINE_SLACK:
            self.intake.refuse(Refusal(431, "header_line_too_long", f"A header line is longer than {MAX_LINE} bytes."))
        elif self._head_size() + self._line > MAX_HEAD:
            self.intake.refuse(Refusal(431, "head_too_large", f"The request head is larger than {MAX_HEAD} bytes."))

    def _bound_framing(self, data: bytes) -> None:
        """A read of a chunked body that carried none of it: chunk framing or trailers, bounded as a head is.

        Trailer fields are dropped, but httptools still gathers each one, with
        `+=`: without a bound an endless trailer line costs memory and CPU
        without end.
        """
        self._framing += len(data)
        newline = data.rfind(b"\n")
        self._line = len(data) - newline - 1 if newline >= 0 else self._line + len(data)
        if self._line > MAX_LINE or self._framing > MAX_HEAD:
            self.intake.refuse(
                Refusal(431, "trailers_too_large", f"Chunk framing or trailers over {MAX_HEAD} bytes without data.")
            )

    def _stop(self, refusal: Refusal) -> _Stop:
        """What a callback raises to refuse the request: kept here, since httptools wraps what callbacks raise."""
        self._refusal = refusal
        return _Stop()

    # llhttp callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._priming:
            return
        state = self.state
        if state.reading is R_STOPPED:
            # Nothing more is read on this connection: stop the parser here.
            raise _Stop
        state.begin()
        # (The body list is emptied where the last one was taken.)
        self._target = []
        self._target_size = 0
        self._fields = []
        self.body_size = 0
        self._line = 0
        self.holding.current = 0
        # An idle connection's deadline ends here; a head that does not
        # arrive whole in this read gets its own (Intake.unfinished).
        self.deadline.due = 0.0

    def on_url(self, url: bytes) -> None:
        if self._priming:
            return
        self._target.append(url)
        self._target_size += len(url)
        if self._target_size > MAX_LINE:
            raise self._stop(Refusal(414, "target_too_long", f"The request target is longer than {MAX_LINE} bytes."))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state.reading is not R_HEAD:
            # A trailer field of a chunked body (or the primed parser's own):
            # never merged into the head (RFC 9110 6.5.1), where it could pass for Authorization.
            return
        if len(name) + len(value) > MAX_LINE:
            raise self._stop(Refusal(431, "header_line_too_long", f"A header line is longer than {MAX_LINE} bytes."))
        self._fields.append((name, value))
        if len(self._fields) > MAX_HEADERS:
            raise self._stop(
                Refusal(431, "too_many_headers", f"The request has more than {MAX_HEADERS} header fields.")
            )

    def on_headers_complete(self) -> None:
        if self._priming:
            # The same body read on by a fresh parser.
            self._priming = False
            self.intake.body_resumed()
            return
        fields = self._fields
        # A whole head read at once was bounded field by field; in all, only
        # when its fields could add up past the bound at all.
        if self._target_size + len(fields) * MAX_LINE > MAX_HEAD and self._head_size() > MAX_HEAD:
            raise self._stop(Refusal(431, "head_too_large", f"The request head is larger than {MAX_HEAD} bytes."))
        parser = self.parser
        pieces = self._target
        verdict = judge(
            self.port.rules,
            parser.get_method(),
            parser.get_http_version(),
            pieces[0] if len(pieces) == 1 else b"".join(pieces),
            fields,
            parser,
        )
        if isinstance(verdict, Refusal):
            raise self._stop(verdict)
        request, length, chunked, continue_asked, upgrade = verdict
        # After an ignored Upgrade another parser reads the body, and its head is not the request's.
        self._request = request
        if chunked:
            self._chunked = True
            self._framed = False
            self._framing = 0
            self._line = 0
        elif self._chunked:
            self._chunked = False
        if upgrade:
            # RFC 9110 7.8: a server may ignore Upgrade and answer in HTTP/1.1.
            if length:
                self._upgrade_framing = b"Content-Length: %d\r\n" % length
            elif chunked:
                self._upgrade_framing = b"Transfer-Encoding: chunked\r\n"
            elif (check := self.port.upgrade_check) is not None and check(request):
                # Its handler may switch the connection (Writer.switch): nothing after
                # this head is HTTP, and the connection ends with this request.
                request.keep_alive = False
                self.switching = bytearray()
        self.intake.head_taken(request, length, chunked, continue_asked)

    def on_chunk_header(self) -> None:
        self._framed = True

    def on_body(self, body: bytes) -> None:
        if self.state.reading is not R_BODY:
            return
        if self._chunked and not self._framed:
            # llhttp did not take the coding for chunked (a trailing HTAB or
            # comma): it reads to the close, and these are the raw chunks.
            self._unframed = body
            raise _Stop
        size = len(body)
        self.body_size += size
        holding = self.holding
        budget = holding.budget
        if self.body_size > budget.max_body:
            message = f"The request body exceeds the limit of {budget.max_body} bytes."
            self.intake.refuse(Refusal(413, "body_too_large", message, "request_too_large"))
            return
        # Counted as it arrives, against every connection's bodies together.
        if budget.held + size > budget.limit:
            self.intake.refuse(buffers_full())
            return
        holding.current += size
        holding.held += size
        budget.held += size
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.state.reading is R_DISCARD:
            self.intake.discarded()
            return
        if self._upgrade_framing is not None:
            # Not the end: llhttp skipped an upgraded request's body; the
            # fresh parser reads it (see renew()).
            return
        request = self._request
        assert request is not None
        body = self._body
        self._body = []
        self.intake.message_read(request, b"".join(body))


def new_parser(reader: RequestReader) -> httptools.HttpRequestParser:
    parser = httptools.HttpRequestParser(reader)
    parser.set_dangerous_leniencies(**LENIENCIES)
    return parser
