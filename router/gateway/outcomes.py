"""What one attempt came to, and the one step that writes it down: `Ledgers.record()`.

An attempt changes five ledgers: the replica's own counters (requests that
reached it, connections that failed), the pool's health of it (a success,
a failure toward ejection), its counts by answer and by failure, the access
log's line (attempts, the replica tried last, time to first byte) and the
data path's histograms. Which of them, and how, follows from what happened
alone (`Outcome`), so it is written in one place, never interleaved with
the attempt's control flow (router.gateway.forward).

A probe (a try of a cold model's replica by a held request) that finds the
engine still loading is not one of the request's attempts nor an upstream
error: it is counted as a probe by the hold, or, if the request is not held
in the end, as an attempt after all (`count_tried`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from router.core.clock import perf_counter
from router.core.errors import UpstreamConnectError, UpstreamError, UpstreamResetError, UpstreamTimeout
from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica
from router.gateway.access_log import Entry
from router.gateway.answers import error_response
from router.gateway.call import Call
from router.gateway.metrics import DataPathMetrics
from router.gateway.tokens import UNASKED_SAMPLE, USAGE_ON_ASK_PATHS, Tokens, read_stream
from router.http.messages import Reply

# These answers say the replica is unwell. A 500 is left out on purpose:
# engines answer some invalid requests with 500 (llama.cpp, an unknown role),
# and one client's bad requests must not eject healthy replicas.
UNHEALTHY_STATUSES = frozenset({502, 503, 504})


class Outcome(enum.Enum):
    """What one attempt came to, as far as the ledgers care."""

    # No connection: nothing reached the replica.
    UNREACHABLE = "unreachable"
    # It took the request and broke off before its answer's head, or sent none in time.
    BROKEN = "broken"
    SILENT = "silent"
    # Its head came: an answer the client gets (any status but those below).
    ANSWERED = "answered"
    # Its head came with a busy or unhealthy status (429, 502, 503, 504): another may be tried.
    REFUSED = "refused"
    # After its head, the rest of its answer broke off (`reason`: reset, timeout).
    CUT_OFF = "cut_off"
    # A 503 that says its engine sleeps (router.gateway.sleepers): neither an answer nor a failure of its.
    ASLEEP = "asleep"


# The members as module constants, as the attempt names them: read off the Enum class, a member is
# an uncached lookup through its metaclass in the pure build (a few hundred instructions), and
# ANSWERED is named twice on every request.
UNREACHABLE: Final = Outcome.UNREACHABLE
BROKEN: Final = Outcome.BROKEN
SILENT: Final = Outcome.SILENT
ANSWERED: Final = Outcome.ANSWERED
REFUSED: Final = Outcome.REFUSED
CUT_OFF: Final = Outcome.CUT_OFF
ASLEEP: Final = Outcome.ASLEEP


@dataclass(slots=True)
class Failed:
    """An attempt that sent nothing to the client: what the client would get."""

    error: UpstreamError
    # Another replica may be tried: nothing reached the client, and the
    # replica did not take the request (or said it was busy).
    retryable: bool
    # The replica's own answer (status, headers, body) when it gave one.
    answer: Reply | None = None
    # The replica of a probe that found it loading, which the caller counts (Ledgers.count_tried).
    replica: Replica | None = None
    # Its answer was a 503 "sleeping": the replica is asleep now (sleepers.found_asleep), to be woken.
    asleep: bool = False

    @property
    def connect_failure(self) -> bool:
        return isinstance(self.error, UpstreamConnectError)

    @property
    def loading(self) -> bool:
        """What an engine still loading its model answers: a refused connection, or 503."""
        return isinstance(self.error, UpstreamConnectError) or (self.answer is not None and self.answer.status == 503)

    def reply(self) -> Reply:
        return self.answer or error_response(self.error)

    def outcome_in(self, entry: Entry | None) -> None:
        """The access log's outcome of a request this failure ended."""
        if entry is not None:
            if isinstance(self.error, UpstreamTimeout):
                entry.outcome = "timeout"
            elif isinstance(self.error, UpstreamResetError):
                entry.outcome = "upstream_reset"


class Ledgers:
    """Where an attempt's outcome is written: the pool (replica counters and health) and the histograms."""

    __slots__ = ("metrics", "pool")

    def __init__(self, pool: Pool, metrics: DataPathMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    def record(  # noqa: PLR0917 (positional from the attempt: called at least once per request)
        self,
        entry: Entry | None,
        replica: Replica,
        model: str,
        outcome: Outcome,
        status: int = 0,
        ttfb: float | None = None,
        reason: str = "",
        probe: bool = False,
    ) -> None:
        """Write one attempt's `outcome` on `replica` (of `model`) to every ledger.

        `status` and `ttfb`: its answer's, once a head came. `reason`: how an
        answer CUT_OFF broke. `probe`: a held request's try that found the engine
        loading (refused or 503): the replica's own counters only (count_tried).
        """
        pool = self.pool
        if entry is not None and (trace := entry.trace) is not None:
            trace.outcome(outcome.value, status, ttfb, reason)
        if outcome is ANSWERED:
            self.metrics.first_byte.observe(model, ttfb or 0.0)
            replica.requests += 1
            # pool.count_response(), written out as `requests` is: the replica's own counter.
            replica.count_response(status)
            # _attempted(), written out: the common case, and without an access log nothing to write.
            if entry is not None:
                entry.attempts += 1
                entry.served_model = model
                entry.replica = replica.id
                if ttfb is not None:
                    entry.ttfb_seconds = ttfb
            if status in UNHEALTHY_STATUSES:
                pool.record_failure(replica)
            else:
                pool.record_success(replica)
        elif outcome is REFUSED:
            self.metrics.first_byte.observe(model, ttfb or 0.0)
            replica.requests += 1
            pool.count_response(replica, status)
            if status in UNHEALTHY_STATUSES:
                pool.record_failure(replica)
            if not probe:
                _attempted(entry, replica, model, ttfb)
                pool.count_failure(replica, "status")
        elif outcome is ASLEEP:
            pool.count_response(replica, status)
        elif outcome is UNREACHABLE:
            # Not one of its requests: nothing reached it.
            replica.connects_failed += 1
            pool.record_failure(replica)
            if not probe:
                _attempted(entry, replica, model, None)
                pool.count_failure(replica, "connect")
        elif outcome is CUT_OFF:
            pool.count_failure(replica, reason)
            pool.record_failure(replica)
        else:
            # It had the request (BROKEN, SILENT): one of its requests, and a failure.
            replica.requests += 1
            _attempted(entry, replica, model, None)
            pool.count_failure(replica, "timeout" if outcome is SILENT else "reset")
            pool.record_failure(replica)

    def tokens(self, call: Call, model: str, tokens: Tokens | None) -> None:
        """What an answer of `model` to `call` said it took (None: nothing readable), to the tallies
        and the access log; a whole stream's is stream_ended()'s."""
        call.usage = tokens
        if tokens is None:
            self.pool.tallies.count_unknown_usage(model, call.caller.tenant)
            return
        prompt, completion, cached = tokens
        self.pool.tallies.count_tokens(model, call.caller.tenant, prompt, cached, completion)
        if call.charge is not None:
            call.charge.settle(prompt, completion)
        if (entry := call.entry) is not None:
            entry.prompt_tokens = prompt
            entry.completion_tokens = completion
            entry.cached_tokens = cached

    def stream_ended(  # noqa: PLR0917 (positional from the stream's end, once per counted stream)
        self, call: Call, replica: Replica, before_last: bytes, last: bytes, first: bytes | None, first_at: float
    ) -> None:
        """A counted stream passed whole (2xx): its usage read from its last two reads when it may carry
        one, to the tallies, the access log and the stream histograms (`first_at`: perf_counter()
        of its `first` read).

        tokens()'s counting is repeated here, not called: this runs at the end of every counted
        stream, where each Python call costs as much as the search.
        """
        model = replica.model
        tokens: Tokens | None = None
        if replica.volunteers_usage or "stream_options" in call.parsed or call.request.path not in USAGE_ON_ASK_PATHS:
            tokens = read_stream(before_last, last, first)
        else:
            # Not asked for: engines send it only when told to (router.gateway.tokens), so the
            # search would mostly find nothing, and it is most of what counting costs a stream.
            skips = replica.unasked_skips
            replica.unasked_skips = skips + 1 if skips < UNASKED_SAMPLE - 1 else 0
            if skips == 0:
                tokens = read_stream(before_last, last, first)
                if tokens is not None:
                    replica.volunteers_usage = True
        if first is not None:
            # Each histogram's own method, called from here: in the pure build a call costs as much
            # as an observation, and a stream that says no tokens makes only this one.
            self.metrics.first_token.observe(model, first_at - call.started)
        # Kept before it is narrowed: compiled, a tuple narrowed from `| None` is unboxed, and
        # stored it would be made again.
        call.usage = tokens
        if tokens is None:
            self.pool.tallies.count_unknown_usage(model, call.caller.tenant)
        else:
            prompt, completion, cached = tokens
            self.pool.tallies.count_tokens(model, call.caller.tenant, prompt, cached, completion)
            if call.charge is not None:
                call.charge.settle(prompt, completion)
            if (entry := call.entry) is not None:
                entry.prompt_tokens = prompt
                entry.completion_tokens = completion
                entry.cached_tokens = cached
            if first is not None and completion > 1:
                # The clock read only when it is used (the search since the last chunk is microseconds).
                self.metrics.per_output_token.observe(model, (perf_counter() - first_at) / (completion - 1))

    def count_tried(self, entry: Entry | None, probes: list[Failed], model: str) -> None:
        """Probes of `model` that were not a held request's after all: attempts and upstream errors, as any."""
        for failed in probes:
            assert failed.replica is not None
            self.pool.count_failure(failed.replica, "connect" if failed.connect_failure else "status")
            if entry is not None:
                entry.attempts += 1
                # The last replica tried, unless a later attempt is in the line already.
                if entry.replica is None:
                    entry.served_model, entry.replica = model, failed.replica.id


def _attempted(entry: Entry | None, replica: Replica, model: str, ttfb: float | None) -> None:
    """The access log's line: the request tried `replica` (one more attempt, and the last so far)."""
    if entry is not None:
        entry.attempts += 1
        entry.served_model = model
        entry.replica = replica.id
        if ttfb is not None:
            entry.ttfb_seconds = ttfb
