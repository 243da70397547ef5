"""Kubernetes discovery: the replica set from EndpointSlices (and Pods), right through every watch failure.

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
its slices), its URL `http://address:port`.

With `selector_on = "pods"` the selector picks pods instead: Pods are
listed and watched with it, and the EndpointSlices of the whole namespace
without one, each by the same cycle, each into its own view. A replica is
an endpoint (as above) whose targetRef names a selected pod; its model is
the pod's `model_label`, else the slice's; `labels_from` reads the pod's
labels, then the slice's. The set is recomputed from both current views at
every change of either, so a pod event before its slice's or after it ends
in the same set. The default mode reads no pod: that would need RBAC on
pods, which an operator of that mode has not granted.

While the API server cannot be reached the last known set is kept,
whatever the outage's length: a router never drops replicas because the API
is down. It says so instead: the gauge `router_discovery_stale_seconds`
(stale while either read fails) and a log line a minute.

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
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

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

from router.control.fleet import Fleet, FleetUnavailable
from router.core.config import KubernetesDiscovery, ReplicaConfig
from router.core.errors import ConfigError

log = logging.getLogger("router.control.discovery")

T = TypeVar("T")

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


# EndpointSlices (and Pods) to replicas (pure) ------------------------------------


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


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    """An endpoint of a slice that may serve: ready, or serving while it terminates."""

    # namespace/pod, or namespace/address for an endpoint that names no pod.
    replica_id: str
    # The targetRef's (namespace, name) when it is a Pod: only those join Pods.
    pod: tuple[str, str] | None
    # As it goes in a URL: an IPv6 address in brackets.
    host: str
    terminating: bool


@dataclass(frozen=True, slots=True)
class SliceRead:
    """What the router reads of one EndpointSlice, whatever selects it."""

    # The `model_label` value; None when the slice has none.
    model: str | None
    # Its `labels_from` labels.
    labels: Mapping[str, str]
    # The `port` (a name looked up among the slice's ports); None when it has no such port.
    port: int | None
    endpoints: tuple[SliceEndpoint, ...]


@dataclass(frozen=True, slots=True)
class PodRead:
    """What the router reads of one Pod (selector_on = "pods"): its labels, nothing of its status."""

    # The `model_label` value; None when the pod has none (its slice's then).
    model: str | None
    labels: Mapping[str, str]


def _model_and_labels(labels: Mapping[str, Any], settings: KubernetesDiscovery) -> tuple[str | None, Mapping[str, str]]:
    model = labels.get(settings.model_label)
    copied = MappingProxyType({k: labels[k] for k in settings.labels_from if isinstance(labels.get(k), str)})
    return (model if isinstance(model, str) and model else None), copied


def parse_slice(obj: Mapping[str, Any], settings: KubernetesDiscovery, namespace: str) -> SliceRead:
    """One EndpointSlice as the API serves it (JSON field names)."""
    metadata = obj.get("metadata") or {}
    model, copied = _model_and_labels(metadata.get("labels") or {}, settings)
    ipv6 = obj.get("addressType") == "IPv6"
    endpoints = []
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
        address = addresses[0]
        target = endpoint.get("targetRef") or {}
        pod: tuple[str, str] | None = None
        if target.get("kind") == "Pod" and target.get("name"):
            pod = (target.get("namespace") or namespace, target["name"])
        replica_id = f"{pod[0]}/{pod[1]}" if pod is not None else f"{namespace}/{address}"
        endpoints.append(SliceEndpoint(replica_id, pod, f"[{address}]" if ipv6 else address, terminating))
    return SliceRead(model, copied, _port(obj.get("ports") or [], settings.port), tuple(endpoints))


def slice_members(read: SliceRead, settings: KubernetesDiscovery) -> SliceView:
    """The replicas of a slice that `selector` matched (selector_on = "endpointslices")."""
    if read.model is None:
        return SliceView((), f"has no label {settings.model_label} naming its model")
    if read.port is None:
        return SliceView((), f"has no port named {settings.port!r}")
    return SliceView(
        tuple(
            Member(ReplicaConfig(e.replica_id, read.model, f"http://{e.host}:{read.port}", read.labels), e.terminating)
            for e in read.endpoints
        )
    )


def read_slice(obj: Mapping[str, Any], settings: KubernetesDiscovery, namespace: str) -> SliceView:
    """The replicas of one EndpointSlice that `selector` matched, as the API serves it."""
    return slice_members(parse_slice(obj, settings, namespace), settings)


def read_pod(obj: Mapping[str, Any], settings: KubernetesDiscovery) -> PodRead:
    """One Pod as the API serves it: the labels that name its model and those `labels_from` copies."""
    model, copied = _model_and_labels((obj.get("metadata") or {}).get("labels") or {}, settings)
    return PodRead(model, copied)


def join_pods(
    slices: Mapping[str, SliceRead], pods: Mapping[str, PodRead], settings: KubernetesDiscovery, namespace: str
) -> tuple[dict[str, SliceView], dict[str, str]]:
    """The replicas of the selected pods (selector_on = "pods"): each endpoint whose pod `selector` matched.

    `pods` are those of `namespace`, by name. The model is the
    pod's label, else the slice's; labels are the pod's, then the slice's
    for keys the pod lacks; readiness is the endpoint's, as in the other
    mode. Also: why a selected pod that is in slices is no replica (a slice
    without the port, no model label anywhere), for a warning. A selected
    pod in no slice yet (a pod event before its slice's) is simply not one.
    """
    views: dict[str, SliceView] = {}
    problems: dict[str, str] = {}
    served: set[str] = set()
    for name in sorted(slices):
        read = slices[name]
        members = []
        for endpoint in read.endpoints:
            pod = pods.get(endpoint.pod[1]) if endpoint.pod is not None and endpoint.pod[0] == namespace else None
            if pod is None:
                continue
            model = pod.model or read.model
            if read.port is None:
                problems.setdefault(
                    endpoint.replica_id, f"is in EndpointSlice {name}, which has no port named {settings.port!r}"
                )
                continue
            if model is None:
                problems.setdefault(
                    endpoint.replica_id,
                    f"has no label {settings.model_label} naming its model, nor has its EndpointSlice {name}",
                )
                continue
            labels = MappingProxyType({**read.labels, **pod.labels})
            config = ReplicaConfig(endpoint.replica_id, model, f"http://{endpoint.host}:{read.port}", labels)
            members.append(Member(config, endpoint.terminating))
            served.add(endpoint.replica_id)
        if members:
            views[name] = SliceView(tuple(members))
    return views, {pod: why for pod, why in problems.items() if pod not in served}


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


class _Watched(Generic[T]):
    """One kind of object listed and watched, what the router read of each, and whether that is current."""

    def __init__(
        self,
        kind: str,
        plural: str,
        selector: str | None,
        read: Callable[[Mapping[str, Any]], T],
        lister: Callable[[k8s.ApiClient], Callable[..., Awaitable[object]]],
    ) -> None:
        # "EndpointSlice", "Pod": for log lines; the plural is the metric label and RBAC's name.
        self.kind = kind
        self.plural = plural
        # None: every object of the namespace.
        self.selector = selector
        self.read = read
        # The library's list function (list_namespaced_...), which watches too.
        self.lister = lister
        self.objects: dict[str, T] = {}
        # Listed at least once: the join waits for every kind (a half-listed view is not the set).
        self.listed = False
        self.synced = False
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
        self.on_pods = settings.selector_on == "pods"
        # With selector_on = "pods" the selector picks pods, and the slices of the
        # whole namespace say which of them serve, where and how (their conditions).
        self._slices: _Watched[SliceRead] = _Watched(
            "EndpointSlice",
            "endpointslices",
            None if self.on_pods else settings.selector,
            self._read_slice,
            lambda client: k8s.DiscoveryV1Api(client).list_namespaced_endpoint_slice,
        )
        self._pods: _Watched[PodRead] | None = None
        self._watched: list[_Watched[Any]] = [self._slices]
        if self.on_pods:
            self._pods = _Watched(
                "Pod",
                "pods",
                settings.selector,
                lambda obj: read_pod(obj, settings),
                lambda client: k8s.CoreV1Api(client).list_namespaced_pod,
            )
            self._watched.append(self._pods)
        # What the fleet has from us: the configs, and the ids we drained for terminating.
        self._applied: dict[str, ReplicaConfig] = {}
        self._draining: set[str] = set()
        # (plural, name) -> the problem last warned of.
        self._warned: dict[tuple[str, str], str] = {}
        self._started = mono()
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
        try:
            async with asyncio.TaskGroup() as tasks:
                for watched in self._watched:
                    tasks.create_task(self._follow(watched, fleet))
        finally:
            if self._client is not None:
                await self._client.close()
                self._client = None

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

    async def _follow(self, watched: _Watched[Any], fleet: Fleet) -> None:
        """List and watch one kind of object until cancelled; every cycle ends in a new list."""
        reason = "start"
        failures = 0
        while True:
            watched.relists[reason] += 1
            # When the watch began, once it has: how long it lasted decides the pause.
            began: float | None = None
            try:
                lister = watched.lister(await self._connect())
                version = await self._list(watched, lister, fleet)
                began = self._mono()
                await self._watch(watched, lister, fleet, version)
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
                self._lost(watched, exc)
            except Exception as exc:
                # The root of a background task: a bug here must not end discovery.
                log.exception("discovery cycle of %s failed unexpectedly; listing again", watched.kinds)
                reason, began = "error", None
                failures += 1
                self._lost(watched, exc)
            if began is not None:
                if self._mono() - began >= self.min_watch_seconds:
                    failures = 0
                    continue
                # A server that ends every watch at once is not asked in a tight loop.
                failures += 1
            await asyncio.sleep(self._backoff(failures))

    # Staleness ------------------------------------------------------------------

    def stale_seconds(self) -> float:
        """0 while every view is known current; else how long since the stalest last was (or since start)."""
        now = self._mono()
        stale = 0.0
        for watched in self._watched:
            if not watched.synced:
                since = watched.confirmed if watched.confirmed is not None else self._started
                stale = max(stale, now - since)
        return stale

    def _confirm(self, watched: _Watched[Any]) -> None:
        now = self._mono()
        watched.confirmed = now
        if not watched.synced and watched.lost_at is not None:
            log.info(
                "%s readable again after %.0f s; listed afresh (%d replicas)",
                watched.kinds,
                now - watched.lost_at,
                len(self._applied),
            )
            watched.lost_at = None
        watched.synced = True

    def _lost(self, watched: _Watched[Any], exc: BaseException) -> None:
        now = self._mono()
        watched.synced = False
        kept = len(self._applied)
        if watched.lost_at is None:
            watched.lost_at = now
            watched.reported_at = now
            log.warning(
                "cannot read %s from the Kubernetes API (%s); keeping the last known set of %d replicas",
                watched.kinds,
                _describe(exc),
                kept,
            )
        elif now - watched.reported_at >= self.report_every:
            watched.reported_at = now
            log.warning(
                "still cannot read %s after %.0f s (%s); keeping the last known set of %d replicas, stale for %.0f s",
                watched.kinds,
                now - watched.lost_at,
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

    async def _connect(self) -> k8s.ApiClient:
        """The one client both watches share, made by whichever asks first."""
        async with self._connecting:
            if self._client is None:
                configuration = k8s.Configuration()
                if self.access.kubeconfig is None:
                    k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                else:
                    await k8s_config.load_kube_config(
                        config_file=self.access.kubeconfig, client_configuration=configuration, persist_config=False
                    )
                self._client = k8s.ApiClient(configuration=configuration)
            return self._client

    async def _list(self, watched: _Watched[Any], lister: Callable[..., Awaitable[object]], fleet: Fleet) -> str:
        """List every selected object, replace the view with them, apply; the list's resourceVersion."""
        # Read raw: the library's models cost the event loop (which serves the
        # requests too) some 0.8 s for a list of 1,000 pods, against 0.02 s for
        # orjson, and the router reads a few fields of the JSON anyway.
        response = await lister(
            self.access.namespace,
            label_selector=watched.selector,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=60, sock_connect=10),
        )
        doc = await _read_list(response, watched.kind)
        watched.objects = {item["metadata"]["name"]: watched.read(item) for item in doc.get("items") or []}
        watched.listed = True
        await self._apply(fleet)
        self._confirm(watched)
        version = doc.get("metadata", {}).get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise ApiException(status=0, reason=f"the {watched.kind} list carries no resourceVersion")
        watched.version = version
        return version

    async def _watch(
        self, watched: _Watched[Any], lister: Callable[..., Awaitable[object]], fleet: Fleet, version: str
    ) -> None:
        """Apply each event from `version` on until the watch ends; raise Gone on 410."""
        seconds = self._rng.uniform(self.watch_seconds, 2 * self.watch_seconds)
        # "object": each event's JSON as is, not the library's models (see _list).
        async with k8s_watch.Watch(return_type="object") as watch:
            stream = watch.stream(
                lister,
                self.access.namespace,
                label_selector=watched.selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(seconds)),
                # The server ends the watch; this is for one that went silent (a partition).
                _request_timeout=aiohttp.ClientTimeout(total=seconds + 30, sock_connect=10),
            )
            try:
                async for event in stream:
                    await self._event(watched, event, fleet)
            except ApiException as exc:
                if exc.status == 410:
                    raise Gone(_api_problem(exc)) from exc
                raise

    async def _event(self, watched: _Watched[Any], event: Mapping[str, Any], fleet: Fleet) -> None:
        kind = event.get("type")
        obj = event.get("raw_object") or {}
        metadata = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            name = metadata["name"]
            read = watched.read(obj)
            # Pods change status far more often than labels: most events change nothing the router reads.
            changed = watched.objects.get(name) != read
            watched.objects[name] = read
        elif kind == "DELETED":
            name = metadata["name"]
            changed = watched.objects.pop(name, None) is not None
            self._warned.pop((watched.plural, name), None)
        elif kind == "BOOKMARK":
            changed = False
        else:
            log.warning("ignored a watch event of unknown type %r", kind)
            return
        if changed:
            await self._apply(fleet)
        if isinstance(metadata.get("resourceVersion"), str):
            watched.version = metadata["resourceVersion"]
        self._confirm(watched)

    def _read_slice(self, obj: Mapping[str, Any]) -> SliceRead:
        read = parse_slice(obj, self.settings, self.access.namespace)
        if self.on_pods:
            # Every slice of the namespace: most hold no selected pod, and owe no warning (join_pods says why).
            return read
        name = str(obj["metadata"]["name"])
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

    # Applying ---------------------------------------------------------------------

    def _views(self) -> dict[str, SliceView]:
        if self._pods is None:
            return {name: slice_members(read, self.settings) for name, read in self._slices.objects.items()}
        views, problems = join_pods(self._slices.objects, self._pods.objects, self.settings, self.access.namespace)
        for key in [k for k in self._warned if k[0] == "pods" and k[1] not in problems]:
            del self._warned[key]
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
