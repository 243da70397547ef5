"""A fake Kubernetes API server for two resources: EndpointSlices (discovery.k8s.io/v1) and Pods (v1).

It speaks the protocol as the API reference describes it ("API Concepts":
efficient detection of changes, resource versions, watch bookmarks):

- `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` and
  `GET /api/v1/namespaces/{ns}/pods` list the objects matching
  `labelSelector` (all of them without one), with the collection's
  `metadata.resourceVersion`; one revision counter for both, as etcd has;
- with `watch=true` it streams one JSON object a line (chunked):
  `{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}`,
  every change of that resource after `resourceVersion`; an object whose
  labels stop (start) matching the selector is DELETED (ADDED) for that
  watch; BOOKMARK events (an object with only `metadata.resourceVersion`)
  when `allowWatchBookmarks=true`; the stream ends after `timeoutSeconds`;
- a watch from a resourceVersion older than the history kept gets an
  `ERROR` event whose object is a `Status` with code 410 (reason `Expired`),
  as the API server sends it, or, with `gone_as_status`, an HTTP 410.

And it takes faults: close every watch (or those of one resource), expire
the history (410), change state without telling the watches (an event lost
while a watch was down), refuse a resource as RBAC does (403), go down
(connections refused) and come back on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import re
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

GROUP_VERSION = "discovery.k8s.io/v1"


@dataclass(frozen=True)
class Resource:
    """A kind of object the fake API serves: its names and the path it is listed and watched under."""

    kind: str
    plural: str
    api_version: str
    # The API group RBAC names ("" is the core group).
    group: str
    path: str


ENDPOINT_SLICES = Resource(
    "EndpointSlice",
    "endpointslices",
    GROUP_VERSION,
    "discovery.k8s.io",
    "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
)
PODS = Resource("Pod", "pods", "v1", "", "/api/v1/namespaces/{namespace}/pods")
RESOURCES = {r.kind: r for r in (ENDPOINT_SLICES, PODS)}


@dataclass(frozen=True)
class Endpoint:
    """A pod's address in an EndpointSlice, with the slice's conditions for it."""

    pod: str
    address: str
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    # The node that hosts it (Endpoint.nodeName); None: the field left out, as the API may.
    node: str | None = None


def endpoint_slice(
    name: str,
    endpoints: list[Endpoint],
    *,
    labels: dict[str, str],
    namespace: str = "default",
    port: int = 8000,
    port_name: str = "http",
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it (fields of discovery.k8s.io/v1)."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": GROUP_VERSION,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "addressType": address_type,
        "endpoints": [
            {
                "addresses": [e.address],
                "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
                "targetRef": {"kind": "Pod", "namespace": namespace, "name": e.pod},
                **({} if e.node is None else {"nodeName": e.node}),
            }
            for e in endpoints
        ],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def pod(
    name: str, address: str, *, labels: dict[str, str], namespace: str = "default", node: str | None = None
) -> dict[str, Any]:
    """A running Pod as the API server serves it, with the fields a Pod must have (v1); `node`: its spec.nodeName."""
    spec: dict[str, Any] = {"containers": [{"name": "engine", "image": "vllm/vllm-openai:v0.11.0"}]}
    if node is not None:
        spec["nodeName"] = node
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": spec,
        "status": {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}]},
    }


# Label selectors ("Labels and Selectors"): equality- and set-based requirements, comma-separated (AND).
_REQUIREMENT = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<absent>[\w./-]+)"
    r"|(?P<key>[\w./-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[\w.-]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?)\s*$"
)


def _split(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


class BadSelector(ValueError):
    """A label selector the API server would refuse to parse."""


def matches(selector: str, labels: dict[str, str]) -> bool:
    for requirement in _split(selector):
        m = _REQUIREMENT.match(requirement)
        if m is None:
            raise BadSelector(f"unable to parse requirement: {requirement!r}")
        if m["absent"]:
            if m["absent"] in labels:
                return False
            continue
        key = m["key"]
        if m["op"] in ("=", "=="):
            ok = labels.get(key) == m["value"]
        elif m["op"] == "!=":
            ok = labels.get(key) != m["value"]
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            ok = labels.get(key) in values if m["setop"] == "in" else labels.get(key) not in values
        else:
            ok = key in labels
        if not ok:
            return False
    return True


# Boolean query parameters as the API server (Go's strconv.ParseBool) reads them: kubectl sends
# "true", the Python clients "True".
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass(eq=False)
class _Watch:
    """One open watch: what it asked for, and the queue of events still to send it (None ends it)."""

    resource: Resource
    namespace: str
    selector: str
    queue: asyncio.Queue[dict[str, Any] | None]


# (revision, resource, type, object before, object after): a change the watches may replay.
_Change = tuple[int, Resource, str, dict[str, Any] | None, dict[str, Any]]


class FakeKubernetesApi:
    """A fake API server: objects at revisions, lists and watches over them, bookmarks, 410 Gone, RBAC refusals."""

    def __init__(self, *, bookmark_seconds: float = 0.5) -> None:
        self.bookmark_seconds = bookmark_seconds
        # etcd's revision: every change bumps it; objects carry the one they were last written at.
        self.revision = 100
        # (kind, namespace, name) -> the object.
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[_Change] = []
        # Watches from a resourceVersion below this get 410 Gone.
        self.oldest = self.revision
        self.gone_as_status = False
        # RBAC without list/watch on these resources (plural names): every request for them is 403.
        self.forbidden: set[str] = set()
        self.watches: set[_Watch] = set()
        self.requests: list[str] = []
        # Watch events to send verbatim instead of the live ones (the library check).
        self.replay: list[bytes] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # Lifecycle --------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        app = web.Application()
        for resource in RESOURCES.values():
            app.router.add_get(resource.path, functools.partial(self._serve, resource))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.url

    async def stop(self) -> None:
        """Down: open watches are cut off, new connections refused until start() on the same port."""
        self.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def kubeconfig(self, namespace: str = "default") -> str:
        """A kubeconfig as `kubectl proxy` users write one: a plain-HTTP server, no credentials."""
        return (
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {self.url}\n"
            f"contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: nobody\n    namespace: {namespace}\n"
            "current-context: fake\n"
            "users:\n- name: nobody\n  user: {}\n"
        )

    # State ---------------------------------------------------------------------

    def put(self, obj: dict[str, Any], *, tell: bool = True) -> None:
        """Create or replace an object (its `kind` says which). `tell=False`: the watches never hear of it."""
        obj = copy.deepcopy(obj)
        resource = RESOURCES[obj["kind"]]
        key = (resource.kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        before = self.objects.get(key)
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        obj["metadata"].setdefault("uid", f"uid-{resource.plural}-{key[2]}")
        self.objects[key] = obj
        self._record(resource, "MODIFIED" if before is not None else "ADDED", before, obj, tell)

    def delete(self, namespace: str, name: str, *, kind: str = "EndpointSlice", tell: bool = True) -> None:
        resource = RESOURCES[kind]
        before = self.objects.pop((kind, namespace, name))
        self.revision += 1
        gone = copy.deepcopy(before)
        gone["metadata"]["resourceVersion"] = str(self.revision)
        self._record(resource, "DELETED", before, gone, tell)

    def _record(
        self, resource: Resource, kind: str, before: dict[str, Any] | None, after: dict[str, Any], tell: bool
    ) -> None:
        if not tell:
            # Not in the history either: a watch resumed from an older version
            # will not replay it. Only a list shows it.
            return
        entry = (self.revision, resource, kind, before, after)
        self.history.append(entry)
        for watch in list(self.watches):
            if watch.resource != resource or watch.namespace != after["metadata"]["namespace"]:
                continue
            event = self._event_for(watch.selector, entry)
            if event is not None:
                watch.queue.put_nowait(event)

    def expire(self) -> None:
        """The history is compacted: every open watch gets 410 Gone, and so does a watch from any older version."""
        self.oldest = self.revision + 1
        self.history.clear()
        for watch in list(self.watches):
            watch.queue.put_nowait(
                {"type": "ERROR", "object": _status(410, "Expired", "too old resource version: compacted")}
            )
            watch.queue.put_nowait(None)

    def close_watches(self, kind: str | None = None) -> None:
        """End the open watches (of one kind of object, or all), as the API server does at its timeout."""
        for watch in list(self.watches):
            if kind is None or watch.resource.kind == kind:
                watch.queue.put_nowait(None)

    def watching(self, kind: str) -> int:
        return sum(1 for w in self.watches if w.resource.kind == kind)

    @staticmethod
    def _event_for(selector: str, entry: _Change) -> dict[str, Any] | None:
        _, _, kind, before, after = entry
        was = before is not None and matches(selector, before["metadata"].get("labels", {}))
        now = matches(selector, after["metadata"].get("labels", {}))
        if kind == "DELETED":
            return {"type": "DELETED", "object": after} if was else None
        if was and now:
            return {"type": "MODIFIED", "object": after}
        if now:
            return {"type": "ADDED", "object": after}
        if was:
            return {"type": "DELETED", "object": after}
        return None

    # HTTP ----------------------------------------------------------------------

    async def _serve(self, resource: Resource, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path_qs)
        namespace = request.match_info["namespace"]
        query = request.query
        selector = query.get("labelSelector", "")
        if resource.plural in self.forbidden:
            verb = "watch" if query.get("watch") in _TRUE else "list"
            qualified = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
            message = (
                f'{qualified} is forbidden: User "system:serviceaccount:{namespace}:router" '
                f'cannot {verb} resource "{resource.plural}" in API group "{resource.group}" '
                f'in the namespace "{namespace}"'
            )
            return web.json_response(_status(403, "Forbidden", message), status=403)
        try:
            matches(selector, {})
        except BadSelector as exc:
            return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
        if query.get("watch") in _TRUE:
            return await self._watch(request, resource, namespace, selector)
        # A list's items carry no kind and apiVersion; the list does.
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for (kind, ns, _), obj in sorted(self.objects.items())
            if kind == resource.kind and ns == namespace and matches(selector, obj["metadata"].get("labels", {}))
        ]
        body = {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self.revision)},
            "items": items,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _watch(
        self, request: web.Request, resource: Resource, namespace: str, selector: str
    ) -> web.StreamResponse:
        query = request.query
        since = int(query.get("resourceVersion") or self.revision)
        bookmarks = query.get("allowWatchBookmarks") in _TRUE
        timeout = float(query.get("timeoutSeconds") or 1800)
        if since < self.oldest - 1 and self.gone_as_status:
            status = _status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
            return web.json_response(status, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if self.replay is not None:
            for line in self.replay:
                await response.write(line.rstrip(b"\n") + b"\n")
            await response.write_eof()
            return response
        watch = _Watch(resource, namespace, selector, asyncio.Queue())
        if since < self.oldest - 1:
            watch.queue.put_nowait(
                {"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")}
            )
            watch.queue.put_nowait(None)
        else:
            for entry in self.history:
                revision, changed, _, _, after = entry
                if revision > since and changed == resource and after["metadata"]["namespace"] == namespace:
                    event = self._event_for(selector, entry)
                    if event is not None:
                        watch.queue.put_nowait(event)
        self.watches.add(watch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                wait = min(deadline - loop.time(), self.bookmark_seconds if bookmarks else 3600.0)
                if wait <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watch.queue.get(), wait)
                except TimeoutError:
                    if loop.time() >= deadline:
                        break
                    event = {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": resource.kind,
                            "apiVersion": resource.api_version,
                            "metadata": {"resourceVersion": str(self.revision)},
                        },
                    }
                if event is None:
                    break
                await response.write(orjson.dumps(event) + b"\n")
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        except ConnectionError:
            pass
        finally:
            self.watches.discard(watch)
        return response
