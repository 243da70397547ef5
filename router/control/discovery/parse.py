"""EndpointSlices and Pods to replicas: objects in, replicas or a verdict out.

Pure: no I/O, no event loop, no clock. The JSON the API server serves goes
in as it was decoded (dicts, lists, scalars); what comes out is what the
router reads of it. The watch loop (`watch.py`) and the source
(`source.py`) only carry objects here and apply the result.

An endpoint of a selected EndpointSlice (`discovery.k8s.io/v1`) becomes:

    conditions.ready (nil: true), not terminating   a ready replica
    serving (nil: true) and terminating              draining: its requests in
                                                     flight finish, no new ones
    anything else                                    not in the set

The replica's id is `namespace/pod` (stable across router restarts), its
model the slice's `model_label` (Kubernetes copies a Service's labels onto
its slices), its URL `http://address:port`.

With `selector_on = "pods"` a replica is an endpoint whose targetRef names
a selected pod (`join_pods`); its model is the pod's `model_label`, else
the slice's; `labels_from` reads the pod's labels, then the slice's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from router.core.config import KubernetesDiscovery, ReplicaConfig


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
