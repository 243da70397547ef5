"""A limited tenant's request: checked against its limits, refused with 429, told where it stands, settled.

The dispatcher asks `RateLimiter.admit()` for a request of a tenant with
limits (`[api_keys.NAME]` tokens_per_minute, requests_per_minute) once its
body is read: a `Ticket` (admitted), or a 429 `rate_limit_exceeded` to
answer. An admitted request's answer goes through a `LimitedWriter`, which
adds OpenAI's `x-ratelimit-*` headers to it, whatever it is; when the answer
has ended, `settle()` trues the estimate up with the answer's usage (or gives
it back, for an error answer). The buckets are this process's
(router.core.limits.buckets) or Redis's, shared by every router
(router.gateway.redis_limits); both are a `Store`. docs/limits.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from router.core.config.limits import LimitsConfig, TenantLimit
from router.core.limits.buckets import REQUESTS, Buckets, Verdict
from router.core.limits.estimates import estimate
from router.gateway.answers import JSON, error_body
from router.gateway.call import Call
from router.gateway.limit_metrics import LimitCounters
from router.gateway.redis_limits import RedisStore
from router.http.messages import Reply
from router.http.pipe import Pipe
from router.http.writer import Meter, Writer

log = logging.getLogger("router.limits")
# At most one line per tenant this often, however many requests its limit refuses.
LOG_EVERY_SECONDS = 10.0


class Store(Protocol):
    """Where the buckets are: this process (MemoryStore) or Redis (router.gateway.redis_limits)."""

    async def check(self, tenant: str, cost: int, *, debit: bool) -> Verdict | None:
        """The verdict on a request of `tenant` of `cost` tokens; None: no verdict could be had (Redis down)."""
        ...

    def settle(self, tenant: str, delta: int) -> None:
        """`delta` tokens more than the estimate (negative: fewer)."""
        ...

    def update(self, limits: dict[str, TenantLimit]) -> None:
        """New limits, from SIGHUP."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """The buckets of this process alone (no redis_url): one router, or one worker of --workers."""

    __slots__ = ("buckets",)

    def __init__(self, limits: dict[str, TenantLimit], now: Callable[[], float]) -> None:
        self.buckets = Buckets(limits, now)

    async def check(self, tenant: str, cost: int, *, debit: bool) -> Verdict | None:
        return self.buckets.admit(tenant, cost, debit=debit)

    def settle(self, tenant: str, delta: int) -> None:
        self.buckets.settle(tenant, delta)

    def update(self, limits: dict[str, TenantLimit]) -> None:
        self.buckets.update(limits)

    async def close(self) -> None:
        return None


class Ticket:
    """An admitted request: its tenant, what it was estimated at, and whether tokens were taken for it (to settle)."""

    __slots__ = ("charged", "estimate", "headers", "tenant")

    def __init__(
        self, tenant: str, estimate: int, charged: bool, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.tenant = tenant
        self.estimate = estimate
        self.charged = charged
        # The x-ratelimit-* headers its answer carries (none in shadow mode, or unchecked).
        self.headers: list[tuple[bytes, bytes]] = headers if headers is not None else []


def duration(seconds: float) -> bytes:
    """A reset time as OpenAI writes it: `20ms`, `1s`, `6m0s`, `17.5s`.

    Whole milliseconds first, rounded up (a reset is never said sooner than it is), so that
    59.9996 s is `1m0s`, not `60s`, nor 119.9996 s `1m60s`.
    """
    millis = math.ceil(seconds * 1000.0)
    if millis < 1000:
        return b"%dms" % millis
    if millis < 60_000:
        return _seconds(millis) + b"s"
    minutes, rest = divmod(millis, 60_000)
    return b"%dm%ss" % (minutes, _seconds(rest))


def _seconds(millis: int) -> bytes:
    """`millis` as seconds, with no trailing zeros: 17500 is `17.5`, 1000 is `1`, 0 is `0`."""
    return (b"%d.%03d" % divmod(millis, 1000)).rstrip(b"0").rstrip(b".")


def headers_of(verdict: Verdict) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers, for each kind the tenant is limited by."""
    headers: list[tuple[bytes, bytes]] = []
    if verdict.limit_requests:
        headers += (
            (b"x-ratelimit-limit-requests", b"%d" % verdict.limit_requests),
            (b"x-ratelimit-remaining-requests", b"%d" % verdict.remaining_requests),
            (b"x-ratelimit-reset-requests", duration(verdict.reset_requests)),
        )
    if verdict.limit_tokens:
        headers += (
            (b"x-ratelimit-limit-tokens", b"%d" % verdict.limit_tokens),
            (b"x-ratelimit-remaining-tokens", b"%d" % verdict.remaining_tokens),
            (b"x-ratelimit-reset-tokens", duration(verdict.reset_tokens)),
        )
    return headers


def refusal(verdict: Verdict, tenant: str, cost: int) -> Reply:
    """The 429 for a refused request: OpenAI's body and headers (the Anthropic paths reshape it)."""
    headers = [JSON, *headers_of(verdict)]
    if verdict.too_large:
        message = (
            f"Request too large for tenant {tenant!r} on tokens per minute: limit {verdict.limit_tokens}, "
            f"requested {cost} (the prompt's bytes / 4 plus max_tokens for each answer asked for), of which "
            "the output bound alone is over the limit. Lower max_tokens (or n)."
        )
        # Waiting does not help: the SDKs read this and do not try again.
        headers.append((b"x-should-retry", b"false"))
    else:
        wait = verdict.retry_after
        if verdict.kind == REQUESTS:
            message = (
                f"Rate limit reached for tenant {tenant!r} on requests per minute: limit {verdict.limit_requests}. "
                f"Please try again in {duration(wait).decode()}."
            )
        else:
            message = (
                f"Rate limit reached for tenant {tenant!r} on tokens per minute: limit {verdict.limit_tokens}, "
                f"remaining {verdict.remaining_tokens}, requested {cost}. "
                f"Please try again in {duration(wait).decode()}."
            )
        headers += (
            (b"Retry-After", b"%d" % max(1, math.ceil(wait))),
            (b"retry-after-ms", b"%d" % max(1, math.ceil(wait * 1000.0))),
        )
    return Reply(429, error_body(429, message, verdict.kind, "rate_limit_exceeded"), headers)


class RateLimiter:
    """The limited tenants' door: admit (a Ticket, or the 429 to answer) and settle, through one Store."""

    def __init__(self, config: LimitsConfig, store: Store, counters: LimitCounters, now: Callable[[], float]) -> None:
        self.config = config
        # The tenants that have limits: any other passes with one dict lookup.
        self.tenants = frozenset(config.tenants)
        # Each tenant's tokens a minute (0: limited by requests alone), the most an estimate is taken as.
        self._buckets = _token_buckets(config.tenants)
        self.store = store
        self.counters = counters
        self._shadow = config.shadow
        self._unbounded = config.unbounded_output_tokens
        self._refuse_unavailable = config.redis_unavailable == "refuse"
        self._now = now
        self._logged: dict[str, float] = {}
        # The buckets themselves when they are in memory: checked without a coroutine.
        self.memory: Buckets | None = store.buckets if isinstance(store, MemoryStore) else None

    def admit_now(self, tenant: str, path: str, body_bytes: int, parsed: dict[str, Any]) -> Ticket | Reply:
        """admit(), for buckets in memory (`memory` set): no await, no coroutine."""
        assert self.memory is not None
        cost = estimate(body_bytes, parsed, self._unbounded, path, self._buckets.get(tenant, 0))
        return self._ticket(tenant, cost, self.memory.admit(tenant, cost))

    async def admit(self, tenant: str, path: str, body_bytes: int, parsed: dict[str, Any]) -> Ticket | Reply:
        """A Ticket for a request of a limited `tenant` to `path` whose body is `body_bytes` long and reads
        as `parsed`, or the answer that refuses it."""
        cost = estimate(body_bytes, parsed, self._unbounded, path, self._buckets.get(tenant, 0))
        return self._ticket(tenant, cost, await self.store.check(tenant, cost, debit=True))

    def _ticket(self, tenant: str, cost: int, verdict: Verdict | None) -> Ticket | Reply:
        shadow = self._shadow
        if verdict is None:
            # Redis unavailable: no verdict (the store counted why and logged).
            if self._refuse_unavailable and not shadow:
                self.counters.unchecked_request("refused")
                body = error_body(503, "The rate limits' store is unavailable; try again.", "server_error", None)
                return Reply(503, body, [JSON, (b"Retry-After", b"1")])
            self.counters.unchecked_request("admitted")
            return Ticket(tenant, cost, False)
        if verdict.admitted:
            # Shadow mode changes nothing the client sees: no headers. Only tokens taken are settled.
            return Ticket(tenant, cost, verdict.limit_tokens > 0, None if shadow else headers_of(verdict))
        self.counters.limited(tenant, verdict.kind, shadow=shadow)
        self._log(tenant, verdict, cost)
        if shadow:
            # Counted and logged, never refused; nothing taken, as enforcing would take nothing.
            return Ticket(tenant, cost, False)
        return refusal(verdict, tenant, cost)

    def _log(self, tenant: str, verdict: Verdict, cost: int) -> None:
        now = self._now()
        last = self._logged.get(tenant)
        if last is not None and now - last < LOG_EVERY_SECONDS:
            return
        self._logged[tenant] = now
        log.warning(
            "tenant %s over its %s per minute limit (%d; requested %d)%s",
            tenant,
            verdict.kind,
            verdict.limit_tokens if verdict.kind != REQUESTS else verdict.limit_requests,
            cost if verdict.kind != REQUESTS else 1,
            "; shadow mode: let through" if self._shadow else "; refused with 429",
        )

    def settle(self, ticket: Ticket, call: Call | None, status: int) -> None:
        """The answer has ended (`status`: what the client got; 0: nothing): the estimate trued up."""
        if not ticket.charged:
            return
        if status == 0 and call is not None and call.sent:
            # No answer, but the request went out (the client left while the engine worked on it):
            # what it took is unknown, and unknown is not zero. Its estimate is kept.
            return
        if status < 200 or status >= 400:
            # An error answer (or none, the request never sent) took no tokens of the engine's
            # worth counting against the tenant.
            self.store.settle(ticket.tenant, -ticket.estimate)
            return
        usage = call.usage if call is not None else None
        if usage is not None:
            prompt, completion, _ = usage
            self.store.settle(ticket.tenant, prompt + completion - ticket.estimate)
        # An answer that said nothing of its tokens keeps its estimate: unknown is not zero.

    def update(self, limits: dict[str, TenantLimit]) -> None:
        self.tenants = frozenset(limits)
        self._buckets = _token_buckets(limits)
        self.store.update(limits)


def _token_buckets(limits: Mapping[str, TenantLimit]) -> dict[str, int]:
    return {tenant: limit.tokens_per_minute or 0 for tenant, limit in limits.items()}


class LimitedWriter:
    """A limited tenant's Writer (router.http.writer): OpenAI's x-ratelimit-* headers on its answer, whatever it is."""

    __slots__ = ("_headers", "_writer", "status")

    def __init__(self, writer: Writer, headers: list[tuple[bytes, bytes]]) -> None:
        self._writer = writer
        self._headers = headers
        # What the client got: its answer's status, 0 until one is written.
        self.status = 0

    @property
    def meter(self) -> Meter | None:
        return self._writer.meter

    @meter.setter
    def meter(self, meter: Meter | None) -> None:
        self._writer.meter = meter

    @property
    def started(self) -> bool:
        return self._writer.started

    def answer(self, reply: Reply) -> None:
        self.status = reply.status
        self._writer.answer(Reply(reply.status, reply.body, self._with_ours(reply.headers), reply.reason))

    def start(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], *, length: int | None = None
    ) -> None:
        self.status = status
        self._writer.start(status, reason, self._with_ours(headers), length=length)

    def _with_ours(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The answer's headers with the router's x-ratelimit-* (none in shadow mode) in place of any
        the replica sent (an upstream that limits too): one value of each, the tenant's here."""
        ours = self._headers
        if not ours:
            return headers
        return [h for h in headers if not h[0].lower().startswith(b"x-ratelimit-")] + ours

    def write(self, data: bytes) -> bool:
        return self._writer.write(data)

    def body_sink(self) -> Callable[[bytes], bool]:
        return self._writer.body_sink()

    def end(self) -> None:
        self._writer.end()

    def abort(self, last_words: bytes = b"") -> None:
        self._writer.abort(last_words)

    def close_after(self) -> None:
        self._writer.close_after()

    async def drain(self) -> None:
        await self._writer.drain()

    def switch(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> Pipe | None:
        return self._writer.switch(status, reason, headers)


def build_limiter(config: LimitsConfig, now: Callable[[], float], registry: CollectorRegistry) -> RateLimiter:
    """The limiter [limits] asks for, its counters registered: buckets in memory, or in Redis (redis_url)."""
    counters = LimitCounters()
    registry.register(counters)
    store: Store = MemoryStore(dict(config.tenants), now) if config.redis is None else RedisStore(config, counters, now)
    return RateLimiter(config, store, counters, now)
