"""A tenant's settlement in the Redis store kept when its script certainly did not run: an error reply
from a real `redis-server`, and a request cancelled while the store connects (a stand-in that never
answers); and what a check cancelled once sent took, given back when its reply comes (a real
`redis-server` held by CLIENT PAUSE).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from router.core.config.limits import LimitsConfig, RedisTarget, TenantLimit
from router.gateway.limit_metrics import LimitCounters
from router.gateway.redis_limits import RETRY_SECONDS, RedisStore
from tests.support.clock import FakeClock
from tests.support.redis import fake_redis, need_redis, redis_server


def store_for(target: RedisTarget, now: Callable[[], float] = time.monotonic) -> RedisStore:
    """Tenant a: 60,000 tokens a minute (1,000 a second refilled). `now`: the store's clock, which
    times its pause after a failure (Redis's own clock refills the buckets)."""
    config = LimitsConfig(
        redis=target,
        redis_timeout_seconds=2.0,
        tenants=MappingProxyType({"a": TenantLimit(tokens_per_minute=60_000)}),
    )
    return RedisStore(config, LimitCounters(), now)


async def test_a_settlement_sent_with_a_check_redis_refuses_is_kept_for_the_next(tmp_path: Path) -> None:
    """OOM (or READONLY after a failover) is answered before the script runs: the refund was never applied."""
    need_redis()
    async with redis_server(tmp_path) as redis:
        clock = FakeClock()
        store = store_for(RedisTarget(path=str(redis.socket)), clock.now)
        try:
            first = await store.check("a", 10_000, debit=True)
            assert first is not None and first.remaining_tokens <= 50_000
            # The answer took nothing: 10,000 to give back, sent with the next check.
            store.settle("a", -10_000)
            assert (await redis.command(b"CONFIG", b"SET", b"maxmemory", b"1")).startswith(b"+OK")
            assert await store.check("a", 1, debit=True) is None
            assert store.pending == {"a": -10_000}
            assert store.counters.redis_errors == {"error": 1}
            assert (await redis.command(b"CONFIG", b"SET", b"maxmemory", b"0")).startswith(b"+OK")
            # For half a second after the error reply no call is tried: the requests go unchecked.
            calls = dict(store.counters.redis_calls)
            assert await store.check("a", 1, debit=True) is None
            assert store.counters.redis_calls == calls
            clock.advance(RETRY_SECONDS)
            after = await store.check("a", 0, debit=False)
            # The refund arrived with this check: the bucket is (about) full again.
            assert after is not None and after.remaining_tokens >= 59_000
            assert store.pending == {}
        finally:
            await store.close()


async def test_a_check_cancelled_while_the_store_connects_keeps_the_settlement_and_closes() -> None:
    asked = asyncio.Event()
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A Redis slow to answer a fresh connection's SCRIPT LOAD: read, unanswered, until the router hangs up.
        await reader.readuntil(b"\r\n")
        asked.set()
        await reader.read()
        closed.set()
        writer.close()
        await writer.wait_closed()

    async with fake_redis(silent) as url:
        host, port = url.removeprefix("redis://").split("/")[0].split(":")
        store = store_for(RedisTarget(host=host, port=int(port)))
        store.pending["a"] = -10_000
        # The request whose client goes away while the store connects: its task is cancelled.
        check = asyncio.get_running_loop().create_task(store.check("a", 100, debit=True))
        await asked.wait()
        check.cancel()
        await asyncio.gather(check, return_exceptions=True)
        assert check.cancelled()
        # Never sent: still kept for the next call; the half-made connection closed, not left unheld.
        assert store.pending == {"a": -10_000}
        await asyncio.wait_for(closed.wait(), 5)
        await store.close()


async def test_a_check_cancelled_after_it_is_sent_gives_back_what_its_script_took(tmp_path: Path) -> None:
    """The client left while its check waited on Redis: the script still runs and takes the estimate,
    which comes back when its reply does, as a request that never left the router gets its estimate back."""
    need_redis()
    async with redis_server(tmp_path) as redis:
        store = store_for(RedisTarget(path=str(redis.socket)))
        try:
            # Connected, and the script loaded, before Redis is held.
            assert await store.check("a", 0, debit=False) is not None
            # Every client's commands held for a while (Redis 6.2's CLIENT PAUSE ALL): the check sent, unanswered.
            assert (await redis.command(b"CLIENT", b"PAUSE", b"1000", b"ALL")).startswith(b"+OK")
            check = asyncio.get_running_loop().create_task(store.check("a", 10_000, debit=True))
            # Sent as the task first runs: the command is written before its reply is awaited.
            await asyncio.sleep(0)
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
            assert check.cancelled()
            assert store.pending == {}
            # Redis runs it once the pause ends, admitting it: the 10,000 it took are to be given back.
            deadline = time.monotonic() + 10
            while store.pending != {"a": -10_000}:
                assert time.monotonic() < deadline, store.pending
                await asyncio.sleep(0.05)  # real time: Redis's pause, then its reply
            after = await store.check("a", 0, debit=False)
            assert after is not None and after.remaining_tokens >= 59_000
            assert store.pending == {}
        finally:
            await store.close()


async def test_a_check_cancelled_and_refused_gives_nothing_back(tmp_path: Path) -> None:
    """A cancelled check whose script refused it took nothing: nothing to give back."""
    need_redis()
    async with redis_server(tmp_path) as redis:
        store = store_for(RedisTarget(path=str(redis.socket)))
        try:
            first = await store.check("a", 60_000, debit=True)
            assert first is not None and first.admitted
            assert (await redis.command(b"CLIENT", b"PAUSE", b"500", b"ALL")).startswith(b"+OK")
            check = asyncio.get_running_loop().create_task(store.check("a", 10_000, debit=True))
            await asyncio.sleep(0)
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
            # Its reply (a refusal: the bucket is empty) read before this one's, on the same connection.
            later = await store.check("a", 0, debit=False)
            assert later is not None and later.remaining_tokens < 10_000
            assert store.pending == {}
        finally:
            await store.close()


async def test_a_server_that_takes_no_writes_is_left_for_the_one_the_address_names_next(tmp_path: Path) -> None:
    """READONLY (a primary a failover demoted): the connection dropped, so that the next call connects
    again, to the new primary behind the same address, where keeping it would meet READONLY for good."""
    need_redis()
    async with redis_server(tmp_path) as redis:
        clock = FakeClock()
        store = store_for(RedisTarget(path=str(redis.socket)), clock.now)
        try:
            assert await store.check("a", 10_000, debit=True) is not None
            assert store.counters.redis_calls == {"load": 1, "check": 1}
            # A replica of a primary that is not there (port 1: refused): it serves reads, refuses writes.
            assert (await redis.command(b"REPLICAOF", b"127.0.0.1", b"1")).startswith(b"+OK")
            assert await store.check("a", 1, debit=True) is None
            assert store.counters.redis_errors == {"error": 1}
            # Promoted again, as the new primary the address names.
            assert (await redis.command(b"REPLICAOF", b"NO", b"ONE")).startswith(b"+OK")
            clock.advance(RETRY_SECONDS)
            after = await store.check("a", 0, debit=False)
            assert after is not None and after.admitted
            # A new connection, which loaded the script afresh.
            assert store.counters.redis_calls == {"load": 2, "check": 3}
        finally:
            await store.close()
