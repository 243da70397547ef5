"""A client connection's state machine: its two states and every way each may change, stated as tables.

`Reading` is what the connection expects from the client next; `Answering`
what it does for the client. Either changes only by looking up (its state,
an event) here: a pair that is not in a table is a bug in the server, and
raises KeyError where it happens, never a state no one meant. (A transition
looks up the table's column for its event, `on()`: one dict lookup by the
state alone, since a transition is made several times per request.)

Everything that affects the machine lives in this file, as h11 keeps its
own: `ConnectionState` holds both states, the requests read ahead and
queued, the refusal owed after them and whether a 100 (Continue) is owed to
the request arriving, and has one method per event; what the connection
does once an answer is out is decided here too (`answered()`, a `Next`).
The deadlines are the connection's (deadlines.py); an answer's own
persistence is its writer's (writer.py).
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Final, TypeVar

from router.http.messages import Reply, Request


class Reading(enum.IntEnum):
    """What the connection expects from the client next."""

    IDLE = 0  # between requests: nothing of the next one yet
    HEAD = 1  # a request head, arriving
    BODY = 2  # the body of the request whose head arrived (none, when none was announced)
    DISCARD = 3  # the rest of a refused body, read and dropped
    STOPPED = 4  # nothing more: the connection closes after its answers

    def __repr__(self) -> str:
        return f"Reading.{self.name}"


class Answering(enum.IntEnum):
    """What the connection does for the client."""

    IDLE = 0  # nothing to answer
    ACTIVE = 1  # a handler runs, or its answer drains
    CLOSING = 2  # the last answer is written; closing once it has drained
    CLOSED = 3

    def __repr__(self) -> str:
        return f"Answering.{self.name}"


class Event(enum.IntEnum):
    """What happens to a connection."""

    BEGIN = 0  # a request's first byte
    HEAD_TAKEN = 1  # its head read and judged acceptable
    MESSAGE_READ = 2  # its body read whole, and the connection persists after it
    LAST_MESSAGE_READ = 3  # its body read whole, and nothing after it is read (Connection: close, HTTP/1.0)
    REFUSED = 4  # refused: answered in its turn, then the connection closes
    REFUSED_BODY = 5  # refused (401, 413, 503) with its body read on and dropped for a while
    DISCARDED = 6  # the refused body ended
    STOP = 7  # nothing more is read (closing, a head past its deadline, bytes after the end)
    START = 8  # a request's handler starts
    ANSWERED = 9  # its answer is out, or being drained
    CLOSE = 10  # the connection closes once its writes have drained
    LOST = 11  # the transport is gone


_R = Reading
_A = Answering
_E = Event

READING: dict[tuple[Reading, Event], Reading] = {
    (_R.IDLE, _E.BEGIN): _R.HEAD,
    (_R.HEAD, _E.HEAD_TAKEN): _R.BODY,
    (_R.BODY, _E.MESSAGE_READ): _R.IDLE,
    (_R.BODY, _E.LAST_MESSAGE_READ): _R.STOPPED,
    (_R.IDLE, _E.REFUSED): _R.STOPPED,
    (_R.HEAD, _E.REFUSED): _R.STOPPED,
    (_R.BODY, _E.REFUSED): _R.STOPPED,
    (_R.BODY, _E.REFUSED_BODY): _R.DISCARD,
    (_R.DISCARD, _E.DISCARDED): _R.STOPPED,
    **{(state, _E.STOP): _R.STOPPED for state in Reading},
}

ANSWERING: dict[tuple[Answering, Event], Answering] = {
    (_A.IDLE, _E.START): _A.ACTIVE,
    (_A.ACTIVE, _E.ANSWERED): _A.IDLE,
    (_A.IDLE, _E.CLOSE): _A.CLOSING,
    (_A.ACTIVE, _E.CLOSE): _A.CLOSING,
    (_A.CLOSING, _E.CLOSE): _A.CLOSING,
    (_A.CLOSED, _E.CLOSE): _A.CLOSED,
    **{(state, _E.LOST): _A.CLOSED for state in Answering},
}


State = TypeVar("State", Reading, Answering)


def on(table: dict[tuple[State, Event], State], event: Event) -> dict[State, State]:
    """A table's column for one event: each state it may happen in, and the state it leads to."""
    return {state: after for (state, happened), after in table.items() if happened is event}


# Module-level names for the states and the columns: an Enum member read
# through its class goes through the metaclass's __getattr__, many times per
# request; and Final, so that a compiled module reads them as constants.
R_IDLE: Final = Reading.IDLE
R_HEAD: Final = Reading.HEAD
R_BODY: Final = Reading.BODY
R_DISCARD: Final = Reading.DISCARD
R_STOPPED: Final = Reading.STOPPED
A_IDLE: Final = Answering.IDLE
A_ACTIVE: Final = Answering.ACTIVE
A_CLOSING: Final = Answering.CLOSING
A_CLOSED: Final = Answering.CLOSED

_READING_ON_BEGIN: Final = on(READING, Event.BEGIN)
_READING_ON_HEAD_TAKEN: Final = on(READING, Event.HEAD_TAKEN)
_READING_ON_MESSAGE_READ: Final = on(READING, Event.MESSAGE_READ)
_READING_ON_LAST_MESSAGE_READ: Final = on(READING, Event.LAST_MESSAGE_READ)
_READING_ON_REFUSED: Final = on(READING, Event.REFUSED)
_READING_ON_REFUSED_BODY: Final = on(READING, Event.REFUSED_BODY)
_READING_ON_DISCARDED: Final = on(READING, Event.DISCARDED)
_READING_ON_STOP: Final = on(READING, Event.STOP)
_ANSWERING_ON_START: Final = on(ANSWERING, Event.START)
_ANSWERING_ON_ANSWERED: Final = on(ANSWERING, Event.ANSWERED)
_ANSWERING_ON_CLOSE: Final = on(ANSWERING, Event.CLOSE)
_ANSWERING_ON_LOST: Final = on(ANSWERING, Event.LOST)


class Owed:
    """A refusal's answer, owed after the requests queued ahead of it; then the connection closes."""

    __slots__ = ("head_only", "reply", "request_id")

    def __init__(self, reply: Reply, head_only: bool, request_id: bytes) -> None:
        self.reply = reply
        self.head_only = head_only
        self.request_id = request_id


class Next(enum.IntEnum):
    """What a connection does once an answer is out (ConnectionState.answered)."""

    WAIT = 0  # nothing queued, owed or arriving: idle, under the keep-alive deadline
    NOTHING = 1  # closing or closed already; or a request arriving keeps its own deadline
    CLOSE = 2  # the answer closed the connection, or nothing more is read
    START = 3  # the next request queued starts (take_next())
    OWED = 4  # the refusal owed is answered (take_owed())
    CONTINUE = 5  # the 100 (Continue) owed to the request arriving goes out; its body deadline runs

    def __repr__(self) -> str:
        return f"Next.{self.name}"


N_WAIT: Final = Next.WAIT
N_NOTHING: Final = Next.NOTHING
N_CLOSE: Final = Next.CLOSE
N_START: Final = Next.START
N_OWED: Final = Next.OWED
N_CONTINUE: Final = Next.CONTINUE


class ConnectionState:
    """One connection's state machine: both states, the requests queued, the refusal and the 100 owed."""

    __slots__ = ("answering", "continue_owed", "owed", "pending", "reading")

    def __init__(self) -> None:
        self.reading = R_IDLE
        self.answering = A_IDLE
        # Requests read ahead of their turn, in order.
        self.pending: deque[Request] = deque()
        # The answer of a refused request, owed after those queued ahead of it.
        self.owed: Owed | None = None
        # A `100 Continue` owed to the request still arriving, sent when it is
        # the one being answered (never into another request's answer); no
        # body deadline runs until it is out, since the client waits for it.
        self.continue_owed = False

    def __repr__(self) -> str:
        return f"{self.reading!r} {self.answering!r} pending={len(self.pending)}{' doomed' if self.owed else ''}"

    def quiet(self) -> bool:
        """Nothing is being answered and nothing waits its turn: what is owed now is owed at once."""
        return self.answering is A_IDLE and not self.pending

    # Reading ------------------------------------------------------------------------------

    def begin(self) -> None:
        """A request's first byte."""
        self.reading = _READING_ON_BEGIN[self.reading]

    def head_taken(self) -> None:
        """Its head read and judged acceptable: its body (if any) is read next."""
        self.reading = _READING_ON_HEAD_TAKEN[self.reading]

    def continue_asked(self) -> bool:
        """The request arriving asked for a 100 (Continue): True when it is owed now, else it is owed in its turn."""
        if self.quiet():
            return True
        self.continue_owed = True
        return False

    def read(self, request: Request) -> bool:
        """A request read whole: True when it starts now (it is the one answered), False when it waits its turn.

        (One call for both events, reading it and starting it: this runs for every request.)
        """
        self.continue_owed = False
        # Nothing after a request that closes the connection is read.
        on_read = _READING_ON_MESSAGE_READ if request.keep_alive else _READING_ON_LAST_MESSAGE_READ
        self.reading = on_read[self.reading]
        if self.answering is A_IDLE and not self.pending:
            self.answering = _ANSWERING_ON_START[A_IDLE]
            return True
        self.pending.append(request)
        return False

    def refused(self, owed: Owed, read_on: bool) -> bool:
        """A request refused, its answer `owed` in its turn; `read_on`: its body may be read on and dropped
        for a while. True when it is (the body being read); else nothing more is read."""
        self.continue_owed = False
        self.owed = owed
        if read_on and self.reading is R_BODY:
            self.reading = _READING_ON_REFUSED_BODY[R_BODY]
            return True
        self.reading = _READING_ON_REFUSED[self.reading]
        return False

    def discarded(self) -> bool:
        """A refused body ended: True when the connection closes now (its answers are out)."""
        if self.quiet():
            return True
        self.reading = _READING_ON_DISCARDED[self.reading]
        return False

    def stop(self) -> None:
        """Nothing more is read (closing, a head past its deadline, bytes after the end)."""
        self.reading = _READING_ON_STOP[self.reading]

    def stopped(self) -> bool:
        """Nothing more is read: True when nothing is answered or owed either, and the connection closes."""
        self.reading = _READING_ON_STOP[self.reading]
        return self.quiet() and self.owed is None

    # Answering ----------------------------------------------------------------------------

    def answered(self, keep_alive: bool) -> Next:
        """A request was answered, and the connection persists after it or not: what happens next."""
        answering = self.answering
        if answering is A_ACTIVE and keep_alive and not self.pending and self.reading is R_IDLE and self.owed is None:
            # The usual end: nothing queued, nothing owed; the connection idles.
            self.answering = _ANSWERING_ON_ANSWERED[A_ACTIVE]
            return N_WAIT
        if answering is A_CLOSED or answering is A_CLOSING:
            return N_NOTHING
        self.answering = _ANSWERING_ON_ANSWERED[answering]
        if not keep_alive:
            return N_CLOSE
        if self.pending:
            return N_START
        if self.owed is not None:
            return N_OWED
        if self.reading is R_STOPPED:
            return N_CLOSE
        if self.continue_owed:
            # The request still arriving is now the one being answered.
            self.continue_owed = False
            return N_CONTINUE
        # (A request arriving has its deadline already.)
        return N_NOTHING

    def take_next(self) -> Request:
        """The next request queued, started."""
        self.answering = _ANSWERING_ON_START[self.answering]
        return self.pending.popleft()

    def take_owed(self) -> Owed:
        """The refusal owed, to be answered now."""
        owed, self.owed = self.owed, None
        assert owed is not None
        return owed

    def close(self) -> None:
        """The connection closes once its writes have drained: nothing more is read."""
        self.reading = _READING_ON_STOP[self.reading]
        self.answering = _ANSWERING_ON_CLOSE[self.answering]

    def lost(self) -> None:
        """The transport is gone: nothing more is read or answered, and nothing queued runs."""
        self.answering = _ANSWERING_ON_LOST[self.answering]
        self.reading = _READING_ON_STOP[self.reading]
        self.pending.clear()
