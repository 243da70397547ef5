"""KEDA's `externalscaler.ExternalScaler`, answered from the board.

Every call carries the ScaledObject's trigger metadata; metadata that
cannot be used is INVALID_ARGUMENT naming the key, on every method, so that
a broken ScaledObject shows in KEDA's events rather than as a silent
default. Before the first round has finished IsActive is true (unknown is
never idle) and GetMetrics is UNAVAILABLE (no value is known, and 0 is not
"unknown"); so it is while no router has ever answered. A router that
misses a round counts in GetMetrics with its last answer (view.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import grpc
from grpc import aio

from router.scaler.board import Board
from router.scaler.externalscaler_pb2 import (
    GetMetricSpecResponse,
    GetMetricsRequest,
    GetMetricsResponse,
    IsActiveResponse,
    MetricSpec,
    MetricValue,
    ScaledObjectRef,
)
from router.scaler.externalscaler_pb2_grpc import ExternalScalerServicer
from router.scaler.view import BadMetadata, Query, metric_name, parse_metadata

log = logging.getLogger("router.scaler")


async def _query(ref: ScaledObjectRef, context: aio.ServicerContext[object, object]) -> Query:
    try:
        return parse_metadata(ref.scalerMetadata)
    except BadMetadata as exc:
        log.warning("ScaledObject %s/%s: %s", ref.namespace, ref.name, exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{ref.namespace}/{ref.name}: {exc}")


def _spec(query: Query) -> GetMetricSpecResponse:
    return GetMetricSpecResponse(
        metricSpecs=[
            MetricSpec(
                metricName=metric_name(query.model),
                targetSize=max(1, math.ceil(query.target_in_flight)),
                targetSizeFloat=query.target_in_flight,
            )
        ]
    )


class ExternalScaler(ExternalScalerServicer):
    """KEDA's external scaler service over gRPC, answered from the board."""

    def __init__(self, board: Board) -> None:
        self.board = board

    def _tell(self, name: str, query: Query) -> bool:
        """The answer for ScaledObject `name`, logged with its reason when it changes."""
        decision, changed = self.board.tell(name, query)
        if changed:
            state = "active" if decision.active else "inactive"
            log.info("%s (model %s): %s, %s", name, query.model, state, decision.reason)
        return decision.active

    async def IsActive(
        self, request: ScaledObjectRef, context: aio.ServicerContext[object, object]
    ) -> IsActiveResponse:
        query = await _query(request, context)
        return IsActiveResponse(result=self._tell(f"{request.namespace}/{request.name}", query))

    async def StreamIsActive(
        self, request: ScaledObjectRef, context: aio.ServicerContext[object, object]
    ) -> AsyncIterator[IsActiveResponse]:
        """The value now, then each change: after every round and every wake call the model is decided again.

        KEDA drops a pushed true that it cannot act on yet ("will retry on next
        activation"), so a true is pushed again after every wake call for the
        model while it is active, not only when the answer changes: a lost
        activation waits for the next wake (each router calls once per
        wake_cooldown_seconds while it holds requests), not for the next poll.
        The calls between two pushes make one push (the board's changes are
        coalesced). A pushed false KEDA does not act on: scale-in is its polling's.
        """
        query = await _query(request, context)
        name = f"{request.namespace}/{request.name}"
        sent: bool | None = None
        wakes = self.board.wake_calls(query.model)
        self.board.streams += 1
        try:
            async for _ in self.board.changes():
                active = self._tell(name, query)
                calls, wakes = wakes, self.board.wake_calls(query.model)
                if active != sent or (active and calls != wakes):
                    yield IsActiveResponse(result=active)
                    sent = active
        finally:
            self.board.streams -= 1

    async def GetMetricSpec(
        self, request: ScaledObjectRef, context: aio.ServicerContext[object, object]
    ) -> GetMetricSpecResponse:
        return _spec(await _query(request, context))

    async def StreamMetricSpec(
        self, request: ScaledObjectRef, context: aio.ServicerContext[object, object]
    ) -> AsyncIterator[GetMetricSpecResponse]:
        """The spec depends on the metadata alone, so it is sent once and the stream held until the scaler stops."""
        yield _spec(await _query(request, context))
        await self.board.wait_closed()

    async def GetMetrics(
        self, request: GetMetricsRequest, context: aio.ServicerContext[object, object]
    ) -> GetMetricsResponse:
        query = await _query(request.scaledObjectRef, context)
        view = self.board.view
        if view is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no poll round has finished yet: the value is unknown")
        if not view.reporting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no router has answered yet: the value is unknown")
        value = view.facts(query.model).requests
        return GetMetricsResponse(
            metricValues=[
                MetricValue(
                    # KEDA strips its own `sX-` prefix before it calls (external_scaler.go,
                    # RemoveIndexFromMetricName): the name asked is the one GetMetricSpec gave.
                    metricName=request.metricName or metric_name(query.model),
                    metricValue=value,
                    metricValueFloat=float(value),
                )
            ]
        )
