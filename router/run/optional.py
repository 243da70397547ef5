"""The parts of a router that run only as configured, each set up in one call from its wiring
(router.run.app): the tenants' rate limits (`[limits]`), the wake calls of held requests
(`wake_url`), and the sleep tier, whose one wake per replica the request path and the admin API
share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import aiohttp
from prometheus_client import CollectorRegistry

from router.control.sleeping import SleepCollector, Sleeper
from router.core.clock import Clock
from router.core.config.settings import Config
from router.core.pool.pool import Pool
from router.core.pool.sleep import Wakes
from router.gateway.dispatch import Proxy
from router.gateway.limits import build_limiter
from router.gateway.sleepers import Sleepers
from router.gateway.wake import Waker
from router.run.session import SessionCall


def limit_tenants(
    proxy: Proxy,
    config: Config,
    now: Callable[[], float],
    registry: CollectorRegistry,
    stack: contextlib.AsyncExitStack,
) -> None:
    """[limits]: the tenants' rate limits on the proxy, their store closed with the router; nothing when unset."""
    if config.limits is not None:
        proxy.limiter = limiter = build_limiter(config.limits, now, registry)
        stack.push_async_callback(limiter.store.close)


def waker_of(  # noqa: PLR0917 (the wiring's parts, each named where the router made it)
    config: Config,
    pool: Pool,
    session: aiohttp.ClientSession,
    clock: Clock,
    wall: Callable[[], float],
    registry: CollectorRegistry,
) -> Waker | None:
    """The wake calls a router makes for its held requests (config wake_url); None when it makes none."""
    if not config.wake_url:
        return None
    mono = clock.now

    def held_now(model: str) -> tuple[int, float | None]:
        oldest = pool.cold_start.oldest_held(model)
        return pool.cold_start.held(model), None if oldest is None else wall() - (mono() - oldest)

    return Waker(
        session,
        config.wake_url,
        router=config.router_name,
        cooldown=config.wake_cooldown_seconds,
        token=config.admin_token,
        registry=registry,
        held_now=held_now,
        clock=clock,
    )


def sleep_tier(  # noqa: PLR0917 (the wiring's parts, each named where the router made it)
    proxy: Proxy,
    config: Config,
    pool: Pool,
    session: aiohttp.ClientSession,
    clock: Clock,
    registry: CollectorRegistry,
    stack: contextlib.AsyncExitStack,
) -> Sleeper:
    """The sleep tier of this process: one wake per replica whoever asks, the request path's
    (Sleepers, on the proxy) and the admin API's (the Sleeper returned); counted, ended at stop."""
    wakes = Wakes(pool, SessionCall(session), clock.now)
    stack.push_async_callback(wakes.close)
    registry.register(SleepCollector(wakes))
    proxy.wake_sleepers(Sleepers(pool, wakes, wake_timeout=config.wake_timeout_seconds))

    def wake_timeout(model: str) -> float:
        return config.wake_timeout_seconds

    return Sleeper(pool, SessionCall(session), wakes, wake_timeout=wake_timeout)
