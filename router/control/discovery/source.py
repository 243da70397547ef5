"""Kubernetes discovery as a replica-set source: the views of the watches joined, applied to the fleet.

`[discovery.kubernetes]` owns the whole replica set (endpoint pushes get
409). By default the selector picks the model Services' EndpointSlices,
and one watch (`watch.py`) keeps their view. With `selector_on = "pods"`
it picks pods instead: Pods are listed and watched with it, and the
EndpointSlices of the whole namespace without one, each by the same
cycle, each into its own view. The set is recomputed from both current
views at every change of either (`parse.join_pods`), so a pod event before
its slice's or after it ends in the same set. The default mode reads no
pod: that would need RBAC on pods, which an operator of that mode has not
granted.

While the API server cannot be reached the last known set is kept,
whatever the outage's length: a router never drops replicas because the API
is down. It says so instead: the gauge `router_discovery_stale_seconds`
(stale while either read fails) and a log line a minute.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kubernetes_asyncio import client as k8s
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.control.discovery.access import ApiAccess
from router.control.discovery.parse import (
    PodRead,
    SliceRead,
    SliceView,
    desired_set,
    join_pods,
    object_name,
    parse_slice,
    read_pod,
    slice_members,
)
from router.control.discovery.watch import RELIST_REASONS, Hooks, Pacing, Watch
from router.control.fleet import Fleet
from router.core.config.settings import KubernetesDiscovery, ReplicaConfig

log = logging.getLogger("router.control.discovery")


class KubernetesSource:
    """[discovery.kubernetes]: owns the whole replica set (endpoint pushes get 409)."""

    name = "Kubernetes discovery"
    exclusive = True

    def __init__(
        self,
        settings: KubernetesDiscovery,
        access: ApiAccess,
        *,
        mono: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        backoff_first: float = 0.5,
        backoff_cap: float = 30.0,
        watch_seconds: float = 300.0,
        min_watch_seconds: float = 1.0,
        report_every: float = 60.0,
    ) -> None:
        """`watch_seconds`: each watch asks the server to end it after 1-2x this (a fresh list then
        proves the set again). A watch that ends sooner than `min_watch_seconds` counts as a failure,
        so that a server that ends every watch at once is not asked in a tight loop. While the API
        cannot be reached, one log line every `report_every` seconds."""
        self.settings = settings
        self.access = access
        self._mono = mono
        rng = rng or random.Random()
        pacing = Pacing(backoff_first, backoff_cap, watch_seconds, min_watch_seconds, report_every)
        self.on_pods = settings.selector_on == "pods"
        # With selector_on = "pods" the selector picks pods, and the slices of the
        # whole namespace say which of them serve, where and how (their conditions).
        self._slices: Watch[SliceRead] = Watch(
            "EndpointSlice",
            "endpointslices",
            None if self.on_pods else settings.selector,
            self._read_slice,
            lambda client: k8s.DiscoveryV1Api(client).list_namespaced_endpoint_slice,
            namespace=access.namespace,
            pacing=pacing,
            mono=mono,
            rng=rng,
        )
        self._pods: Watch[PodRead] | None = None
        self._watched: list[Watch[Any]] = [self._slices]
        if self.on_pods:
            self._pods = Watch(
                "Pod",
                "pods",
                settings.selector,
                lambda obj: read_pod(obj, settings),
                lambda client: k8s.CoreV1Api(client).list_namespaced_pod,
                namespace=access.namespace,
                pacing=pacing,
                mono=mono,
                rng=rng,
            )
            self._watched.append(self._pods)
        # What the fleet has from us: the configs, and the ids we drained for terminating.
        self._applied: dict[str, ReplicaConfig] = {}
        self._draining: set[str] = set()
        # (plural, name) -> the problem last warned of.
        self._warned: dict[tuple[str, str], str] = {}
        # Both watches apply: one at a time, each from both current views (never a stale join last).
        self._applying = asyncio.Lock()
        self._connecting = asyncio.Lock()
        self._client: k8s.ApiClient | None = None

    # ReplicaSource ------------------------------------------------------------

    def initial(self) -> tuple[ReplicaConfig, ...]:
        # Nothing is known before the first list; readiness waits for it.
        return ()

    def ready(self) -> bool:
        """Ready once the first lists are applied, and from then on, the API server reachable or not."""
        return all(w.confirmed is not None for w in self._watched)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_DiscoveryCollector(self))

    async def reload(self, fleet: Fleet) -> bool:
        log.info("SIGHUP: the replica set comes from the Kubernetes API and is kept current; nothing to reload")
        return True

    async def run(self, fleet: Fleet) -> None:
        """List and watch each kind of object until cancelled; every cycle of each ends in a new list."""
        if self.on_pods:
            log.info(
                "discovering replicas from the Pods matching %r and the EndpointSlices in %s",
                self.settings.selector,
                self.access.describe(),
            )
        else:
            log.info(
                "discovering replicas from EndpointSlices matching %r in %s",
                self.settings.selector,
                self.access.describe(),
            )
        hooks = Hooks(self._connect, functools.partial(self._apply, fleet), lambda: len(self._applied))
        try:
            async with asyncio.TaskGroup() as tasks:
                for watched in self._watched:
                    tasks.create_task(watched.follow(hooks))
        finally:
            if self._client is not None:
                await self._client.close()
                self._client = None

    # What the watches say ---------------------------------------------------------

    @property
    def relists(self) -> dict[str, int]:
        """Lists by why, of every kind of object together."""
        return {reason: sum(w.relists[reason] for w in self._watched) for reason in RELIST_REASONS}

    def relists_of(self) -> dict[str, dict[str, int]]:
        """Lists by kind of object (plural) and why."""
        return {w.plural: dict(w.relists) for w in self._watched}

    def version_of(self, plural: str) -> str | None:
        """The resourceVersion the view of these objects was last brought up to (a list, event or bookmark)."""
        return next((w.version for w in self._watched if w.plural == plural), None)

    def stale_seconds(self) -> float:
        """0 while every view is known current; else how long since the stalest last was (or since start)."""
        now = self._mono()
        return max(w.stale_seconds(now) for w in self._watched)

    async def _connect(self) -> k8s.ApiClient:
        """The one client both watches share, made by whichever asks first."""
        async with self._connecting:
            if self._client is None:
                self._client = await self.access.connect()
            return self._client

    # Reading and warning ----------------------------------------------------------

    def _read_slice(self, obj: Mapping[str, object]) -> SliceRead:
        read = parse_slice(obj, self.settings, self.access.namespace)
        if self.on_pods:
            # Every slice of the namespace: most hold no selected pod, and owe no warning (join_pods says why).
            return read
        name = object_name(obj, "EndpointSlice")
        problem = slice_members(read, self.settings).problem
        self._warn(
            ("endpointslices", name),
            problem,
            f"EndpointSlice {self.access.namespace}/{name} {problem}; its endpoints are not replicas",
        )
        return read

    def _warn(self, key: tuple[str, str], problem: str | None, message: str) -> None:
        """Warn of a problem once, again only when it changes."""
        if problem is None:
            self._warned.pop(key, None)
        elif self._warned.get(key) != problem:
            self._warned[key] = problem
            log.warning("%s", message)

    def _forget(self, plural: str, present: Mapping[str, object]) -> None:
        """Forget the warnings of objects gone: one that comes back with its problem is warned of again."""
        for key in [k for k in self._warned if k[0] == plural and k[1] not in present]:
            del self._warned[key]

    # Applying ---------------------------------------------------------------------

    def _views(self) -> dict[str, SliceView]:
        if self._pods is None:
            self._forget("endpointslices", self._slices.objects)
            return {name: slice_members(read, self.settings) for name, read in self._slices.objects.items()}
        views, problems = join_pods(self._slices.objects, self._pods.objects, self.settings, self.access.namespace)
        self._forget("pods", problems)
        for pod, problem in problems.items():
            self._warn(("pods", pod), problem, f"Pod {pod} {problem}; it is not a replica")
        return views

    async def _apply(self, fleet: Fleet) -> None:
        """Make the fleet's set the slices' set: drain what terminates, then the whole set at once."""
        async with self._applying:
            if not all(w.listed for w in self._watched):
                return
            members = desired_set(self._views(), self._applied)
            configs = {replica_id: m.config for replica_id, m in members.items()}
            terminating = {replica_id for replica_id, m in members.items() if m.terminating}
            # Only replicas the fleet already has terminate (desired_set), so the
            # drain comes before anything else: not one new request reaches them.
            for replica_id in sorted(terminating - self._draining):
                await fleet.set_draining(replica_id, True)
                self._draining.add(replica_id)
            if configs != self._applied:
                diff = await fleet.set_replicas(tuple(configs.values()))
                self._applied = configs
                log.info(
                    "discovery: %d added, %d removed, %d changed; %d replicas (%d draining)",
                    len(diff["added"]),
                    len(diff["removed"]),
                    len(diff["changed"]),
                    len(configs),
                    len(terminating),
                )
            # A replica we drained that serves again (or is gone) is ours no more to hold out.
            for replica_id in sorted(self._draining - terminating):
                if replica_id in configs:
                    await fleet.set_draining(replica_id, False)
                self._draining.discard(replica_id)

    def snapshot(self) -> tuple[ReplicaConfig, ...]:
        """The set as this source last applied it."""
        return tuple(self._applied.values())


class _DiscoveryCollector(Collector):
    """Read fresh at each scrape."""

    def __init__(self, source: KubernetesSource) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "router_discovery_stale_seconds",
            "Seconds since the replica set from Kubernetes was last known current: 0 while every watch is up; "
            "grows while the API server cannot be read (EndpointSlices or Pods) and the last known set is kept.",
            value=self.source.stale_seconds(),
        )
        relists = CounterMetricFamily(
            "router_discovery_relists",
            "Lists of the EndpointSlices (and Pods, with selector_on = pods), by resource and why: "
            "start, watch_ended, expired (410 Gone), error.",
            labels=["resource", "reason"],
        )
        for resource, by_reason in self.source.relists_of().items():
            for reason, count in by_reason.items():
                relists.add_metric([resource, reason], count)
        yield relists
