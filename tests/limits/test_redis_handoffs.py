"""A Redis call whose caller is cancelled once it is sent: its reply handed on, whichever comes first,
the reply or the cancellation; and a connection retired after READONLY reading the replies it owes.

The connection is driven by hand (its transport a stand-in that records what is written), so that
the reply and the cancellation can be put in either order within one turn of the loop; the store's
behaviour over a real socket is in test_redis_settlements.py.
"""

from __future__ import annotations

import asyncio
import time
from types import MappingProxyType

import pytest

from router.core.config.limits import LimitsConfig, RedisTarget, TenantLimit
from router.gateway.limit_metrics import LimitCounters
from router.gateway.redis import RedisConnection, RedisError, RedisUnavailable, RespValue
from router.gateway.redis_limits import SHA, RedisStore, refuses_writes
from tests.support.redis import fake_redis
from tests.support.waiting import wait_for


class Socket:
    """Where the connection writes: what it wrote, and whether it closed."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def connected() -> tuple[RedisConnection, Socket]:
    connection = RedisConnection()
    socket = Socket()
    connection.connection_made(socket)  # type: ignore[arg-type]
    return connection, socket


async def sent(connection: RedisConnection, got: list[RespValue]) -> asyncio.Task[RespValue]:
    task = asyncio.get_running_loop().create_task(connection.call([b"EVALSHA", b"x"], 5, got.append))
    # Written as the task first runs, before it waits for the reply.
    await asyncio.sleep(0)
    return task


async def settled(task: asyncio.Task[RespValue]) -> None:
    with pytest.raises(asyncio.CancelledError):
        await task
    # The handoff is called soon, not inside the read.
    await asyncio.sleep(0)


async def test_a_reply_read_before_the_cancelled_caller_wakes_is_handed_on() -> None:
    connection, _ = connected()
    got: list[RespValue] = []
    task = await sent(connection, got)
    connection.data_received(b":1\r\n")
    task.cancel()
    await settled(task)
    assert got == [1]


async def test_a_reply_read_after_the_caller_was_cancelled_is_handed_on() -> None:
    connection, _ = connected()
    got: list[RespValue] = []
    task = await sent(connection, got)
    # Cancelled, and its reply read before it wakes to learn so.
    task.cancel()
    connection.data_received(b":1\r\n")
    await settled(task)
    assert got == [1]
    # The line stays in order: the next call gets its own reply.
    follower = asyncio.get_running_loop().create_task(connection.call([b"PING"], 5))
    await asyncio.sleep(0)
    connection.data_received(b"+PONG\r\n")
    assert await follower == b"PONG"


async def test_a_cancelled_call_whose_connection_fails_hands_on_nothing() -> None:
    connection, _ = connected()
    got: list[RespValue] = []
    task = await sent(connection, got)
    task.cancel()
    await settled(task)
    # Reset before the reply: what the command did is not known, so nothing is said of it.
    connection.connection_lost(None)
    await asyncio.sleep(0)
    assert got == []


async def test_a_retired_connection_reads_the_replies_it_owes_then_closes() -> None:
    connection, socket = connected()
    loop = asyncio.get_running_loop()
    first = loop.create_task(connection.call([b"EVALSHA"], 5))
    second = loop.create_task(connection.call([b"EVALSHA"], 5))
    await asyncio.sleep(0)
    connection.retire()
    assert not socket.closed
    with pytest.raises(RedisUnavailable):
        await connection.call([b"PING"], 5)
    connection.data_received(b"-READONLY You can't write against a read only replica.\r\n")
    assert not socket.closed
    connection.data_received(b"-READONLY You can't write against a read only replica.\r\n")
    assert socket.closed
    for task in (first, second):
        reply = await task
        assert getattr(reply, "code", None) == "READONLY"


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP command as a client writes it (an array of bulk strings); [] at the end of the stream."""
    head = await reader.readline()
    if not head:
        return []
    args = []
    for _ in range(int(head[1:])):
        size = int((await reader.readline())[1:])
        args.append((await reader.readexactly(size + 2))[:-2])
    return args


def store_at(url: str, tenants: tuple[str, ...]) -> RedisStore:
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    limit = TenantLimit(tokens_per_minute=60_000)
    config = LimitsConfig(
        redis=RedisTarget(host=host, port=int(port)),
        redis_timeout_seconds=2.0,
        tenants=MappingProxyType(dict.fromkeys(tenants, limit)),
    )
    return RedisStore(config, LimitCounters(), time.monotonic)


async def test_a_cancelled_check_that_redis_refuses_keeps_the_settlement_it_carried() -> None:
    """OOM is answered before the script runs: the settlement sent with the check never applied."""
    gone = asyncio.Event()
    answered = asyncio.Event()

    async def out_of_memory(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while args := await read_command(reader):
            if args[0] == b"SCRIPT":
                writer.write(b"$%d\r\n%s\r\n" % (len(SHA), SHA))
            else:
                # Answered once the caller is gone.
                await gone.wait()
                writer.write(b"-OOM command not allowed when used memory > 'maxmemory'.\r\n")
                answered.set()
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    async with fake_redis(out_of_memory) as url:
        store = store_at(url, ("a",))
        try:
            store.pending["a"] = -1000
            check = asyncio.get_running_loop().create_task(store.check("a", 10, debit=True))
            await wait_for(lambda: store.counters.redis_calls.get("check") == 1)
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
            assert check.cancelled()
            assert store.pending == {}
            gone.set()
            await asyncio.wait_for(answered.wait(), 5)
            await wait_for(lambda: store.pending == {"a": -1000})
        finally:
            await store.close()


async def test_checks_sent_with_one_that_meets_readonly_keep_their_settlements() -> None:
    """Two tenants' checks pipelined on one connection to a demoted primary, their replies a moment
    apart: the first READONLY retires the connection without failing the second, whose settlement
    (it never ran) is kept too."""
    evalshas = 0

    async def demoted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal evalshas
        while args := await read_command(reader):
            if args[0] == b"SCRIPT":
                writer.write(b"$%d\r\n%s\r\n" % (len(SHA), SHA))
            else:
                evalshas += 1
                if evalshas == 2:
                    # Both sent before either is answered, then answered a moment apart.
                    writer.write(b"-READONLY You can't write against a read only replica.\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.05)  # real time: the second reply in a read of its own
                    writer.write(b"-READONLY You can't write against a read only replica.\r\n")
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    async with fake_redis(demoted) as url:
        store = store_at(url, ("a", "b"))
        try:
            store.pending.update({"a": -1000, "b": -2000})
            verdicts = await asyncio.gather(store.check("a", 10, debit=True), store.check("b", 10, debit=True))
            assert list(verdicts) == [None, None]
            assert store.pending == {"a": -1000, "b": -2000}
            assert store.counters.redis_errors == {"error": 2}
        finally:
            await store.close()


def test_a_server_that_takes_no_writes_is_known_by_its_code_or_inside_a_script_error() -> None:
    assert refuses_writes(RedisError("READONLY You can't write against a read only replica."))
    assert refuses_writes(RedisError("LOADING Redis is loading the dataset in memory"))
    # Redis 6 wraps a script's redis.call() error in its own.
    assert refuses_writes(
        RedisError(
            "ERR Error running script (call to f_0123): @user_script:50: @user_script: 50: "
            "-READONLY You can't write against a read only replica."
        )
    )
    assert not refuses_writes(RedisError("OOM command not allowed when used memory > 'maxmemory'."))
    assert not refuses_writes(RedisError("ERR wrong number of arguments for 'evalsha' command"))
