"""The conformance tier's fixtures: misbehaving replicas written for each test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.http.conformance.wire import StartRaw, raw_replicas


@pytest.fixture
async def start_raw() -> AsyncIterator[StartRaw]:
    async with raw_replicas() as start:
        yield start
