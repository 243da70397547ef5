"""Which loop each test runs on, and a deadline that holds on it: hooks, imported by tests/conftest.py.

Kept apart so that a pytest run of its own can load them alone
(`-p tests.support.loops`): tests/test_loops.py checks that they do what they say.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop

# The loop each test runs on is the loop its code runs on in production:
# uvloop for everything `router serve`, its workers, `router fake` and
# `router bench` run (each starts with uvloop.run), asyncio's own for
# `router scaler` (grpcio's asyncio server drives its own polling on it).
ASYNCIO_LOOP_TIERS = ("tests/scaler/",)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.nodeid.startswith(ASYNCIO_LOOP_TIERS):
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """An async test's own deadline, on its loop: pytest-timeout's cannot reach a uvloop test.

    pytest-timeout's signal method raises from a SIGALRM handler, and uvloop
    runs Python signal handlers as loop callbacks, whose exceptions it logs
    and drops: a test waiting on uvloop would hang through it. So an async
    test runs under asyncio.timeout a little inside its pytest-timeout limit
    (it fails, the suite goes on), and pytest-timeout's thread method stays
    behind it for a hang outside the loop (pyproject.toml: it ends the run).
    """
    function = getattr(item, "obj", None)
    if not isinstance(item, pytest.Function) or not inspect.iscoroutinefunction(function):
        return (yield)
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout"))
    if limit <= 0:
        return (yield)

    # Inside the limit by a second at least (5% of a long one): on a loaded machine the loop's
    # deadline fires late, and one a tenth of a second inside it lost the race to the thread.
    deadline = limit - max(1.0, limit * 0.05) if limit > 2.0 else limit / 2

    @functools.wraps(function)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(deadline):
                return await function(*args, **kwargs)
        except TimeoutError as exc:
            raise pytest.fail.Exception(f"Timeout: the test ran over {deadline:g} s on its loop") from exc

    item.obj = bounded
    try:
        return (yield)
    finally:
        item.obj = function


class _LoopErrors(logging.Handler):
    """What the event loop logged as an error: an exception raised in a callback, a transport's fatal error."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_loop_errors() -> Iterator[None]:
    """Fails a test during which the loop logged an error: asyncio and uvloop both log, and go on
    past, what a protocol callback raises, so such a defect would otherwise pass every assertion."""
    handler = _LoopErrors()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.records:
        formatter = logging.Formatter()
        shown = "\n".join(
            r.getMessage() + ("\n" + formatter.formatException(r.exc_info) if r.exc_info else "")
            for r in handler.records[:3]
        )
        pytest.fail(f"the event loop logged {len(handler.records)} error(s):\n{shown}", pytrace=False)
