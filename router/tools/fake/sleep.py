"""The fake replica's sleep mode: vLLM's sleep API and SGLang's memory release, with their times set per fake.

vLLM (vllm/entrypoints/serve/sleep/api_router.py, mounted only with
VLLM_SERVER_DEV_MODE=1 and `--enable-sleep-mode`): `POST /sleep?level=N`
(0 pauses the scheduler alone, 1 offloads the weights and drops the KV cache,
2 drops both; `mode=abort|wait|keep` says what becomes of the requests
running) answers 200 once asleep; `POST /wake_up` with optional repeated
`tags` (`weights`, `kv_cache`) answers 200 once those are back; `GET
/is_sleeping` answers `{"is_sleeping": bool}`, true while any tag still
sleeps. SGLang (python/sglang/srt/entrypoints/http_server.py):
`POST /release_memory_occupation` and `POST /resume_memory_occupation`, each
with an optional JSON body `{"tags": [...]}`.

What an engine answers on its inference paths while asleep: vLLM's own
engine pauses its scheduler and keeps a new request waiting until it is woken
(vllm/v1/engine/core.py, sleep() = pause_scheduler() + the executor's sleep;
a middleware answering 503 was proposed in vllm-project/vllm#16536 and not
merged). The fake answers 503 with a body that says "sleeping" by default
(`asleep_answer="503"`, what the router recognises as asleep), or holds the
request until it is awake (`asleep_answer="hold"`, vLLM's behaviour).

Switches for a broken engine's sleep API: a wake that never ends
(`wake_hangs`), one that fails (`wake_status`), one whose /is_sleeping
answers garbage (`garbage`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

TAGS = ("weights", "kv_cache")
ANSWERS = ("503", "hold")
SLEEPING_BODY = orjson.dumps(
    {
        "error": {
            "message": "The engine is sleeping (sleep mode); wake it with POST /wake_up.",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
)


@dataclass
class SleepMode:
    """A fake's sleep state and switches; mutable, as Behaviour is, so that a test flips them while it runs."""

    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    asleep_answer: str = "503"
    # Hostile switches: the wake call never answers; it answers this status; /is_sleeping answers junk.
    wake_hangs: bool = False
    wake_status: int | None = None
    garbage: bool = False
    # A wake that waits for this event first (a test decides when it ends); None: no wait.
    wake_gate: asyncio.Event | None = None
    # The tags asleep now (empty: awake), and the level it was put to sleep at (None: awake).
    asleep: set[str] = field(default_factory=set)
    level: int | None = None
    # What it was asked, for the tests: every sleep and wake call, in order.
    calls: list[str] = field(default_factory=list)
    # Requests that arrived while asleep, and the in-flight count at each sleep call.
    refused: int = 0
    # Each GET /is_sleeping's peer port: a test tells the processes that asked apart by it.
    checks: list[int] = field(default_factory=list)
    busy_at_sleep: list[int] = field(default_factory=list)
    # When each wake ended (time.monotonic()), for a bench's added latency.
    woke_at: list[float] = field(default_factory=list)
    _awake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _active: Callable[[], int] = field(default=lambda: 0, repr=False)

    def __post_init__(self) -> None:
        if self.asleep_answer not in ANSWERS:
            raise ValueError(f"asleep_answer must be one of {', '.join(ANSWERS)}, got {self.asleep_answer!r}")
        self._awake.set()

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep) or self.level == 0

    def add_routes(self, app: web.Application, active: Callable[[], int]) -> None:
        """vLLM's three paths and SGLang's two; `active` says how many requests run now."""
        self._active = active
        app.router.add_post("/sleep", self._sleep)
        app.router.add_post("/wake_up", self._wake_up)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.router.add_post("/release_memory_occupation", self._release)
        app.router.add_post("/resume_memory_occupation", self._resume)

    async def guard(self) -> web.Response | None:
        """On an inference path: None to serve it now, else the answer of a sleeping engine."""
        if not self.sleeping:
            return None
        self.refused += 1
        if self.asleep_answer == "hold":
            await self._awake.wait()
            return None
        return web.Response(status=503, body=SLEEPING_BODY, content_type="application/json")

    async def _put_to_sleep(self, level: int, tags: tuple[str, ...]) -> None:
        self.busy_at_sleep.append(self._active())
        if self.sleep_seconds:
            await asyncio.sleep(self.sleep_seconds)
        self.level = level
        self.asleep = set(tags) if level else set()
        self._awake.clear()

    async def _sleep(self, request: web.Request) -> web.Response:
        raw = request.query.get("level", "1")
        mode = request.query.get("mode", "abort")
        if raw not in ("0", "1", "2") or mode not in ("abort", "wait", "keep"):
            message = f"level must be 0, 1 or 2 and mode abort, wait or keep; got {raw!r}, {mode!r}"
            return web.json_response({"error": message}, status=400)
        self.calls.append(f"sleep {raw}")
        await self._put_to_sleep(int(raw), TAGS)
        return web.Response(status=200)

    async def _wake(self, tags: list[str]) -> web.Response:
        if self.wake_hangs:
            await asyncio.Event().wait()
        if self.wake_gate is not None:
            await self.wake_gate.wait()
        if self.wake_status is not None:
            return web.json_response({"error": "wake failed"}, status=self.wake_status)
        if self.wake_seconds:
            await asyncio.sleep(self.wake_seconds)
        # vLLM wakes every tag when none is named; an unknown tag names no memory and wakes nothing.
        self.asleep -= set(tags) if tags else set(TAGS)
        if not self.asleep:
            self.level = None
            self._awake.set()
            self.woke_at.append(time.monotonic())
        return web.Response(status=200)

    async def _wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", [])
        self.calls.append("wake_up" + (f" {','.join(tags)}" if tags else ""))
        return await self._wake(tags)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        self.checks.append(peer[1] if peer else 0)
        if self.garbage:
            return web.Response(body=b"\x00not json{", content_type="application/json")
        return web.json_response({"is_sleeping": self.sleeping})

    @staticmethod
    async def _tags(request: web.Request) -> list[str] | web.Response:
        raw = await request.read()
        if not raw.strip():
            return []
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return web.json_response({"success": False, "message": "body is not JSON"}, status=400)
        tags = body.get("tags") if isinstance(body, dict) else None
        return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []

    async def _release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        self.calls.append("release_memory_occupation")
        await self._put_to_sleep(1, tuple(tags) or TAGS)
        return web.json_response(None)

    async def _resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        self.calls.append("resume_memory_occupation")
        answer = await self._wake(tags)
        return web.json_response(None) if answer.status == 200 else answer
