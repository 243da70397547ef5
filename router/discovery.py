"""Kubernetes discovery: the replica set from EndpointSlices, right through every watch failure.

The loop is list, apply, watch from the list's resourceVersion (with
bookmarks), apply each event; and on *any* end of the watch (its timeout,
a close, an error, 410 Gone) list again and replace the whole view. A watch
can miss events (a DELETED sent while it was down is never replayed to a
watch that restarts from a newer version), so only a fresh list proves the
set; routers that trusted the watch routed to deleted pods for days.

An endpoint of a selected EndpointSlice (`discovery.k8s.io/v1`) becomes:

    conditions.ready (nil: true), not terminating   a ready replica
    serving (nil: true) and terminating              draining: its requests in
                                                     flight finish, no new ones
    anything else                                    not in the set

The replica's id is `namespace/pod` (stable across router restarts), its
model the slice's `model_label` (Kubernetes copies a Service's labels onto
its slices), its URL `http://address:port`. While the API server cannot be
reached the last known set is kept, whatever the outage's length: a router
never drops replicas because the API is down. It says so instead: the gauge
`router_discovery_stale_seconds` and a log line a minute.

The Kubernetes client is kubernetes_asyncio (on aiohttp, like the rest of
the router): it reads kubeconfigs and service accounts, builds the requests
and splits the watch stream into events. Errors of this module: the
library's `ApiException`, aiohttp's `ClientError`, `OSError` and
`TimeoutError` from the network, and `FleetUnavailable` from a fleet that
could not apply a change; each ends one list-and-watch cycle and the next
one starts after a capped backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.config import KubernetesDiscovery, ReplicaConfig
from router.errors import ConfigError
from router.fleet import Fleet, FleetUnavailable

log = logging.getLogger("router.discovery")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Why a list-and-watch cycle began again: the first list, a watch that ended
# (its timeout, or the server closed it), 410 Gone, an error.
RELIST_REASONS = ("start", "watch_ended", "expired", "error")


@dataclass(frozen=True, slots=True)
class ApiAccess:
    """How to reach the API server, resolved once at start."""

    # None: in a cluster, with the pod's service account.
    kubeconfig: str | None
    namespace: str

    def describe(self) -> str:
        where = "the pod's service account" if self.kubeconfig is None else f"kubeconfig {self.kubeconfig}"
        return f"namespace {self.namespace} via {where}"


def resolve_access(
    settings: KubernetesDiscovery, environ: Mapping[str, str], service_account: Path = SERVICE_ACCOUNT
) -> ApiAccess:
    """In a cluster its service account; else `kubeconfig`, $KUBECONFIG, ~/.kube/config. ConfigError if none."""
    key = "discovery.kubernetes"
    in_cluster = bool(environ.get("KUBERNETES_SERVICE_HOST")) and (service_account / "token").is_file()
    path: str | None = None
    if settings.kubeconfig is not None:
        path = os.path.expanduser(settings.kubeconfig)
        if not Path(path).is_file():
            raise ConfigError(f"{key}.kubeconfig: no such file: {settings.kubeconfig}")
    elif not in_cluster:
        candidates = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        home = environ.get("HOME")
        if not candidates and home:
            candidates = [os.path.join(home, ".kube", "config")]
        path = next((p for p in candidates if Path(p).is_file()), None)
        if path is None:
            raise ConfigError(
                f"{key}: no Kubernetes API to ask: not in a cluster (no KUBERNETES_SERVICE_HOST and service "
                f"account token), no kubeconfig key, and no file in $KUBECONFIG or ~/.kube/config"
            )
    namespace = settings.namespace
    if namespace is None:
        namespace = _own_namespace(path, service_account)
    return ApiAccess(kubeconfig=path, namespace=namespace)


def _own_namespace(kubeconfig: str | None, service_account: Path) -> str:
    """The pod's own namespace in a cluster; the kubeconfig context's out of one; else "default"."""
    if kubeconfig is None:
        try:
            return (service_account / "namespace").read_text().strip() or "default"
        except OSError:
            return "default"
    try:
        _, current = k8s_config.list_kube_config_contexts(kubeconfig)
    except (ConfigException, OSError, ValueError) as exc:
        raise ConfigError(f"discovery.kubernetes.kubeconfig: {kubeconfig}: {exc}") from exc
    context = (current or {}).get("context") or {}
    namespace = context.get("namespace") if isinstance(context, dict) else None
    return namespace if isinstance(namespace, str) and namespace else "default"


# EndpointSlices to replicas (pure) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    """One replica an EndpointSlice holds."""

    config: ReplicaConfig
    # Serving but terminating: drains, never takes a new request.
    terminating: bool


@dataclass(frozen=True, slots=True)
class SliceView:
    """What one EndpointSlice says; `problem` when it holds no replica for a reason worth a warning."""

    members: tuple[Member, ...]
    problem: str | None = None


def read_slice(obj: Mapping[str, Any], settings: KubernetesDiscovery, namespace: str) -> SliceView:
    """The replicas of one EndpointSlice, as the API serves it (JSON field names)."""
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    model = labels.get(settings.model_label)
    if not isinstance(model, str) or not model:
        return SliceView((), f"has no label {settings.model_label} naming its model")
    port = _port(obj.get("ports") or [], settings.port)
    if port is None:
        return SliceView((), f"has no port named {settings.port!r}")
    copied = MappingProxyType({k: labels[k] for k in settings.labels_from if isinstance(labels.get(k), str)})
    members = []
    for endpoint in obj.get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        conditions = endpoint.get("conditions") or {}
        # The API reference: ready and serving nil mean true, terminating nil means false.
        terminating = conditions.get("terminating") is True
        if terminating:
            if conditions.get("serving") is False:
                continue
        elif conditions.get("ready") is False:
            continue
        host = addresses[0]
        url = f"http://[{host}]:{port}" if obj.get("addressType") == "IPv6" else f"http://{host}:{port}"
        target = endpoint.get("targetRef") or {}
        if target.get("kind") == "Pod" and target.get("name"):
            replica_id = f"{target.get('namespace') or namespace}/{target['name']}"
        else:
            replica_id = f"{namespace}/{host}"
        members.append(Member(ReplicaConfig(id=replica_id, model=model, url=url, labels=copied), terminating))
    return SliceView(tuple(members))


def _port(ports: list[Any], wanted: str | int) -> int | None:
    if isinstance(wanted, int):
        return wanted
    for entry in ports:
        number = entry.get("port")
        if entry.get("name") == wanted and isinstance(number, int):
            return number
    return None


def desired_set(slices: Mapping[str, SliceView], current: Mapping[str, ReplicaConfig]) -> dict[str, Member]:
    """The set the slices say, given the set the router has now.

    A pod may be in two slices at once (the controller moving it, or a
    label change moving it between models' Services): serving beats
    terminating, then what the router already has (no flapping), then the
    first slice by name. A terminating endpoint stays only if the router
    already has that replica: it is there so that its requests in flight can
    finish; one first seen terminating has nothing of ours to finish.
    """
    chosen: dict[str, Member] = {}
    for name in sorted(slices):
        for member in slices[name].members:
            replica_id = member.config.id
            have = chosen.get(replica_id)
            if have is None or _better(member, have, current.get(replica_id)):
                chosen[replica_id] = member
    out = {}
    for replica_id, member in chosen.items():
        if member.terminating:
            now = current.get(replica_id)
            if now is None or (now.url, now.model) != (member.config.url, member.config.model):
                continue
        out[replica_id] = member
    return out


def _better(member: Member, have: Member, current: ReplicaConfig | None) -> bool:
    if member.terminating != have.terminating:
        return have.terminating
    return current is not None and member.config == current and have.config != current


# The source ---------------------------------------------------------------------


class Gone(Exception):
    """410 Gone: the watch's resourceVersion is too old; only a new list can go on."""


def _api_problem(exc: ApiException) -> str:
    """One line from the API server's Status body, if it sent one."""
    message = exc.reason or ""
    body = exc.body
    if body:
        try:
            status = orjson.loads(body)
        except orjson.JSONDecodeError:
            status = None
        if isinstance(status, dict) and isinstance(status.get("message"), str):
            message = status["message"]
    return f"HTTP {exc.status}: {message}".strip()


async def _read_list(response: object, kind: str) -> dict[str, Any]:
    """A list's JSON; ApiException with the API server's Status for an answer that is not 2xx."""
    # With _preload_content=False the library hands over aiohttp's response
    # (its stubs do not say so) and leaves the status to us.
    if not isinstance(response, aiohttp.ClientResponse):
        raise TypeError(f"the {kind} list came back as {type(response).__name__}, not an HTTP response")
    async with response:
        body = await response.read()
    if not 200 <= response.status <= 299:
        error = ApiException(status=response.status, reason=response.reason)
        error.body = body
        raise error
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiException(status=response.status, reason=f"the {kind} list is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ApiException(status=response.status, reason=f"the {kind} list is not a JSON object")
    return doc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return _api_problem(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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
        self._rng = rng or random.Random()
        self.backoff_first = backoff_first
        self.backoff_cap = backoff_cap
        self.watch_seconds = watch_seconds
        self.min_watch_seconds = min_watch_seconds
        self.report_every = report_every
        self._slices: dict[str, SliceView] = {}
        # What the fleet has from us: the configs, and the ids we drained for terminating.
        self._applied: dict[str, ReplicaConfig] = {}
        self._draining: set[str] = set()
        self._warned: dict[str, str] = {}
        self._started = mono()
        self._synced = False
        self._ever_synced = False
        # Monotonic time the set was last known to match the API server's.
        self._confirmed: float | None = None
        self._lost_at: float | None = None
        self._reported_at = 0.0
        self.relists = dict.fromkeys(RELIST_REASONS, 0)
        self._api: k8s.DiscoveryV1Api | None = None
        self._client: k8s.ApiClient | None = None

    # ReplicaSource ------------------------------------------------------------

    def initial(self) -> tuple[ReplicaConfig, ...]:
        # Nothing is known before the first list; readiness waits for it.
        return ()

    def ready(self) -> bool:
        """Ready once the first list is applied, and from then on, the API server reachable or not."""
        return self._ever_synced

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_DiscoveryCollector(self))

    async def reload(self, fleet: Fleet) -> bool:
        log.info("SIGHUP: the replica set comes from the Kubernetes API and is kept current; nothing to reload")
        return True

    async def run(self, fleet: Fleet) -> None:
        """List and watch until cancelled; every cycle ends in a new list."""
        log.info(
            "discovering replicas from EndpointSlices matching %r in %s", self.settings.selector, self.access.describe()
        )
        reason = "start"
        failures = 0
        try:
            while True:
                self.relists[reason] += 1
                # When the watch began, once it has: how long it lasted decides the pause.
                began: float | None = None
                try:
                    api = self._api if self._api is not None else await self._connect()
                    version = await self._list(api, fleet)
                    began = self._mono()
                    await self._watch(api, fleet, version)
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
                except (ApiException, aiohttp.ClientError, OSError, TimeoutError, ConfigException) as exc:
                    reason, began = "error", None
                    failures += 1
                    self._lost(exc)
                except Exception as exc:
                    # The root of a background task: a bug here must not end discovery.
                    log.exception("discovery cycle failed unexpectedly; listing again")
                    reason, began = "error", None
                    failures += 1
                    self._lost(exc)
                if began is not None:
                    if self._mono() - began >= self.min_watch_seconds:
                        failures = 0
                        continue
                    # A server that ends every watch at once is not asked in a tight loop.
                    failures += 1
                await asyncio.sleep(self._backoff(failures))
        finally:
            if self._client is not None:
                await self._client.close()
                self._client = self._api = None

    # Staleness ------------------------------------------------------------------

    def stale_seconds(self) -> float:
        """0 while the set is known current; else how long since it last was (or since start)."""
        if self._synced:
            return 0.0
        since = self._confirmed if self._confirmed is not None else self._started
        return max(0.0, self._mono() - since)

    def _confirm(self) -> None:
        now = self._mono()
        self._confirmed = now
        if not self._synced and self._lost_at is not None:
            log.info(
                "EndpointSlices readable again after %.0f s; the replica set is listed afresh (%d replicas)",
                now - self._lost_at,
                len(self._applied),
            )
            self._lost_at = None
        self._synced = True
        self._ever_synced = True

    def _lost(self, exc: BaseException) -> None:
        now = self._mono()
        self._synced = False
        kept = len(self._applied)
        if self._lost_at is None:
            self._lost_at = now
            self._reported_at = now
            log.warning(
                "cannot read EndpointSlices from the Kubernetes API (%s); keeping the last known set of %d replicas",
                _describe(exc),
                kept,
            )
        elif now - self._reported_at >= self.report_every:
            self._reported_at = now
            log.warning(
                "still cannot read EndpointSlices after %.0f s (%s); keeping the last known set of %d replicas, "
                "stale for %.0f s",
                now - self._lost_at,
                _describe(exc),
                kept,
                self.stale_seconds(),
            )

    def _backoff(self, failures: int) -> float:
        if failures == 0:
            return 0.0
        delay = min(self.backoff_cap, self.backoff_first * 2.0 ** min(failures - 1, 30))
        # Many routers restarted together must not retry in step.
        return delay * self._rng.uniform(0.8, 1.0)

    # List and watch ---------------------------------------------------------------

    async def _connect(self) -> k8s.DiscoveryV1Api:
        configuration = k8s.Configuration()
        if self.access.kubeconfig is None:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            await k8s_config.load_kube_config(
                config_file=self.access.kubeconfig, client_configuration=configuration, persist_config=False
            )
        self._client = k8s.ApiClient(configuration=configuration)
        self._api = k8s.DiscoveryV1Api(self._client)
        return self._api

    async def _list(self, api: k8s.DiscoveryV1Api, fleet: Fleet) -> str:
        """List every selected slice, replace the view with it, apply; the list's resourceVersion."""
        # Read raw: the library's models cost the event loop (which serves the
        # requests too) some 0.8 s for a list of 1,000 pods, against 0.02 s for
        # orjson, and the router reads a few fields of the JSON anyway.
        response = await api.list_namespaced_endpoint_slice(
            self.access.namespace,
            label_selector=self.settings.selector,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=60, sock_connect=10),
        )
        doc = await _read_list(response, "EndpointSlice")
        self._slices = {item["metadata"]["name"]: self._read(item) for item in doc.get("items") or []}
        await self._apply(fleet)
        self._confirm()
        version = doc.get("metadata", {}).get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise ApiException(status=0, reason="the EndpointSlice list carries no resourceVersion")
        return version

    async def _watch(self, api: k8s.DiscoveryV1Api, fleet: Fleet, version: str) -> None:
        """Apply each event from `version` on until the watch ends; raise Gone on 410."""
        seconds = self._rng.uniform(self.watch_seconds, 2 * self.watch_seconds)
        # "object": each event's JSON as is, not the library's models (see _list).
        async with k8s_watch.Watch(return_type="object") as watch:
            stream = watch.stream(
                api.list_namespaced_endpoint_slice,
                self.access.namespace,
                label_selector=self.settings.selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(seconds)),
                # The server ends the watch; this is for one that went silent (a partition).
                _request_timeout=aiohttp.ClientTimeout(total=seconds + 30, sock_connect=10),
            )
            try:
                async for event in stream:
                    await self._event(event, fleet)
            except ApiException as exc:
                if exc.status == 410:
                    raise Gone(_api_problem(exc)) from exc
                raise

    async def _event(self, event: Mapping[str, Any], fleet: Fleet) -> None:
        kind = event.get("type")
        obj = event.get("raw_object") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._slices[obj["metadata"]["name"]] = self._read(obj)
        elif kind == "DELETED":
            name = obj["metadata"]["name"]
            self._slices.pop(name, None)
            self._warned.pop(name, None)
        elif kind != "BOOKMARK":
            log.warning("ignored a watch event of unknown type %r", kind)
            return
        await self._apply(fleet)
        self._confirm()

    def _read(self, obj: Mapping[str, Any]) -> SliceView:
        view = read_slice(obj, self.settings, self.access.namespace)
        name = str(obj["metadata"]["name"])
        if view.problem is None:
            self._warned.pop(name, None)
        elif self._warned.get(name) != view.problem:
            self._warned[name] = view.problem
            log.warning(
                "EndpointSlice %s/%s %s; its endpoints are not replicas", self.access.namespace, name, view.problem
            )
        return view

    # Applying ---------------------------------------------------------------------

    async def _apply(self, fleet: Fleet) -> None:
        """Make the fleet's set the slices' set: drain what terminates, then the whole set at once."""
        members = desired_set(self._slices, self._applied)
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
            "Seconds since the replica set from Kubernetes was last known current: 0 while the watch is up; "
            "grows while the API server cannot be reached and the last known set is kept.",
            value=self.source.stale_seconds(),
        )
        relists = CounterMetricFamily(
            "router_discovery_relists",
            "Lists of the EndpointSlices, by why: start, watch_ended, expired (410 Gone), error.",
            labels=["reason"],
        )
        for reason, count in self.source.relists.items():
            relists.add_metric([reason], count)
        yield relists
