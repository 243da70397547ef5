"""The scaler tier's fixtures: two real routers, canned admin APIs, the scaler, and KEDA's gRPC client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from grpc import aio

from router.core.config.settings import Address
from router.scaler.externalscaler_pb2_grpc import ExternalScalerStub
from router.scaler.main import Scaler
from router.scaler.settings import ScalerSettings
from tests.support.scaler import Canned, CannedRouter, Keda, Routers, StartScaler

if TYPE_CHECKING:
    from router.scaler.externalscaler_pb2_grpc import ExternalScalerAsyncStub


@pytest.fixture
async def routers(tmp_path: Path) -> AsyncIterator[Routers]:
    with contextlib.ExitStack() as ports:
        fleet = Routers(tmp_path, ports)
        yield fleet
        for router in fleet.all:
            if router.process is not None:
                router.output()


@pytest.fixture
async def start_scaler() -> AsyncIterator[StartScaler]:
    scalers: list[Scaler] = []

    async def start(servers: Sequence[str], **settings: Any) -> Scaler:
        resolve = settings.pop("resolve", None)
        config = ScalerSettings(
            servers=tuple(servers),
            listen=Address("127.0.0.1", 0),
            http_listen=Address("127.0.0.1", 0),
            poll_seconds=settings.pop("poll_seconds", 0.1),
            timeout_seconds=settings.pop("timeout_seconds", 2.0),
            **settings,
        )
        scaler = Scaler(config) if resolve is None else Scaler(config, resolve=resolve)
        await scaler.start()
        scalers.append(scaler)
        return scaler

    yield start
    for scaler in scalers:
        await scaler.stop()


@pytest.fixture
async def keda() -> AsyncIterator[Keda]:
    """The gRPC client KEDA is: a stub over a real channel to the scaler's listen address."""
    channels: list[aio.Channel] = []

    def connect(scaler: Scaler) -> ExternalScalerAsyncStub:
        channel = aio.insecure_channel(scaler.grpc_address)
        channels.append(channel)
        return ExternalScalerStub(channel)

    yield connect
    for channel in channels:
        await channel.close(None)


@pytest.fixture
async def canned() -> AsyncIterator[Canned]:
    started: list[CannedRouter] = []

    async def start(name: str) -> CannedRouter:
        router = CannedRouter(name)
        await router.start()
        started.append(router)
        return router

    yield start
    for router in started:
        await router.stop()
