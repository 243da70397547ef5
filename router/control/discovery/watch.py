"""One kind of object (EndpointSlices, or Pods) listed and watched, right through every failure of the watch.

The cycle is list, apply, watch from the list's resourceVersion (with
bookmarks), apply each event; and on *any* end of the watch (its timeout,
a close, an error, 410 Gone) list again and replace the whole view. A watch
can miss events (a DELETED sent while it was down is never replayed to a
watch that restarts from a newer version), so only a fresh list proves the
view; routers that trusted the watch routed to deleted pods for days.

While the API server cannot be read the view is kept as it was, whatever
the outage's length, and the watch says so: it is not `synced`, its
staleness grows, and a log line is written at the first failure and then
every `report_every` seconds. Errors that end a cycle: the library's
`ApiException`, aiohttp's `ClientError`, `OSError` and `TimeoutError` from
the network, `ConfigException` from credentials that cannot be loaded,
`MalformedObject` from an answer the parse cannot read, and
`FleetUnavailable` from a fleet that could not apply a change; the next
cycle starts after a capped backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from router.control.discovery.api import Gone, api_problem, describe, read_body
from router.control.discovery.parse import MalformedObject, read_event, read_list
from router.control.fleet import FleetUnavailable

# One logger for the whole of discovery: operators filter on it.
log = logging.getLogger("router.control.discovery")

T = TypeVar("T")

# Why a list-and-watch cycle began again: the first list, a watch that ended
# (its timeout, or the server closed it), 410 Gone, an error.
RELIST_REASONS = ("start", "watch_ended", "expired", "error")

# The library's list function of one kind (list_namespaced_...), which watches too.
Lister = Callable[..., Awaitable[object]]


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often the API server is asked, and how often an outage is reported."""

    # Pauses after failed cycles: doubling from the first, up to the cap.
    backoff_first: float
    backoff_cap: float
    # Each watch asks the server to end it after 1-2x this (a fresh list then proves the set again).
    watch_seconds: float
    # A watch that ends sooner counts as a failure: a server that ends every
    # watch at once is not asked in a tight loop.
    min_watch_seconds: float
    # While the API cannot be read, one log line this often.
    report_every: float


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a watch asks of the source that owns it."""

    # The client every watch shares, made by whichever asks first.
    connect: Callable[[], Awaitable[k8s.ApiClient]]
    # Make the fleet's set follow a change of the view.
    apply: Callable[[], Awaitable[None]]
    # The replicas applied, for the log lines of an outage.
    kept: Callable[[], int]


class Watch(Generic[T]):
    """One kind of object listed and watched, what the router read of each, and whether that is current."""

    def __init__(
        self,
        kind: str,
        plural: str,
        selector: str | None,
        read: Callable[[Mapping[str, object]], T],
        lister: Callable[[k8s.ApiClient], Lister],
        *,
        namespace: str,
        pacing: Pacing,
        mono: Callable[[], float],
        rng: random.Random,
    ) -> None:
        # "EndpointSlice", "Pod": for log lines; the plural is the metric label and RBAC's name.
        self.kind = kind
        self.plural = plural
        # None: every object of the namespace.
        self.selector = selector
        self.read = read
        self.lister = lister
        self.namespace = namespace
        self.pacing = pacing
        self._mono = mono
        self._rng = rng
        self.objects: dict[str, T] = {}
        # Listed at least once: the join waits for every kind (a half-listed view is not the set).
        self.listed = False
        self.synced = False
        self._started = mono()
        # Monotonic time the objects were last known to match the API server's.
        self.confirmed: float | None = None
        self.lost_at: float | None = None
        self.reported_at = 0.0
        # The resourceVersion of the last list, event or bookmark applied.
        self.version: str | None = None
        self.relists = dict.fromkeys(RELIST_REASONS, 0)

    @property
    def kinds(self) -> str:
        return f"{self.kind}s"

    def stale_seconds(self, now: float) -> float:
        """0 while the view is known current; else how long since it last was (or since start)."""
        if self.synced:
            return 0.0
        return now - (self.confirmed if self.confirmed is not None else self._started)

    async def follow(self, hooks: Hooks) -> None:
        """List and watch until cancelled; every cycle ends in a new list."""
        reason = "start"
        failures = 0
        while True:
            self.relists[reason] += 1
            # When the watch began, once it has: how long it lasted decides the pause.
            began: float | None = None
            try:
                lister = self.lister(await hooks.connect())
                version = await self._list(lister, hooks)
                began = self._mono()
                await self._watch(lister, hooks, version)
                reason = "watch_ended"
            except Gone:
                # The normal end of a long-quiet watch: list again at once.
                reason = "expired"
            except asyncio.CancelledError:
                raise
            except FleetUnavailable as exc:
                # The API answered; a worker did not take the change. The next list applies it again.
                log.warning("discovery: %s; listing and applying again", exc)
                reason, began = "error", None
                failures += 1
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError, ConfigException, MalformedObject) as exc:
                reason, began = "error", None
                failures += 1
                self._lost(exc, hooks.kept())
            except Exception as exc:
                # The root of a background task: a bug here must not end discovery.
                log.exception("discovery cycle of %s failed unexpectedly; listing again", self.kinds)
                reason, began = "error", None
                failures += 1
                self._lost(exc, hooks.kept())
            if began is not None:
                if self._mono() - began >= self.pacing.min_watch_seconds:
                    failures = 0
                    continue
                # A server that ends every watch at once is not asked in a tight loop.
                failures += 1
            await asyncio.sleep(self._backoff(failures))

    async def _list(self, lister: Lister, hooks: Hooks) -> str:
        """List every selected object, replace the view with them, apply; the list's resourceVersion."""
        # Read raw: the library's models cost the event loop (which serves the
        # requests too) some 0.8 s for a list of 1,000 pods, against 0.02 s for
        # orjson, and the router reads a few fields of the JSON anyway.
        response = await lister(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=60, sock_connect=10),
        )
        listed = read_list(await read_body(response, self.kind), self.kind)
        self.objects = {name: self.read(obj) for name, obj in listed.items}
        self.listed = True
        await hooks.apply()
        self._confirm(hooks.kept())
        self.version = listed.version
        return listed.version

    async def _watch(self, lister: Lister, hooks: Hooks, version: str) -> None:
        """Apply each event from `version` on until the watch ends; raise Gone on 410."""
        seconds = self._rng.uniform(self.pacing.watch_seconds, 2 * self.pacing.watch_seconds)
        # "object": each event's JSON as is, not the library's models (see _list).
        async with k8s_watch.Watch(return_type="object") as watch:
            stream = watch.stream(
                lister,
                self.namespace,
                label_selector=self.selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(seconds)),
                # The server ends the watch; this is for one that went silent (a partition).
                _request_timeout=aiohttp.ClientTimeout(total=seconds + 30, sock_connect=10),
            )
            try:
                async for event in stream:
                    await self._event(event, hooks)
            except ApiException as exc:
                if exc.status == 410:
                    raise Gone(api_problem(exc)) from exc
                raise

    async def _event(self, raw: object, hooks: Hooks) -> None:
        """Bring the view up to one event, and the fleet's set when it changed anything the router reads."""
        event = read_event(raw, self.kind)
        if event.type in ("ADDED", "MODIFIED") and event.name is not None:
            read = self.read(event.obj)
            # Pods change status far more often than labels: most events change nothing the router reads.
            changed = self.objects.get(event.name) != read
            self.objects[event.name] = read
        elif event.type == "DELETED" and event.name is not None:
            changed = self.objects.pop(event.name, None) is not None
        elif event.type == "BOOKMARK":
            changed = False
        else:
            log.warning("ignored a watch event of unknown type %r", event.type)
            return
        if changed:
            await hooks.apply()
        if event.version is not None:
            self.version = event.version
        self._confirm(hooks.kept())

    def _confirm(self, kept: int) -> None:
        now = self._mono()
        self.confirmed = now
        if not self.synced and self.lost_at is not None:
            log.info(
                "%s readable again after %.0f s; listed afresh (%d replicas)", self.kinds, now - self.lost_at, kept
            )
            self.lost_at = None
        self.synced = True

    def _lost(self, exc: BaseException, kept: int) -> None:
        now = self._mono()
        self.synced = False
        if self.lost_at is None:
            self.lost_at = now
            self.reported_at = now
            log.warning(
                "cannot read %s from the Kubernetes API (%s); keeping the last known set of %d replicas",
                self.kinds,
                describe(exc),
                kept,
            )
        elif now - self.reported_at >= self.pacing.report_every:
            self.reported_at = now
            log.warning(
                "still cannot read %s after %.0f s (%s); keeping the last known set of %d replicas, stale for %.0f s",
                self.kinds,
                now - self.lost_at,
                describe(exc),
                kept,
                self.stale_seconds(now),
            )

    def _backoff(self, failures: int) -> float:
        if failures == 0:
            return 0.0
        delay = min(self.pacing.backoff_cap, self.pacing.backoff_first * 2.0 ** min(failures - 1, 30))
        # Many routers restarted together must not retry in step.
        return delay * self._rng.uniform(0.8, 1.0)
