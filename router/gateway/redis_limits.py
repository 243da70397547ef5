"""The tenants' buckets in Redis, shared by every router (and every worker) that names the same `redis_url`.

One round trip per request: `EVALSHA` of one Lua script that reads the
tenant's hash, refills it to Redis's own clock (`TIME`: one clock for every
router, whatever theirs say), applies the settlements this router has
gathered for the tenant since its last call, decides (the same steps as
router.core.limits.buckets.decide, which the tests hold it to), writes it
back and sets it to expire once it would be full again (an absent hash is a
full bucket). Redis runs a script whole, with no other command between its
steps (src/eval.c, `evalGenericCommand`), so two routers never both take the
last of a bucket; since Redis 7 a script's writes are replicated as their
effects, so reading `TIME` before writing is allowed.

The script is loaded once per connection (`SCRIPT LOAD`) and called by its
SHA1; a `NOSCRIPT` reply (its cache flushed, a Redis restarted under the
same connection name) loads it again and calls once more.

Settlements are not round trips of their own: an answer's difference from
its estimate is kept here and sent with the tenant's next check, or, if the
tenant sends nothing more within FLUSH_SECONDS, by one call for every such
tenant. So Redis's level of a tenant lags the answers this router has seen
end by at most FLUSH_SECONDS, and never for this router's own next request
of that tenant. A check whose request is cancelled once it is sent still has
its reply read: what its script took is given back, a settlement like any.

While Redis does not answer (`redis_timeout_seconds` for each call, a
connection refused, a reply that does not parse) the store gives no verdict
and the limiter admits the request unchecked or refuses it
(`redis_unavailable`); for RETRY_SECONDS after a failure (an error reply
such as OOM or READONLY too, the connection retired after those that say
this server takes no writes now) no call is tried,
so that a Redis that hangs costs a request nothing, then one request tries
again. Each failure is counted by reason, and logged at most once per
LOG_EVERY_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from functools import partial

from router.core.config.limits import LimitsConfig, TenantLimit
from router.core.limits.buckets import REQUESTS, TOKENS, Verdict
from router.gateway.limit_metrics import LimitCounters
from router.gateway.redis import RedisConnection, RedisError, RedisUnavailable, RespValue

log = logging.getLogger("router.limits")

FLUSH_SECONDS = 1.0
RETRY_SECONDS = 0.5
LOG_EVERY_SECONDS = 10.0
# Why a call failed when its script certainly did not run: Redis answered it with an error
# (OOM, READONLY after a failover, LOADING, BUSY: refused before running; the script itself
# raises none). A settlement sent with it is kept for the next call; after a timeout or a
# reset it may have run, and is not sent twice.
_NOT_RUN = frozenset({"error"})
# Error replies that say this server cannot take writes now: a primary demoted by a failover
# (READONLY), a replica cut off from its primary (MASTERDOWN), a server still loading its data
# (LOADING). The connection is retired, so that the next one reaches whichever server the address
# names by then (a Service or a Sentinel-managed name moved to the new primary), as clients
# of Redis reconnect on READONLY rather than write to a replica for good.
_ELSEWHERE = frozenset({"READONLY", "MASTERDOWN", "LOADING"})


def refuses_writes(error: RedisError) -> bool:
    """Whether `error` says this server takes no writes now: its code, or (before Redis 7, which
    passes a script's redis.call() error on as it is) the code inside an `ERR Error running script`."""
    if error.code in _ELSEWHERE:
        return True
    return error.code == "ERR" and any(f"-{code} " in error.message for code in _ELSEWHERE)


# KEYS[1]: the tenant's hash. ARGV: requests per minute, tokens per minute (0: not limited), the request's
# cost in tokens, 1 to take it if admitted (0: a settlement alone), the tokens to settle first.
# Returns {kind (0 admitted, 1 requests, 2 tokens), too large (0/1), wait in ms, requests and tokens left
# in thousandths}.
SCRIPT = b"""
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local debit = ARGV[4] == '1'
local settle = tonumber(ARGV[5])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local saved = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local r = tonumber(saved[1])
local t = tonumber(saved[2])
local ts = tonumber(saved[3])
if r == nil or t == nil or ts == nil then
  r = rpm
  t = tpm
  ts = now
end
local elapsed = now - ts
if elapsed > 0 then
  r = math.min(rpm, r + elapsed * rpm / 60)
  t = math.min(tpm, t + elapsed * tpm / 60)
end
if tpm > 0 then
  t = math.min(tpm, t - settle)
end
local kind = 0
local wait = 0
local large = 0
if rpm > 0 and r < 1 then
  kind = 1
  wait = (1 - r) * 60 / rpm
end
if tpm > 0 and t < cost then
  if cost > tpm then
    large = 1
    kind = 2
  else
    local tokens_wait = (cost - t) * 60 / tpm
    if tokens_wait > wait then
      kind = 2
      wait = tokens_wait
    end
  end
end
if kind == 0 and debit then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then t = t - cost end
end
local full = 0
if rpm > 0 then full = math.max(full, (rpm - r) * 60 / rpm) end
if tpm > 0 then full = math.max(full, (tpm - t) * 60 / tpm) end
redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(t), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
return {kind, large, math.ceil(wait * 1000), math.floor(r * 1000), math.floor(t * 1000)}
"""
# EVALSHA's name for it: its SHA1, as Redis computes it (a name, not a protection).
SHA = hashlib.sha1(SCRIPT, usedforsecurity=False).hexdigest().encode()
_KINDS = ("", REQUESTS, TOKENS)


def verdict_of(reply: RespValue, limit: TenantLimit) -> Verdict:
    """The script's reply as a Verdict; RedisUnavailable("protocol") for anything else."""
    if not isinstance(reply, list) or len(reply) != 5 or not all(type(x) is int for x in reply):
        raise RedisUnavailable("protocol", f"the script answered {reply!r:.80}")
    kind, large, wait_ms, requests_milli, tokens_milli = (int(x) for x in reply)  # type: ignore[arg-type]
    if not 0 <= kind <= 2:
        raise RedisUnavailable("protocol", f"the script answered kind {kind}")
    rpm = limit.requests_per_minute or 0
    tpm = limit.tokens_per_minute or 0
    requests = requests_milli / 1000.0
    tokens = tokens_milli / 1000.0
    return Verdict(
        kind == 0,
        _KINDS[kind],
        wait_ms / 1000.0,
        large == 1,
        rpm,
        max(int(requests), 0),
        (rpm - requests) * 60.0 / rpm if rpm else 0.0,
        tpm,
        max(int(tokens), 0),
        (tpm - tokens) * 60.0 / tpm if tpm else 0.0,
    )


class RedisStore:
    """The buckets in Redis: a check per request (one round trip), settlements sent with the next."""

    def __init__(self, config: LimitsConfig, counters: LimitCounters, now: Callable[[], float]) -> None:
        assert config.redis is not None
        self.target = config.redis
        self.timeout = config.redis_timeout_seconds
        self._prefix = config.redis_key_prefix.encode()
        self.limits = dict(config.tenants)
        self.counters = counters
        self._now = now
        # Per tenant: tokens to settle, not yet sent.
        self.pending: dict[str, int] = {}
        self._connection: RedisConnection | None = None
        self._lock = asyncio.Lock()
        self._down_until = 0.0
        self._logged_at: float | None = None
        self._unavailable = False
        self._flusher: asyncio.Task[None] | None = None
        self._forgetting: set[asyncio.Task[None]] = set()

    async def check(self, tenant: str, cost: int, *, debit: bool) -> Verdict | None:
        limit = self.limits.get(tenant)
        if limit is None:
            return None
        try:
            connection = await self._connected()
        except RedisUnavailable as exc:
            self._failed(exc)
            return None
        # Taken once connected, so that a request that gives up while the connection is made
        # (its client gone) leaves the tenant's settlement kept.
        delta = self.pending.pop(tenant, 0)
        # A check whose request is cancelled once it is sent (its client gone) still runs in Redis:
        # its reply, when it comes, says what became of its settlement and of its debit.
        handoff = partial(self._abandoned, tenant, limit, cost if debit else 0, delta) if delta or debit else None
        try:
            reply = await self._run(connection, tenant, limit, cost, debit, delta, "check", handoff)
            return verdict_of(reply, limit)
        except RedisUnavailable as exc:
            if exc.reason in _NOT_RUN:
                self.settle(tenant, delta)
            self._failed(exc)
            return None

    def _abandoned(self, tenant: str, limit: TenantLimit, taken: int, delta: int, reply: RespValue) -> None:
        """The reply to a check whose request was cancelled: the tokens it `taken` back if the script
        admitted it (the request never left the router), or, if the script never ran (an error reply),
        the settlement it carried (`delta`) kept for the next call."""
        if isinstance(reply, RedisError):
            self.settle(tenant, delta)
            return
        try:
            verdict = verdict_of(reply, limit)
        except RedisUnavailable:
            return
        if verdict.admitted and taken:
            self.settle(tenant, -taken)

    def settle(self, tenant: str, delta: int) -> None:
        """Keep `delta` tokens to settle for `tenant` (an answer's, or one a call carried that never ran),
        sent with its next check or the next flush."""
        if delta and tenant in self.limits and self.limits[tenant].tokens_per_minute:
            self.pending[tenant] = self.pending.get(tenant, 0) + delta
            if self._flusher is None:
                self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    def update(self, limits: dict[str, TenantLimit]) -> None:
        # A tenant whose limits changed starts again from a full bucket, as in memory.
        changed = {t for t, limit in limits.items() if self.limits.get(t) != limit}
        self.limits = dict(limits)
        for tenant in changed:
            self.pending.pop(tenant, None)
        if changed:
            task = asyncio.get_running_loop().create_task(self._forget(changed))
            # Held until done: the loop keeps only a weak reference to a task.
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)

    async def _forget(self, tenants: set[str]) -> None:
        with contextlib.suppress(RedisUnavailable):
            connection = await self._connected()
            await connection.call([b"DEL", *(self._prefix + t.encode() for t in sorted(tenants))], self.timeout)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            await self.flush()

    async def flush(self) -> None:
        """Send every settlement still kept: one call per tenant that sent nothing since it was kept."""
        if not self.pending:
            return
        try:
            connection = await self._connected()
        except RedisUnavailable as exc:
            self._failed(exc)
            return
        # One connection for all: the first call that fails ends the flush.
        for tenant in list(self.pending):
            delta = self.pending.pop(tenant, 0)
            limit = self.limits.get(tenant)
            if not delta or limit is None:
                continue
            try:
                verdict_of(await self._run(connection, tenant, limit, 0, False, delta, "flush"), limit)
            except RedisUnavailable as exc:
                if exc.reason in _NOT_RUN:
                    self.settle(tenant, delta)
                self._failed(exc)
                return

    async def _run(  # noqa: PLR0917 (the script's arguments, in its order)
        self,
        connection: RedisConnection,
        tenant: str,
        limit: TenantLimit,
        cost: int,
        debit: bool,
        delta: int,
        what: str,
        abandoned: Callable[[RespValue], None] | None = None,
    ) -> RespValue:
        args = [
            b"EVALSHA",
            SHA,
            b"1",
            self._prefix + tenant.encode(),
            b"%d" % (limit.requests_per_minute or 0),
            b"%d" % (limit.tokens_per_minute or 0),
            b"%d" % cost,
            b"1" if debit else b"0",
            b"%d" % delta,
        ]
        self.counters.redis_call(what)
        reply = await connection.call(args, self.timeout, abandoned)
        if isinstance(reply, RedisError) and reply.code == "NOSCRIPT":
            try:
                await self._load(connection)
            except asyncio.CancelledError:
                if abandoned is not None:
                    # The script never ran: what the call carried is kept, as if it were abandoned so.
                    abandoned(reply)
                raise
            self.counters.redis_call(what)
            reply = await connection.call(args, self.timeout, abandoned)
        if isinstance(reply, RedisError):
            if refuses_writes(reply):
                # No more calls on it, but the replies owed to the checks sent with this one are read
                # (each refused the same way, their settlements kept): closed then.
                if self._connection is connection:
                    self._connection = None
                connection.retire()
            raise RedisUnavailable("error", reply.message)
        if self._unavailable:
            self._unavailable = False
            log.warning("rate limits: Redis at %s answers again; requests are checked", self.target)
        return reply

    async def _load(self, connection: RedisConnection) -> None:
        self.counters.redis_call("load")
        loaded = await connection.call([b"SCRIPT", b"LOAD", SCRIPT], self.timeout)
        if loaded != SHA:
            raise RedisUnavailable(
                "error" if isinstance(loaded, RedisError) else "protocol", f"SCRIPT LOAD: {loaded!r}"
            )

    async def _connected(self) -> RedisConnection:
        if self._down_until:
            # A pause after a failure, whether the connection went with it or not (an error reply).
            if self._now() < self._down_until:
                raise RedisUnavailable("skipped", "unavailable a moment ago")
            self._down_until = 0.0
        connection = self._connection
        if connection is not None and connection.broken is None:
            return connection
        async with self._lock:
            connection = self._connection
            if connection is not None and connection.broken is None:
                return connection
            if self._now() < self._down_until:
                raise RedisUnavailable("skipped", "unavailable a moment ago")
            connection = await RedisConnection.open(self.target, self.timeout)
            try:
                if self.target.db:
                    self.counters.redis_call("select")
                    selected = await connection.call([b"SELECT", b"%d" % self.target.db], self.timeout)
                    if selected != b"OK":
                        raise RedisUnavailable("error", f"SELECT {self.target.db}: {selected!r}")
                await self._load(connection)
            except BaseException as failed:
                # Unavailable, or the request that opened it cancelled (its client gone): never left open
                # and unheld.
                await connection.close()
                # Named, not a bare raise: compiled, the exception being handled after an await is the
                # one the await handled last (the reader's cancellation), not this one.
                raise failed from None
            self._connection = connection
            return connection

    def _failed(self, exc: RedisUnavailable) -> None:
        if exc.reason == "skipped":
            return
        self.counters.redis_error(exc.reason)
        now = self._now()
        # An error reply too: the calls after it would be answered the same, each a round trip.
        self._down_until = now + RETRY_SECONDS
        self._unavailable = True
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_SECONDS:
            self._logged_at = now
            log.warning(
                "rate limits: Redis at %s unavailable (%s): limited tenants' requests go unchecked (redis_unavailable)",
                self.target,
                exc,
            )

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self.pending:
            with contextlib.suppress(RedisUnavailable):
                await self.flush()
        if self._connection is not None:
            await self._connection.close()
