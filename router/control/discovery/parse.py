"""EndpointSlices and Pods to replicas: objects in, replicas or a verdict out.

Pure: no I/O, no event loop, no clock. The JSON the API server serves goes
in as it was decoded (dicts, lists, scalars); what comes out is what the
router reads of it, or `MalformedObject` naming the first field that is not
shaped as the API reference shapes it. Nothing else is raised, whatever
the input (a property test holds it to that). The watch loop (`watch.py`)
and the source (`source.py`) only carry objects here and apply the result.

An endpoint of a selected EndpointSlice (`discovery.k8s.io/v1`) becomes:

    conditions.ready and serving (nil: true),       a ready replica
    not terminating
    serving (nil: true) and terminating              draining: its requests in
                                                     flight finish, no new ones
    anything else                                    not in the set

Serving is asked of a ready endpoint too: under a Service with
`publishNotReadyAddresses` every endpoint is `ready` (discovery/v1's types:
"ready ... can be overridden ... such as when the associated Service has set
the publishNotReadyAddresses flag"), and only `serving` still says whether
the pod's own readiness passed: an engine loading its weights would be sent
requests it cannot answer.

The replica's id is `namespace/pod` (stable across router restarts), its
model the slice's `model_label` (Kubernetes copies a Service's labels onto
its slices), its URL `http://address:port`.

With `selector_on = "pods"` a replica is an endpoint whose targetRef names
a selected pod (`join_pods`); its model is the pod's `model_label`, else
the slice's; `labels_from` reads the pod's labels, then the slice's; its
node is the pod's spec.nodeName (else the endpoint's nodeName) and its
fabric the pod's `fabric_label`. In either mode an endpoint's nodeName is
its replica's node.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from router.core.config.engines import ENGINES
from router.core.config.settings import KubernetesDiscovery, ReplicaConfig

# An address as it may stand in a URL's host unbracketed: an IPv4 address
# (leading zeros and all, as old clusters hold them) or a DNS name (the
# deprecated FQDN address type). Anything else would make a URL that points
# somewhere other than the endpoint, or none at all.
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_EMPTY: Mapping[str, object] = MappingProxyType({})


class MalformedObject(ValueError):
    """An object, list or watch event not shaped as the API serves it; the message names the field."""


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
    # The node that hosts it (discovery/v1's Endpoint.nodeName); None: not said.
    node: str | None = None


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
    # The `engine_label` value, when it names an engine the router reads; else None.
    engine: str | None = None


@dataclass(frozen=True, slots=True)
class PodRead:
    """What the router reads of one Pod (selector_on = "pods"): its labels, nothing of its status."""

    # The `model_label` value; None when the pod has none (its slice's then).
    model: str | None
    labels: Mapping[str, str]
    # The `engine_label` value, when it names an engine the router reads; None: the slice's then.
    engine: str | None = None
    # Its spec.nodeName (None: not scheduled yet, or not said), and its `fabric_label` value.
    node: str | None = None
    fabric: str | None = None


@dataclass(frozen=True, slots=True)
class ListRead:
    """A list's objects by name, and the resourceVersion to watch from."""

    items: tuple[tuple[str, Mapping[str, object]], ...]
    version: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One event of a watch stream."""

    # ADDED, MODIFIED, DELETED, BOOKMARK, or a type this router does not know.
    type: str
    obj: Mapping[str, object]
    # The object's name; None for a bookmark or an unknown type (which name none).
    name: str | None
    # The resourceVersion the event brings the view up to, when it carries one.
    version: str | None


# The JSON's shapes. The API omits empty fields, so null and absent read as empty.


def _object(value: object, where: str) -> Mapping[str, object]:
    if value is None:
        return _EMPTY
    if not isinstance(value, dict):
        raise MalformedObject(f"{where} is not an object")
    return value


def _array(value: object, where: str) -> list[object]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedObject(f"{where} is not an array")
    return value


def _text(value: object, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedObject(f"{where} is not a string")


def _flag(value: object, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise MalformedObject(f"{where} is not a boolean")


def object_name(obj: object, kind: str) -> str:
    """`metadata.name` of an object the API serves: every object has one."""
    name = _object(_object(obj, f"a {kind}").get("metadata"), f"a {kind}'s metadata").get("name")
    if not isinstance(name, str) or not name:
        raise MalformedObject(f"a {kind} has no metadata.name")
    return name


def _model_and_labels(
    labels_value: object, settings: KubernetesDiscovery, where: str
) -> tuple[str | None, Mapping[str, str], str | None]:
    """The model label's value, the `labels_from` labels, and the engine the engine label names."""
    labels = _object(labels_value, f"{where}: metadata.labels")
    model = _text(labels.get(settings.model_label), f"{where}: label {settings.model_label}")
    copied = {}
    for key in settings.labels_from:
        value = _text(labels.get(key), f"{where}: label {key}")
        if value is not None:
            copied[key] = value
    # An engine the router does not read is as no label: the replica's /v1/models and /metrics say.
    engine = labels.get(settings.engine_label)
    return (model or None), MappingProxyType(copied), (engine if engine in ENGINES else None)


def _host(value: object, ipv6: bool, where: str) -> str:
    """The address as a URL's host; MalformedObject for one that is not an address of the slice's type."""
    if not isinstance(value, str):
        raise MalformedObject(f"{where} is not a string")
    if ipv6:
        # A zone (fe80::1%eth0) would need escaping in a URL, and no pod address has one.
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            raise MalformedObject(f"{where}: {value!r} is not an IPv6 address") from None
        if "%" in value:
            raise MalformedObject(f"{where}: {value!r} is not an IPv6 address") from None
        return f"[{value}]"
    if not _HOST.fullmatch(value):
        raise MalformedObject(f"{where}: {value!r} is not an IPv4 address or a host name")
    return value


def _endpoint(raw: object, ipv6: bool, namespace: str, where: str) -> SliceEndpoint | None:
    """One endpoint of a slice; None when it may not serve (not ready, or terminating and not serving)."""
    endpoint = _object(raw, where)
    addresses = _array(endpoint.get("addresses"), f"{where}.addresses")
    if not addresses:
        return None
    conditions = _object(endpoint.get("conditions"), f"{where}.conditions")
    # The API reference: ready and serving nil mean true, terminating nil means false.
    terminating = _flag(conditions.get("terminating"), f"{where}.conditions.terminating") is True
    serving = _flag(conditions.get("serving"), f"{where}.conditions.serving")
    ready = _flag(conditions.get("ready"), f"{where}.conditions.ready")
    if (serving if terminating else ready) is False or serving is False:
        return None
    address = addresses[0]
    host = _host(address, ipv6, f"{where}.addresses[0]")
    target = _object(endpoint.get("targetRef"), f"{where}.targetRef")
    target_kind = _text(target.get("kind"), f"{where}.targetRef.kind")
    target_name = _text(target.get("name"), f"{where}.targetRef.name")
    target_namespace = _text(target.get("namespace"), f"{where}.targetRef.namespace")
    pod: tuple[str, str] | None = None
    if target_kind == "Pod" and target_name:
        pod = (target_namespace or namespace, target_name)
    replica_id = f"{pod[0]}/{pod[1]}" if pod is not None else f"{namespace}/{address}"
    node = _text(endpoint.get("nodeName"), f"{where}.nodeName") or None
    return SliceEndpoint(replica_id, pod, host, terminating, node)


def _port(value: object, wanted: str | int, where: str) -> int | None:
    if isinstance(wanted, int):
        return wanted
    for index, raw in enumerate(_array(value, f"{where}: ports")):
        entry = _object(raw, f"{where}: ports[{index}]")
        # The one unnamed port of a Service has the name "" (or none: the field is omitempty).
        name = entry.get("name")
        if (name if name is not None else "") != wanted:
            continue
        number = entry.get("port")
        if number is None:
            # An unrestricted port: no number to put in a URL; another entry may still have one.
            continue
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            raise MalformedObject(f"{where}: ports[{index}].port is not a port number (1-65535)")
        return number
    return None


def parse_slice(obj: object, settings: KubernetesDiscovery, namespace: str) -> SliceRead:
    """One EndpointSlice as the API serves it (JSON field names)."""
    body = _object(obj, "an EndpointSlice")
    metadata = _object(body.get("metadata"), "an EndpointSlice's metadata")
    name = metadata.get("name")
    where = f"EndpointSlice {name}" if isinstance(name, str) else "an EndpointSlice"
    model, copied, engine = _model_and_labels(metadata.get("labels"), settings, where)
    ipv6 = body.get("addressType") == "IPv6"
    endpoints = []
    for index, raw in enumerate(_array(body.get("endpoints"), f"{where}: endpoints")):
        endpoint = _endpoint(raw, ipv6, namespace, f"{where}: endpoints[{index}]")
        if endpoint is not None:
            endpoints.append(endpoint)
    return SliceRead(model, copied, _port(body.get("ports"), settings.port, where), tuple(endpoints), engine)


def slice_members(read: SliceRead, settings: KubernetesDiscovery) -> SliceView:
    """The replicas of a slice that `selector` matched (selector_on = "endpointslices")."""
    if read.model is None:
        return SliceView((), f"has no label {settings.model_label} naming its model")
    if read.port is None:
        return SliceView((), f"has no port named {settings.port!r}")
    return SliceView(
        tuple(
            Member(
                ReplicaConfig(
                    e.replica_id, read.model, f"http://{e.host}:{read.port}", read.labels, read.engine, node=e.node
                ),
                e.terminating,
            )
            for e in read.endpoints
        )
    )


def read_slice(obj: object, settings: KubernetesDiscovery, namespace: str) -> SliceView:
    """The replicas of one EndpointSlice that `selector` matched, as the API serves it."""
    return slice_members(parse_slice(obj, settings, namespace), settings)


def read_pod(obj: object, settings: KubernetesDiscovery) -> PodRead:
    """One Pod as the API serves it: the labels that name its model and those `labels_from` copies."""
    metadata = _object(_object(obj, "a Pod").get("metadata"), "a Pod's metadata")
    name = metadata.get("name")
    where = f"Pod {name}" if isinstance(name, str) else "a Pod"
    model, copied, engine = _model_and_labels(metadata.get("labels"), settings, where)
    spec = _object(_object(obj, "a Pod").get("spec"), f"{where}: spec")
    node = _text(spec.get("nodeName"), f"{where}: spec.nodeName") or None
    fabric = None
    if settings.fabric_label is not None:
        labels = _object(metadata.get("labels"), f"{where}: metadata.labels")
        fabric = _text(labels.get(settings.fabric_label), f"{where}: label {settings.fabric_label}") or None
    return PodRead(model, copied, engine, node, fabric)


def read_list(doc: object, kind: str) -> ListRead:
    """A list's body (EndpointSliceList, PodList): its objects, each with a name, and its resourceVersion.

    A body that is no list (null, or one without a resourceVersion) is
    malformed before anything of it is applied: read as an empty list, it
    would take every replica out of the set.
    """
    if not isinstance(doc, dict):
        raise MalformedObject(f"the {kind} list is not an object")
    body: Mapping[str, object] = doc
    items = []
    for index, item in enumerate(_array(body.get("items"), f"the {kind} list's items")):
        items.append((object_name(item, kind), _object(item, f"the {kind} list's items[{index}]")))
    version = _object(body.get("metadata"), f"the {kind} list's metadata").get("resourceVersion")
    if not isinstance(version, str) or not version:
        raise MalformedObject(f"the {kind} list carries no resourceVersion")
    return ListRead(tuple(items), version)


def read_event(event: object, kind: str) -> WatchEvent:
    """One watch event as kubernetes_asyncio yields it: the type, and the object's JSON as `raw_object`."""
    body = _object(event, "a watch event")
    event_type = body.get("type")
    if not isinstance(event_type, str):
        raise MalformedObject(f"a {kind} watch event has no type")
    obj = _object(body.get("raw_object"), f"a {kind} watch event's object")
    metadata = _object(obj.get("metadata"), f"a {kind} watch event's metadata")
    version = metadata.get("resourceVersion")
    name = object_name(obj, kind) if event_type in ("ADDED", "MODIFIED", "DELETED") else None
    return WatchEvent(event_type, obj, name, version if isinstance(version, str) else None)


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
            url = f"http://{endpoint.host}:{read.port}"
            config = ReplicaConfig(
                endpoint.replica_id,
                model,
                url,
                labels,
                pod.engine or read.engine,
                node=pod.node or endpoint.node,
                fabric=pod.fabric,
            )
            members.append(Member(config, endpoint.terminating))
            served.add(endpoint.replica_id)
        if members:
            views[name] = SliceView(tuple(members))
    return views, {pod: why for pod, why in problems.items() if pod not in served}


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
