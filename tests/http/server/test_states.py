"""The connection's state machine alone (router/http/server/states.py): events in, states and decisions out."""

from __future__ import annotations

import pytest

from router.http.messages import Reply, Request
from router.http.server.states import Answering, ConnectionState, Next, Owed, Reading


def request(keep_alive: bool = True) -> Request:
    return Request("", "GET", b"/", [], b"", keep_alive, True)


def read_whole(state: ConnectionState, keep_alive: bool = True) -> tuple[Request, bool]:
    """One request's events as the reader sees them: begun, head taken, read whole."""
    state.begin()
    state.head_taken()
    one = request(keep_alive)
    return one, state.read(one)


def test_a_request_read_on_an_idle_connection_starts_at_once_and_its_answer_idles_it() -> None:
    state = ConnectionState()
    _, starts = read_whole(state)
    assert starts
    assert (state.reading, state.answering) == (Reading.IDLE, Answering.ACTIVE)
    assert state.answered(keep_alive=True) is Next.WAIT
    assert (state.reading, state.answering) == (Reading.IDLE, Answering.IDLE)


def test_a_request_read_while_another_is_answered_waits_its_turn_and_starts_after_it() -> None:
    state = ConnectionState()
    read_whole(state)
    second, starts = read_whole(state)
    assert not starts
    assert list(state.pending) == [second]
    assert state.answered(keep_alive=True) is Next.START
    assert state.take_next() is second
    assert state.answering is Answering.ACTIVE
    assert state.answered(keep_alive=True) is Next.WAIT


def test_an_answer_that_closes_the_connection_closes_it_whatever_waits() -> None:
    state = ConnectionState()
    read_whole(state)
    read_whole(state)
    assert state.answered(keep_alive=False) is Next.CLOSE


def test_a_request_that_closes_the_connection_stops_the_reading_and_its_answer_closes() -> None:
    state = ConnectionState()
    read_whole(state, keep_alive=False)
    assert state.reading is Reading.STOPPED
    assert state.answered(keep_alive=True) is Next.CLOSE


def test_a_refusal_behind_a_running_request_is_owed_then_answered_in_its_turn() -> None:
    state = ConnectionState()
    read_whole(state)
    state.begin()
    owed = Owed(Reply(400, b"", []), False, b"")
    assert not state.refused(owed, read_on=False)
    assert state.reading is Reading.STOPPED
    assert not state.quiet()
    assert state.answered(keep_alive=True) is Next.OWED
    assert state.take_owed() is owed
    assert state.owed is None


@pytest.mark.parametrize("status_reads_on", [True, False])
def test_a_refused_body_is_read_on_and_dropped_only_when_asked_and_while_it_arrives(status_reads_on: bool) -> None:
    state = ConnectionState()
    state.begin()
    state.head_taken()
    assert state.refused(Owed(Reply(413, b"", []), False, b""), read_on=status_reads_on) is status_reads_on
    assert state.reading is (Reading.DISCARD if status_reads_on else Reading.STOPPED)


def test_a_continue_owed_behind_a_running_request_goes_out_once_that_one_is_answered() -> None:
    state = ConnectionState()
    read_whole(state)
    state.begin()
    state.head_taken()
    assert not state.continue_asked()
    assert state.answered(keep_alive=True) is Next.CONTINUE
    assert not state.continue_owed


def test_an_answer_on_a_closing_connection_changes_nothing() -> None:
    state = ConnectionState()
    read_whole(state)
    state.close()
    assert state.answered(keep_alive=True) is Next.NOTHING
    assert state.answering is Answering.CLOSING


def test_a_pair_no_table_has_is_a_bug_that_raises_where_it_happens() -> None:
    state = ConnectionState()
    with pytest.raises(KeyError):
        state.answered(keep_alive=True)  # nothing was being answered
