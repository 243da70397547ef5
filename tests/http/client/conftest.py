"""The upstream client's fixture: `make_client`, clients closed after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.upstream import MakeClient, clients_made


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    async for make in clients_made():
        yield make
