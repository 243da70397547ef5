"""Each limited tenant's two buckets, requests and tokens, and the verdict on one request.

A limit of N per minute is a bucket of N that refills continuously at N/60
per second (a token bucket: the same as GCRA's "theoretical arrival time",
kept as a level): a full minute's worth may be spent at once, and then it
comes back a little at a time, never a whole window at a stroke as a fixed
window would. A request is admitted when both of its tenant's buckets hold
its cost (one request; its estimated tokens), and then both are debited; a
refused request takes nothing. When its answer ends, its estimate is settled
with what the answer says it took (`settle`): the difference is given back,
or taken, so the tokens bucket may go below zero (a debt the refill repays).

The arithmetic is `decide()`, a pure function, so that the in-memory buckets
and the shared ones (the same steps in a Lua script run by Redis:
router.gateway.redis_limits) agree by construction and by test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.core.config.limits import TenantLimit

REQUESTS = "requests"
TOKENS = "tokens"


class Verdict:
    """What one request's check said: admitted or not (by which kind, for how long), and where the tenant stands.

    `remaining_*` and `reset_*` (seconds until the bucket is full again) are
    after this request's debit; a kind not limited has limit 0 and is left
    out of the headers. `retry_after`: seconds until the refused kind holds
    the cost; `too_large`: the cost is more than the bucket ever holds.
    """

    __slots__ = (
        "admitted",
        "kind",
        "limit_requests",
        "limit_tokens",
        "remaining_requests",
        "remaining_tokens",
        "reset_requests",
        "reset_tokens",
        "retry_after",
        "too_large",
    )

    def __init__(  # noqa: PLR0917 (a value object, made once per limited request)
        self,
        admitted: bool,
        kind: str,
        retry_after: float,
        too_large: bool,
        limit_requests: int,
        remaining_requests: int,
        reset_requests: float,
        limit_tokens: int,
        remaining_tokens: int,
        reset_tokens: float,
    ) -> None:
        self.admitted = admitted
        self.kind = kind
        self.retry_after = retry_after
        self.too_large = too_large
        self.limit_requests = limit_requests
        self.remaining_requests = remaining_requests
        self.reset_requests = reset_requests
        self.limit_tokens = limit_tokens
        self.remaining_tokens = remaining_tokens
        self.reset_tokens = reset_tokens


def refill(level: float, capacity: int, elapsed: float) -> float:
    """A bucket of `capacity` per minute at `level`, `elapsed` seconds later."""
    if elapsed <= 0.0:
        return level
    level += elapsed * capacity / 60.0
    return level if level < capacity else float(capacity)


def decide(levels: list[float], limit: TenantLimit, cost: int, *, debit: bool = True) -> Verdict:
    """Admit a request of `cost` tokens against `levels` ([requests, tokens], refilled to now) of `limit`,
    debiting them if admitted and `debit` (False: shadow mode's look that takes nothing)."""
    rpm = limit.requests_per_minute or 0
    tpm = limit.tokens_per_minute or 0
    kind = ""
    wait = 0.0
    too_large = False
    if rpm and levels[0] < 1.0:
        kind = REQUESTS
        wait = (1.0 - levels[0]) * 60.0 / rpm
    if tpm and levels[1] < cost:
        if cost > tpm:
            too_large = True
            kind = TOKENS
        else:
            tokens_wait = (cost - levels[1]) * 60.0 / tpm
            if tokens_wait > wait:
                kind = TOKENS
                wait = tokens_wait
    admitted = not kind
    if admitted and debit:
        if rpm:
            levels[0] -= 1.0
        if tpm:
            levels[1] -= cost
    return Verdict(
        admitted,
        kind,
        wait,
        too_large,
        rpm,
        max(int(levels[0]), 0),
        (rpm - levels[0]) * 60.0 / rpm if rpm else 0.0,
        tpm,
        max(int(levels[1]), 0),
        (tpm - levels[1]) * 60.0 / tpm if tpm else 0.0,
    )


class Buckets:
    """Every limited tenant's buckets in this process, on an injected clock (monotonic seconds)."""

    __slots__ = ("_levels", "_now", "limits")

    def __init__(self, limits: Mapping[str, TenantLimit], now: Callable[[], float]) -> None:
        self.limits = dict(limits)
        self._now = now
        # Per tenant: [requests, tokens, when they were last brought up to date]; full at first sight.
        self._levels: dict[str, list[float]] = {}

    def _current(self, tenant: str, limit: TenantLimit) -> list[float]:
        now = self._now()
        state = self._levels.get(tenant)
        rpm = limit.requests_per_minute or 0
        tpm = limit.tokens_per_minute or 0
        if state is None:
            state = self._levels[tenant] = [float(rpm), float(tpm), now]
            return state
        # refill(), inline: this runs twice per limited request.
        elapsed = now - state[2]
        if elapsed > 0.0:
            level = state[0] + elapsed * rpm / 60.0
            state[0] = level if level < rpm else float(rpm)
            level = state[1] + elapsed * tpm / 60.0
            state[1] = level if level < tpm else float(tpm)
            state[2] = now
        return state

    def admit(self, tenant: str, cost: int, *, debit: bool = True) -> Verdict:
        """The verdict on one request of `tenant` (a limited one) estimated at `cost` tokens."""
        limit = self.limits[tenant]
        return decide(self._current(tenant, limit), limit, cost, debit=debit)

    def settle(self, tenant: str, delta: int) -> None:
        """`delta` more tokens than the estimate admitted (negative: fewer, given back, up to a full bucket)."""
        limit = self.limits.get(tenant)
        if limit is None or not limit.tokens_per_minute or not delta:
            return
        state = self._current(tenant, limit)
        level = state[1] - delta
        state[1] = level if level < limit.tokens_per_minute else float(limit.tokens_per_minute)

    def update(self, limits: Mapping[str, TenantLimit]) -> None:
        """New limits (SIGHUP): a tenant whose limits changed starts again from a full bucket; the rest keep theirs."""
        for tenant, limit in limits.items():
            if self.limits.get(tenant) != limit:
                self._levels.pop(tenant, None)
        for tenant in set(self._levels) - set(limits):
            del self._levels[tenant]
        self.limits = dict(limits)
