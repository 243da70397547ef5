"""What a Kubernetes Service does for the rolling-update tests, in small: it sends each request to a
backend whose readiness probe last answered 200, and learns of a failed probe `lag` seconds late
(the endpoint is taken out of every node's rules that much later)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass
class Backend:
    client_url: str
    ready_url: str


@dataclass
class Balancer:
    backends: list[Backend]
    period: float = 0.2
    lag: float = 1.0
    ready: dict[str, bool] = field(default_factory=dict)
    # What the clients saw ("ok", "status 503", an exception's name), and where each request went.
    outcomes: Counter[str] = field(default_factory=Counter)
    sent_to: Counter[str] = field(default_factory=Counter)
    _turn: int = 0

    def __post_init__(self) -> None:
        self.ready = {b.client_url: True for b in self.backends}

    def pick(self) -> str:
        ready = [b.client_url for b in self.backends if self.ready[b.client_url]]
        assert ready, "no backend ready"
        self._turn += 1
        return ready[self._turn % len(ready)]

    async def probe(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                for backend in self.backends:
                    try:
                        async with session.get(backend.ready_url) as resp:
                            await resp.read()
                            ready = resp.status == 200
                    except aiohttp.ClientError:
                        ready = False
                    if not ready:
                        loop.call_later(self.lag, self.ready.__setitem__, backend.client_url, False)
                # A balancer's probe period, as a Service's endpoints are probed: real time.
                await asyncio.sleep(self.period)

    async def client(self, session: aiohttp.ClientSession, body: Mapping[str, Any], stop: asyncio.Event) -> None:
        """Streams one request after another through the balancer until `stop`, counting how each ended."""
        data = orjson.dumps({**body, "stream": True})
        while not stop.is_set():
            url = self.pick()
            try:
                async with session.post(url + "/v1/chat/completions", data=data) as resp:
                    answer = await resp.read()
                    ok = resp.status == 200 and answer.rstrip().endswith(b"data: [DONE]")
                    self.outcomes["ok" if ok else f"status {resp.status}"] += 1
            except aiohttp.ClientError as exc:
                self.outcomes[type(exc).__name__] += 1
            self.sent_to[url] += 1
