"""A fake Kubernetes API server for one resource: EndpointSlices (discovery.k8s.io/v1).

It speaks the protocol as the API reference describes it ("API Concepts":
efficient detection of changes, resource versions, watch bookmarks):

- `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` lists the
  slices matching `labelSelector`, with the collection's
  `metadata.resourceVersion`;
- with `watch=true` it streams one JSON object a line (chunked):
  `{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}`,
  every change after `resourceVersion`; a slice whose labels stop (start)
  matching the selector is DELETED (ADDED) for that watch; BOOKMARK events
  (an object with only `metadata.resourceVersion`) when
  `allowWatchBookmarks=true`; the stream ends after `timeoutSeconds`;
- a watch from a resourceVersion older than the history kept gets an
  `ERROR` event whose object is a `Status` with code 410 (reason `Expired`),
  as the API server sends it, or, with `gone_as_status`, an HTTP 410.

And it takes faults: close every watch, expire the history (410), change
state without telling the watches (an event lost while a watch was down),
go down (connections refused) and come back on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

GROUP_VERSION = "discovery.k8s.io/v1"
PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


@dataclass(frozen=True)
class Endpoint:
    pod: str
    address: str
    ready: bool = True
    serving: bool = True
    terminating: bool = False


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
            }
            for e in endpoints
        ],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
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
    pass


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
    namespace: str
    selector: str
    queue: asyncio.Queue[dict[str, Any] | None]


class FakeKubernetesApi:
    def __init__(self, *, bookmark_seconds: float = 0.5) -> None:
        self.bookmark_seconds = bookmark_seconds
        # etcd's revision: every change bumps it; objects carry the one they were last written at.
        self.revision = 100
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        # (revision, type, object before, object after) for every change the watches may replay.
        self.history: list[tuple[int, str, dict[str, Any] | None, dict[str, Any] | None]] = []
        # Watches from a resourceVersion below this get 410 Gone.
        self.oldest = self.revision
        self.gone_as_status = False
        # RBAC without list/watch on endpointslices: every request is 403.
        self.forbidden = False
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
        app.router.add_get(PATH, self._endpointslices)
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
        """Create or replace a slice. `tell=False`: the watches never hear of it (an event lost)."""
        obj = copy.deepcopy(obj)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        before = self.slices.get(key)
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        obj["metadata"].setdefault("uid", f"uid-{key[1]}")
        self.slices[key] = obj
        self._record("MODIFIED" if before is not None else "ADDED", before, obj, tell)

    def delete(self, namespace: str, name: str, *, tell: bool = True) -> None:
        before = self.slices.pop((namespace, name))
        self.revision += 1
        gone = copy.deepcopy(before)
        gone["metadata"]["resourceVersion"] = str(self.revision)
        self._record("DELETED", before, gone, tell)

    def _record(self, kind: str, before: dict[str, Any] | None, after: dict[str, Any], tell: bool) -> None:
        if not tell:
            # Not in the history either: a watch resumed from an older version
            # will not replay it. Only a list shows it.
            return
        entry = (self.revision, kind, before, after)
        self.history.append(entry)
        for watch in list(self.watches):
            if watch.namespace != after["metadata"]["namespace"]:
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

    def close_watches(self) -> None:
        for watch in list(self.watches):
            watch.queue.put_nowait(None)

    @staticmethod
    def _event_for(selector: str, entry: tuple[int, str, Any, Any]) -> dict[str, Any] | None:
        _, kind, before, after = entry
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

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path_qs)
        namespace = request.match_info["namespace"]
        query = request.query
        selector = query.get("labelSelector", "")
        if self.forbidden:
            verb = "watch" if query.get("watch") in _TRUE else "list"
            message = (
                f'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:{namespace}:router" '
                f'cannot {verb} resource "endpointslices" in API group "discovery.k8s.io" '
                f'in the namespace "{namespace}"'
            )
            return web.json_response(_status(403, "Forbidden", message), status=403)
        try:
            matches(selector, {})
        except BadSelector as exc:
            return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
        if query.get("watch") in _TRUE:
            return await self._watch(request, namespace, selector)
        # A list's items carry no kind and apiVersion; the list does.
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for (ns, _), obj in sorted(self.slices.items())
            if ns == namespace and matches(selector, obj["metadata"].get("labels", {}))
        ]
        body = {
            "kind": "EndpointSliceList",
            "apiVersion": GROUP_VERSION,
            "metadata": {"resourceVersion": str(self.revision)},
            "items": items,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _watch(self, request: web.Request, namespace: str, selector: str) -> web.StreamResponse:
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
        watch = _Watch(namespace, selector, asyncio.Queue())
        if since < self.oldest - 1:
            watch.queue.put_nowait(
                {"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")}
            )
            watch.queue.put_nowait(None)
        else:
            for entry in self.history:
                after = entry[3]
                if entry[0] > since and after is not None and after["metadata"]["namespace"] == namespace:
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
                            "kind": "EndpointSlice",
                            "apiVersion": GROUP_VERSION,
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
