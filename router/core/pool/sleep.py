"""The sleep tier: each engine's sleep and wake calls, and the two steps that put a replica to sleep or wake it.

Read from each engine's own source:

- vLLM (vllm/entrypoints/serve/sleep/api_router.py; the routes exist only with
  VLLM_SERVER_DEV_MODE=1, and sleeping needs `--enable-sleep-mode`):
  `POST /sleep?level=N` answers 200 once asleep, `POST /wake_up` (optional
  repeated `tags`) once awake, `GET /is_sleeping` says `{"is_sleeping": bool}`.
- SGLang (python/sglang/srt/entrypoints/http_server.py):
  `POST /release_memory_occupation` and `POST /resume_memory_occupation`,
  JSON bodies with optional `tags`; it has no is_sleeping: the resume call's
  200 is the word that it is awake.

The calls go through a one-method seam (`EngineCall`) that the wiring gives:
no HTTP here. A wake is the wake call, then `/is_sleeping` until it says
false, all within one deadline; anything else (a refusal, an unreachable
engine, an answer that is not `{"is_sleeping": bool}`) is a failed wake that
names what it saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import orjson

from router.core.pool.pool import Pool
from router.core.pool.replicas import Replica

# How often a waking replica's /is_sleeping is asked, and how much of an engine's answer a message quotes.
POLL_SECONDS = 0.05
_QUOTED_BYTES = 200


class EngineCall(Protocol):
    """One HTTP call to an engine: its status and body; EngineCallFailed when nothing usable came back."""

    async def __call__(self, method: str, url: str, body: bytes | None, seconds: float) -> tuple[int, bytes]: ...


class EngineCallFailed(Exception):
    """A sleep or wake call that did not do what it asked; the message names the engine's answer."""


@dataclass(frozen=True, slots=True)
class SleepApi:
    """One engine's sleep and wake calls: method and path, and the body they send."""

    engine: str
    sleep: tuple[str, str]
    wake: tuple[str, str]
    # The path that says whether it still sleeps; None: the wake call's 200 says it is awake.
    check: str | None
    body: bytes | None

    def sleep_path(self, level: int) -> str:
        return self.sleep[1].format(level=level)


SLEEP_APIS = {
    "vllm": SleepApi("vllm", ("POST", "/sleep?level={level}"), ("POST", "/wake_up"), "/is_sleeping", None),
    "sglang": SleepApi(
        "sglang", ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"), None, b"{}"
    ),
}
LEVELS = (1, 2)


def sleep_api(engine: str | None) -> SleepApi | None:
    """The sleep calls of `engine`; None: it has none the router knows (llama.cpp, TGI) or it is not known."""
    return SLEEP_APIS.get(engine) if engine is not None else None


def _quote(body: bytes) -> str:
    text = body[:_QUOTED_BYTES].decode("utf-8", "replace")
    return text + ("..." if len(body) > _QUOTED_BYTES else "")


async def _call(call: EngineCall, method: str, url: str, body: bytes | None, *, seconds: float, what: str) -> bytes:
    if seconds <= 0:
        raise EngineCallFailed(f"{what}: no time left")
    try:
        status, answer = await call(method, url, body, seconds)
    except TimeoutError:
        raise EngineCallFailed(f"{what}: no answer within {seconds:.3g} s") from None
    if not 200 <= status < 300:
        raise EngineCallFailed(f"{what}: HTTP {status} {_quote(answer)}".rstrip())
    return answer


async def put_to_sleep(call: EngineCall, api: SleepApi, base_url: str, level: int, seconds: float) -> None:
    """The engine's sleep call at `level`; EngineCallFailed unless it answered 2xx within `seconds`."""
    method, _ = api.sleep
    path = api.sleep_path(level)
    await _call(call, method, base_url.rstrip("/") + path, api.body, seconds=seconds, what=f"{method} {path}")


async def wake_up(call: EngineCall, api: SleepApi, base_url: str, seconds: float, now: Callable[[], float]) -> None:
    """The engine's wake call, then its sleep check until awake, all within `seconds`.

    An engine whose check says it is awake already (woken by another router
    or worker) gets no call. EngineCallFailed names what went wrong: a
    refusal, a silence, an answer that is not `{"is_sleeping": bool}`, or
    still asleep at the deadline.
    """
    deadline = now() + seconds
    # Each step gets what is left of `seconds`, not all of it: the whole wake is bounded.
    if api.check is not None and not await _sleeping(call, api, base_url, max(0.0, deadline - now())):
        return
    method, path = api.wake
    left = max(0.0, deadline - now())
    await _call(call, method, base_url.rstrip("/") + path, api.body, seconds=left, what=f"{method} {path}")
    await until_awake(call, api, base_url, deadline, now=now)


async def until_awake(
    call: EngineCall,
    api: SleepApi,
    base_url: str,
    deadline: float,
    *,
    now: Callable[[], float],
    elsewhere: Callable[[], bool] | None = None,
) -> None:
    """Its sleep check until it says awake, by `deadline`; for an engine with none (SGLang), until
    `elsewhere()` (a wake under way in another process) is false: that wake's end is the word."""
    seconds = deadline - now()
    if api.check is None:
        while elsewhere is not None and elsewhere():
            if deadline - now() <= POLL_SECONDS:
                raise EngineCallFailed("the wake under way elsewhere did not end in time")
            await asyncio.sleep(POLL_SECONDS)
        return
    while await _sleeping(call, api, base_url, deadline - now()):
        if deadline - now() <= POLL_SECONDS:
            raise EngineCallFailed(f"still asleep {seconds:.3g} s later")
        await asyncio.sleep(POLL_SECONDS)


async def _sleeping(call: EngineCall, api: SleepApi, base_url: str, seconds: float) -> bool:
    """What its sleep check says now; EngineCallFailed for anything but `{"is_sleeping": bool}`."""
    assert api.check is not None
    what = f"GET {api.check}"
    answer = await _call(call, "GET", base_url.rstrip("/") + api.check, None, seconds=seconds, what=what)
    try:
        doc = orjson.loads(answer)
    except orjson.JSONDecodeError:
        doc = None
    sleeping = doc.get("is_sleeping") if isinstance(doc, dict) else None
    if not isinstance(sleeping, bool):
        raise EngineCallFailed(f'{what}: expected {{"is_sleeping": true|false}}, got {_quote(answer)}')
    return sleeping


def says_sleeping(status: int, body: bytes) -> bool:
    """Whether an engine's answer to a request says it is asleep: a 503 whose error message says "sleeping".

    vLLM itself keeps a request to a sleeping engine waiting (its scheduler
    is paused); a 503 that says so comes from engines and fronts that answer
    rather than hold (and from `router fake`). A 503 that does not say it is
    a failure as any other.
    """
    if status != 503 or b"sleep" not in body:
        return False
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return isinstance(message, str) and "sleeping" in message.lower()


class Claims(Protocol):
    """Who makes a replica's wake call when several processes would (the workers of one router)."""

    def claim(self, replica_id: str) -> Callable[[], None] | None:
        """The release of this process's claim, or None: another process holds it (its wake is under way)."""
        ...

    def held(self, replica_id: str) -> bool:
        """Whether another process holds the claim now."""
        ...


class _Alone:
    """One process: every claim is its own."""

    def claim(self, replica_id: str) -> Callable[[], None] | None:
        return _nothing

    def held(self, replica_id: str) -> bool:
        return False


def _nothing() -> None:
    return None


_ALONE = _Alone()


class Wakes:
    """The wakes under way in this process: one wake call per replica, however many ask for it.

    The replica shows `waking` while its wake runs, `ready` once awake; a
    wake that fails leaves it asleep, and every one who waited on it gets the
    same EngineCallFailed.
    """

    def __init__(self, pool: Pool, call: EngineCall, now: Callable[[], float]) -> None:
        self._pool = pool
        self._call = call
        self._now = now
        # Across processes (--workers): who makes a replica's wake call (router.run.workers.claims).
        self.claims: Claims = _ALONE
        self._under_way: dict[Replica, asyncio.Task[None]] = {}
        # Wakes and sleeps done, by result: what the metrics count.
        self.results: dict[tuple[str, str], int] = {}

    def under_way(self, replica: Replica) -> bool:
        return replica in self._under_way

    async def close(self) -> None:
        """At shutdown: the wakes under way end (their waiters see them cancelled)."""
        tasks = list(self._under_way.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def count(self, kind: str, result: str) -> None:
        self.results[kind, result] = self.results.get((kind, result), 0) + 1

    def wake(self, replica: Replica, seconds: float) -> asyncio.Task[None]:
        """The task that wakes `replica` (started now, or the one already running): await it (shielded)."""
        task = self._under_way.get(replica)
        if task is None:
            task = self._under_way[replica] = asyncio.get_running_loop().create_task(self._wake(replica, seconds))
            task.add_done_callback(lambda _: self._under_way.pop(replica, None))
        return task

    async def _wake(self, replica: Replica, seconds: float) -> None:
        level = replica.asleep if replica.asleep is not None else 1
        api = sleep_api(replica.engine)
        if api is None:
            self.count("wake", "failed")
            raise EngineCallFailed(f"its engine ({replica.engine or 'not known'}) has no sleep API the router knows")
        self._pool.set_sleep(replica, level, waking=True)
        claims = self.claims
        release = claims.claim(replica.id)
        try:
            if release is not None:
                await wake_up(self._call, api, replica.base_url, seconds, self._now)
            else:
                # Another process makes the call: this one waits for its engine to say it is awake.
                deadline = self._now() + seconds
                await until_awake(
                    self._call,
                    api,
                    replica.base_url,
                    deadline,
                    now=self._now,
                    elsewhere=lambda: claims.held(replica.id),
                )
        except BaseException:
            if not replica.removed and replica.asleep is not None:
                self._pool.set_sleep(replica, level)
            self.count("wake", "failed")
            raise
        finally:
            if release is not None:
                release()
        self._pool.set_sleep(replica, None)
        if replica.ejected_until is not None:
            # Ejected by an earlier wake that failed: awake now, so in rotation at once.
            self._pool.ejections.readmit(replica, "woken")
        self.count("wake", "ok")
