"""The rounds: every router's usage map and replicas, merged into the board's view.

A round asks every router at once (GET /api/v1/usage, then GET
/api/v1/replicas, with the admin token) and waits for each at most
`timeout_seconds`; a router that fails, is slow or answers nonsense is
counted and logged (once a minute per router) and makes the round
incomplete, and its last answer stands in for it in the request counts
(the HPA's metric) until it answers again or leaves. With
`servers_from_dns` the name is resolved again before every round, so that
router pods that come and go are followed; a name that does not resolve
makes the round incomplete too, and the pods it last gave are polled again.
A pod that leaves the answer (not ready, terminating) may still hold
requests in flight: it is polled while it answers, and counts as any other;
once it does not, it is forgotten (the pod is gone, and what it knew with it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from router.scaler.board import Board
from router.scaler.settings import ScalerSettings, server_url
from router.scaler.sleeper import Sleeper
from router.scaler.view import BadAnswer, FleetView, RouterPoll, build_view, due_to_sleep, parse_poll

log = logging.getLogger("router.scaler")

# A model asked for in vain is remembered this long at most (idleAfter beyond it is unusual).
ASKED_MEMORY_SECONDS = 86400.0
_LOG_EVERY_SECONDS = 60.0
# The most a router's answer may hold: a usage map of 100,000 replicas is about 10 MB.
# Beyond it the answer is refused, not read on into memory until the timeout.
MAX_ANSWER_BYTES = 64 * 1024 * 1024

Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve_servers(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as host:port admin addresses (a headless Service: one per pod)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos})
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]


class PollFailed(Exception):
    """One router did not answer usably in a round; the message says how."""


@dataclass(slots=True)
class ServerStats:
    """One router's polls by the scaler: answered, failed, and when."""

    failures: int = 0
    last_error: str | None = None
    # Whether it answered in the newest round it was part of.
    ok: bool = False
    _logged_at: float = float("-inf")


class Poller:
    """Polls every router's usage map on an interval and merges them."""

    def __init__(
        self,
        settings: ScalerSettings,
        session: aiohttp.ClientSession,
        board: Board,
        *,
        resolve: Resolve = resolve_servers,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.session = session
        self.board = board
        self._resolve = resolve
        self._wall = wall
        self._mono = mono
        self._headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
        # sleepAfter's two-phase sleeps across the routers (sleeper.py).
        self.sleeper = Sleeper(session, settings.token)
        self._poke = asyncio.Event()
        self._asked: dict[str, float] = {}
        # Each router's newest answer, carried into the counts of a round it misses.
        self._last: dict[str, RouterPoll] = {}
        # The routers the DNS name gave last, polled again when it does not resolve.
        self._resolved: list[str] = []
        # Routers the DNS name gave once but no longer: polled while they answer.
        self._departed: set[str] = set()
        self.servers: dict[str, ServerStats] = {}
        self.rounds = 0
        self.incomplete_rounds = 0
        self.round_failures = 0
        self.last_round_seconds = 0.0
        # Monotonic time of the newest complete round; None until one is.
        self.last_complete_at: float | None = None

    def last_complete_age(self) -> float | None:
        """Seconds since the newest round in which every router answered; None if none has been."""
        if self.last_complete_at is None:
            return None
        return max(0.0, self._mono() - self.last_complete_at)

    def poke(self) -> None:
        """Start a round now (a wake call), or right after the one running."""
        self._poke.set()

    async def run(self) -> None:
        while True:
            self._poke.clear()
            try:
                await self.round()
            except Exception:
                # The root of the polling task: a round that breaks must not end the scaler.
                # What it leaves is the previous view, which the board stops trusting once stale.
                self.round_failures += 1
                log.exception("poll round failed")
            try:
                async with asyncio.timeout(self.settings.poll_seconds):
                    await self._poke.wait()
            except TimeoutError:
                pass

    async def round(self) -> FleetView:
        """One round over every router; the view is published on the board and returned."""
        began = time.perf_counter()
        servers, unresolved = await self._servers()
        answers = await asyncio.gather(*(self._poll(s, departed=s in self._departed) for s in servers))
        polls: list[RouterPoll | None] = []
        carried = []
        for server, poll in zip(servers, answers, strict=True):
            if poll is None and server in self._departed:
                self._forget(server)
                continue
            polls.append(poll)
            if poll is not None:
                self._last[server] = poll
            elif server in self._last:
                carried.append(self._last[server])
        polls += [None] * unresolved
        now = self._wall()
        view = build_view(polls, now=now, asked=self._asked, carried=carried)
        self._asked = {
            model: facts.last_asked
            for model, facts in view.models.items()
            if facts.last_asked is not None and now - facts.last_asked < ASKED_MEMORY_SECONDS
        }
        self.board.publish(view)
        if self.board.sleep_after:
            answered = [server for server, poll in zip(servers, answers, strict=True) if poll is not None]
            for replica_id in due_to_sleep(view, self.board.sleep_after):
                self.sleeper.start(replica_id, answered)
        self.rounds += 1
        if view.complete:
            self.last_complete_at = self._mono()
        else:
            self.incomplete_rounds += 1
        self.last_round_seconds = time.perf_counter() - began
        return view

    async def _servers(self) -> tuple[list[str], int]:
        """The admin addresses of this round, and how many names did not resolve (each a missing router)."""
        servers = list(self.settings.servers)
        unresolved = 0
        dns = self.settings.servers_from_dns
        if dns is not None:
            name = str(dns)
            try:
                async with asyncio.timeout(self.settings.timeout_seconds):
                    found = await self._resolve(dns.host, dns.port)
                if not found:
                    raise OSError("no address")
            except (OSError, TimeoutError) as exc:
                unresolved += 1
                self._failed(name, f"cannot resolve {dns.host}: {exc or type(exc).__name__}")
                # A name that does not resolve says nothing of the pods: their figures are still worth having.
                found = self._resolved
            else:
                self._answered(name)
                self._departed = (self._departed | set(self._resolved)) - set(found)
                self._resolved = found
            servers += [s for s in found if s not in servers]
            servers += sorted(self._departed - set(servers))
        self._departed -= set(self.settings.servers)
        return servers, unresolved

    def _forget(self, server: str) -> None:
        """A router gone from the DNS answer that no longer answers: its stats and its last answer go."""
        self._departed.discard(server)
        self.servers.pop(server, None)
        self._last.pop(server, None)
        log.info("router %s left the DNS answer and no longer answers: forgotten", server)

    async def _poll(self, server: str, *, departed: bool = False) -> RouterPoll | None:
        """One router's answer, or None; a failure is counted unless the router left the DNS answer."""
        try:
            async with asyncio.timeout(self.settings.timeout_seconds):
                base = server_url(server)
                usage = await self._get(base + "/api/v1/usage")
                replicas = await self._get(base + "/api/v1/replicas")
            poll = parse_poll(server, usage, replicas)
        except TimeoutError:
            if not departed:
                self._failed(server, f"no answer within {self.settings.timeout_seconds:g} s")
            return None
        except (PollFailed, BadAnswer) as exc:
            if not departed:
                self._failed(server, str(exc))
            return None
        self._answered(server)
        return poll

    async def _get(self, url: str) -> object:
        try:
            async with self.session.get(url, headers=self._headers) as resp:
                pieces: list[bytes] = []
                size = 0
                async for piece in resp.content.iter_chunked(1 << 16):
                    size += len(piece)
                    if size > MAX_ANSWER_BYTES:
                        raise PollFailed(f"GET {url} answered more than {MAX_ANSWER_BYTES} bytes")
                    pieces.append(piece)
                body = b"".join(pieces)
                if resp.status != 200:
                    raise PollFailed(f"GET {url} answered {resp.status}: {body[:200].decode(errors='replace')}")
            return orjson.loads(body)
        except (aiohttp.ClientError, OSError) as exc:
            raise PollFailed(f"GET {url}: {exc or type(exc).__name__}") from exc
        except orjson.JSONDecodeError as exc:
            raise PollFailed(f"GET {url} did not answer JSON: {exc}") from exc

    def _answered(self, server: str) -> None:
        stats = self.servers.setdefault(server, ServerStats())
        stats.ok = True

    def _failed(self, server: str, problem: str) -> None:
        stats = self.servers.setdefault(server, ServerStats())
        stats.ok = False
        stats.failures += 1
        stats.last_error = problem
        now = self._mono()
        if now - stats._logged_at >= _LOG_EVERY_SECONDS:
            stats._logged_at = now
            log.warning("router %s did not answer the round (its models stay active): %s", server, problem)
