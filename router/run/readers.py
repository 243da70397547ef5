"""The background readers of the replicas, a router's and a worker's alike.

Each reads something of every replica off the request path: its model cards
(/v1/models, when it joins or shows life), its engine's load (while its model
is busy), its health (on an interval). start_readers builds those the config
turns on; RouterServer runs them as tasks and cancels them on stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, NamedTuple

import aiohttp

from router.control.cards import CardReader
from router.control.engines import EngineReader
from router.control.health import HealthChecker
from router.core.clock import Clock
from router.core.config.cards import Cards
from router.core.config.settings import Config
from router.core.pool.loads import Bounds, EngineView
from router.core.pool.pool import Pool
from router.http.client import Client


class Readers(NamedTuple):
    """The readers a config turns on; None where it turns one off."""

    cards: CardReader | None
    engines: EngineReader | None
    health: HealthChecker | None

    def run(self) -> list[asyncio.Task[None]]:
        """Each reader's loop as a task of the running loop."""
        loop = asyncio.get_running_loop()
        loops: list[Coroutine[Any, Any, None]] = [r.run() for r in self if r is not None]
        return [loop.create_task(each) for each in loops]


def start_readers(
    stack: contextlib.AsyncExitStack,
    config: Config,
    pool: Pool,
    *,
    session: aiohttp.ClientSession,
    cards: Cards,
    clock: Clock,
) -> Readers:
    """The readers `config` turns on, reading into `pool` and the catalog's `cards` (closes on `stack`)."""
    card_reader = engines = health = None
    if config.model_cards:
        # Each replica's /v1/models when it joins or shows life: the catalog's model cards.
        credentials = {name: m.upstream for name, m in config.models.items() if m.upstream is not None}
        card_reader = CardReader(pool, session, cards, credentials=credentials)
    if config.engine_metrics_seconds > 0:
        # Each engine's load, read while its model is busy (router/control/engines.py).
        engines = engine_reader(stack, config, pool, clock)
    if config.health_check_interval_seconds > 0:
        health = HealthChecker(
            pool,
            session,
            path=config.health_check_path,
            interval=config.health_check_interval_seconds,
            timeout=config.health_check_timeout_seconds,
        )
    return Readers(card_reader, engines, health)


def engine_view(config: Config, clock: Clock) -> EngineView | None:
    """How the engines' readings weigh in picks (router/core/pool/loads.py); None when they are not read."""
    every = config.engine_metrics_seconds
    if every <= 0:
        return None
    default = Bounds(config.saturated_waiting, config.saturated_kv)
    bounds = {
        name: Bounds(
            model.saturated_waiting if model.saturated_waiting is not None else default.waiting,
            model.saturated_kv if model.saturated_kv is not None else default.kv,
        )
        for name, model in config.models.items()
    }
    # A reading three intervals old (and at least a second) says nothing any more.
    return EngineView(clock.now, stale_after=max(1.0, 3 * every), bounds=bounds, default=default, fresh_for=every)


def engine_reader(stack: contextlib.AsyncExitStack, config: Config, pool: Pool, clock: Clock) -> EngineReader:
    """The reader of the engines' loads, on an upstream client of its own (its close on `stack`)."""
    client = Client(
        connect_timeout=min(config.connect_timeout_seconds, 2.0),
        keepalive_seconds=config.upstream_keepalive_seconds,
        idle_timeout=max(2.0, 2 * config.engine_metrics_seconds),
        clock=clock,
    )
    stack.push_async_callback(client.close)
    return EngineReader(pool, client, every=config.engine_metrics_seconds)
