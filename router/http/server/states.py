"""A client connection's two states and every way each may change, stated as tables (as h11 states its own).

`Reading` is what the connection expects from the client next; `Answering`
what it does for the client. A connection changes either only by looking up
(its state, an event) here: a pair that is not in a table is a bug in the
server, and raises KeyError where it happens, never a state no one meant.
(It looks up a table's column for the event, `on()`: one dict lookup by the
state alone, since a transition is made several times per request.)

Besides them a connection keeps its queue of requests read ahead, a refusal
owed after them, whether a 100 (Continue) is owed to the request arriving,
and its deadlines (reader.py, intake.py); an answer's own persistence is its
writer's (writer.py).
"""

from __future__ import annotations

import enum
from typing import TypeVar


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
