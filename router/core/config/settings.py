"""Load and validate the router's TOML configuration into frozen dataclasses.

Every mistake becomes a `ConfigError` whose message names the file, the key
and what is wrong, so that an operator can fix it from one line of output.
The replica-set validation is shared with the admin API's endpoint pushes,
which must reject exactly what the config file would reject.

Here: the settings and tables, each key declared once, and how a file
becomes a Config. Each single value is checked in router.core.config.checks.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from router.core.config import checks as check
from router.core.config.engines import ENGINES, ROUTED_PATHS, UPGRADE_PATHS
from router.core.config.limits import LimitsConfig, limits_of
from router.core.config.models import ModelConfig, parse_models
from router.core.config.tenants import (
    DEFAULT_CLASSES,
    FAIRNESS_UNITS,
    ClientKey,
    PriorityClass,
    check_key_classes,
    parse_api_keys,
    parse_priority_classes,
)
from router.core.config.tracing import TracingConfig, parse_tracing
from router.core.config.upstream import UPSTREAM_KEYS, Upstream, parse_upstream
from router.core.errors import ConfigError

LabelValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class Address:
    """A host and port to listen on, as the config gives it."""

    host: str
    port: int

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """One replica as configured or pushed: its id, model, base URL and labels."""

    id: str
    model: str
    url: str
    labels: Mapping[str, LabelValue] = field(default_factory=lambda: MappingProxyType({}))
    # The engine it runs (one of ENGINES), whose load the router reads; None: recognised
    # from the names its /metrics exports, if it exports any.
    engine: str | None = None
    # Its own API key and extra headers (router.core.config.upstream): the config file's only, never shown.
    upstream: Upstream | None = None
    # The machine it runs on and the interconnect fabric that machine is on (router/control/nodes.py:
    # the whole nodes that could be freed); None: not said, counted apart, never guessed.
    node: str | None = None
    fabric: str | None = None

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id, "model": self.model, "url": self.url, "labels": dict(self.labels)}
        if self.engine is not None:
            doc["engine"] = self.engine
        if self.node is not None:
            doc["node"] = self.node
        if self.fabric is not None:
            doc["fabric"] = self.fabric
        return doc


def parse_address(where: check.Where, key: str, value: object) -> Address:
    text = check.string(where, key, value)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise where.error(key, f"must be host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise where.error(key, f"port must be 0-65535, got {port_text!r}")
    return Address(host, int(port_text))


def _replica_url(where: check.Where, key: str, value: object) -> str:
    url = check.url(where, key, value)
    # The client's path (/v1/chat/completions) is appended to the base URL:
    # one ending in /v1 would send every request to /v1/v1/... and get 404s.
    if urlsplit(url).path.rstrip("/").endswith("/v1"):
        raise where.error(
            key,
            f"ends in /v1: give the base URL without it (the router appends the client's /v1/... path), got {url!r}",
        )
    return url


# The label on a model's EndpointSlices (copied there from its Service) that names the model.
DEFAULT_MODEL_LABEL = "router.llm/model"
# The label naming a replica's engine (vllm, sglang, llamacpp, tgi), whose load the router reads.
DEFAULT_ENGINE_LABEL = "router.llm/engine"
# What [discovery.kubernetes] selector matches: the model Services' EndpointSlices, or the pods.
SELECTOR_ON = ("endpointslices", "pods")


@dataclass(frozen=True, slots=True)
class KubernetesDiscovery:
    """[discovery.kubernetes]: the replica set from the EndpointSlices that `selector` matches."""

    selector: str
    # A port name of the EndpointSlices, or a number.
    port: str | int
    # None: the pod's own namespace in a cluster, else the kubeconfig context's.
    namespace: str | None = None
    model_label: str = DEFAULT_MODEL_LABEL
    # The pod's (else the slice's) label naming its engine; absent or unknown: recognised as for any replica.
    engine_label: str = DEFAULT_ENGINE_LABEL
    labels_from: tuple[str, ...] = ()
    # None: in a cluster its service account, else $KUBECONFIG, else ~/.kube/config.
    kubeconfig: str | None = None
    # "pods": `selector` picks pods, whose labels name the model and fill `labels_from`
    # (the slices of the namespace still say which serve); needs list/watch on pods.
    selector_on: str = SELECTOR_ON[0]
    # With "pods": the pod's label naming its node's fabric (a replica's `fabric`); its node is
    # the pod's spec.nodeName. None: no fabric read.
    fabric_label: str | None = None


# Each setting is declared once, as a field of Config below: its type and
# default, and in its metadata how it is read from TOML (bounds included)
# and the line of help that docs/configuration.md's block carries
# (tests/core/test_config.py holds the two together). The keys a config file may
# hold, their validation and their defaults all derive from these fields,
# so a new setting is one line.


@dataclass(frozen=True, slots=True)
class Setting:
    """A top-level setting: its default, how it is checked, and what docs/configuration.md says of it."""

    # (where, key, raw value) -> the value; raises ConfigError naming the key.
    parse: Callable[[check.Where, str, object], Any]
    help: str
    # The value when the key is absent or empty, if not the default (the host name, an env var).
    fallback: Callable[[Mapping[str, str]], Any] | None = None


def _setting(default: Any, parse: Callable[[check.Where, str, object], Any], help_: str, **kw: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(parse, help_, **kw)})


def _seconds(default: float, help_: str, *, minimum: float = 0.001) -> Any:
    return _setting(default, lambda w, k, v: check.number(w, k, v, minimum=minimum), help_)


def _count(default: int, help_: str, *, minimum: int = 0) -> Any:
    return _setting(default, lambda w, k, v: int(check.number(w, k, v, minimum=minimum, integer=True)), help_)


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration, checked: what a router is started with, and reloaded on SIGHUP."""

    # _setting() returns a dataclasses.field; Address is frozen.
    listen: Address = _setting(Address("127.0.0.1", 8080), parse_address, "client port")  # noqa: RUF009
    admin_listen: Address = _setting(Address("127.0.0.1", 9090), parse_address, "admin API and /metrics")  # noqa: RUF009
    router_name: str = _setting(
        "",
        check.string,
        "names this router in the usage map (default: hostname)",
        fallback=lambda env: socket.gethostname() or "router",
    )
    tick_seconds: float = _seconds(5.0, "usage snapshot period; may be fractional", minimum=0.01)
    admin_token: str = _setting(
        "",
        lambda w, k, v: check.string(w, k, v, empty_ok=True),
        "or env ROUTER_ADMIN_TOKEN; required on mutating admin calls when set",
        fallback=lambda env: env.get("ROUTER_ADMIN_TOKEN", ""),
    )
    admin_token_reads: bool = _setting(
        False,
        check.boolean,
        "require the admin token on reads too (usage, replicas, status, metrics); /healthz, /readyz stay open",
    )
    # Only each key's SHA-256 is kept (router.core.config.tenants): never the key.
    api_keys: tuple[ClientKey, ...] = _setting(
        (), parse_api_keys, "client keys (Authorization: Bearer ...), or [api_keys.NAME] tables; empty = no client auth"
    )
    max_body_bytes: int = _count(32 * 1024 * 1024, "larger request bodies get 413", minimum=1)
    usage_push_url: str = _setting("", check.optional_url, "optional: POST the usage map here each tick")
    # A replica that does not accept within this is treated as down and the request retried.
    connect_timeout_seconds: float = _seconds(5.0, "TCP connect to a replica")
    # Generous: a busy engine queues requests before its first token. Never applied to a body.
    first_byte_timeout_seconds: float = _seconds(
        300.0, "request sent -> response head; 504 after it (never cuts a stream)"
    )
    # Below the replicas' own (vLLM/uvicorn: 5 s), so that a reused connection is rarely a dead one.
    upstream_keepalive_seconds: float = _seconds(
        2.0, "idle upstream connections closed before the replicas' 5 s", minimum=0.0
    )
    # So that a slow reader holds neither memory nor a replica.
    write_stall_timeout_seconds: float = _seconds(30.0, "a client that reads nothing of an answer this long is cut off")
    header_timeout_seconds: float = _seconds(
        10.0, "every request head must arrive whole within this of its first byte (slowloris)"
    )
    # So that a body that stops arriving holds no buffer forever.
    body_timeout_seconds: float = _seconds(
        60.0, "a request body must arrive whole within this of its head; 408 after it"
    )
    # 100 slow 32 MiB uploads must not take 3 GB.
    max_buffered_body_bytes: int = _count(
        1 << 30, "request bodies held by all connections together; new ones beyond it get 503", minimum=1
    )
    # No answer hangs forever; a stream then ends with an error event.
    upstream_idle_timeout_seconds: float = _seconds(
        300.0, "a replica silent this long after its response head is cut off"
    )
    max_attempts: int = _count(3, "upstream attempts per model for one request", minimum=1)
    max_in_flight_per_replica: int = _count(0, "concurrency limits, 0 = none; beyond them requests queue ...")
    max_in_flight: int = _count(0, "")
    queue_timeout_seconds: float = _seconds(5.0, "... this long at most, then get 503 server_overloaded", minimum=0.0)
    # So that one tenant's flood cannot fill a model's queue for the others.
    max_queued_per_tenant: int = _count(
        0, "per model and tenant (per worker); one more gets 429 rate_limit_exceeded; 0 = no bound"
    )
    # What a tenant's share of a full model counts (docs/fairness.md): a long prompt costs more than a short one.
    fairness_unit: str = _setting(
        "requests",
        lambda w, k, v: check.one_of(w, k, v, FAIRNESS_UNITS),
        '"requests" or "tokens": what the tenants\' shares of a full model count',
    )
    # An output token is about four times a prompt token's GPU time (prefill is batched, decode is not).
    fairness_output_weight: float = _setting(
        4.0,
        lambda w, k, v: check.number(w, k, v, minimum=0.0),
        "with tokens: an output token counts this many prompt tokens",
    )
    shutdown_delay_seconds: float = _seconds(
        5.0,
        "SIGTERM: /readyz answers 503 while still serving this long, then the drain; 0 = drain at once",
        minimum=0.0,
    )
    shutdown_grace_seconds: float = _seconds(30.0, "SIGTERM: how long requests in flight may finish", minimum=0.0)
    ejection_failures: int = _count(5, "failures in a row that eject a replica", minimum=1)
    ejection_base_seconds: float = _seconds(10.0, "first ejection; doubles in a row, up to ejection_max_seconds")
    ejection_max_seconds: float = _seconds(300.0, "")
    # A 2xx readmits an ejected replica early; anything else, or no answer, ejects a ready one.
    health_check_interval_seconds: float = _seconds(0.0, "active checks of every replica; 0 = off", minimum=0.0)
    # vLLM's, SGLang's and llama-server's /health: 503 while loading or dead (docs/engines.md).
    health_check_path: str = _setting(
        "/health", check.path, "a 2xx is healthy: vLLM's, SGLang's and llama-server's /health (docs/engines.md)"
    )
    # SGLang's /health sleeps a second before it looks for its one-token generation's answer.
    health_check_timeout_seconds: float = _seconds(
        5.0, "SGLang's /health runs a one-token generation: a second at least"
    )
    routed_paths: tuple[str, ...] = _setting(
        ROUTED_PATHS, check.paths, "POST paths routed by the model their body names"
    )
    upgrade_paths: tuple[str, ...] = _setting(
        UPGRADE_PATHS, check.paths, "GET paths whose WebSocket upgrades are routed by the query's model"
    )
    # Off for engines whose /v1/models is not theirs to give (behind an auth the router lacks).
    model_cards: bool = _setting(
        True, check.boolean, "read each replica's /v1/models as it joins: max_model_len, root, adapters"
    )
    # vLLM's /tokenize takes a body without a model; llama.cpp ignores the field.
    default_model: str = _setting(
        "",
        lambda w, k, v: check.string(w, k, v, empty_ok=True),
        "where a request naming no model goes; unset: the only model served, else 400",
    )
    remembered_responses: int = _count(100_000, "response ids kept with the replica that made them (/v1/responses)")
    # Replica ids are internal: only an operator who wants them in answers turns this on.
    expose_replica_header: bool = _setting(False, check.boolean, "X-Router-Replica: the replica that answered")
    access_log: str = _setting(
        "", check.optional_path, 'off; "-" for stdout, or a file (reopened on SIGHUP): one JSON line a request'
    )
    # Reading each answer's usage costs a few thousand instructions a request: only when asked.
    count_tokens: bool = _setting(
        False, check.boolean, "read each answer's usage: router_tokens_total, the access log's tokens (docs/tokens.md)"
    )
    # Scale from zero: told when a model's first request is held, so that it can start a replica.
    wake_url: str = _setting(
        "", check.optional_url, 'optional: POST {"router", "model", "held", "since"} here when a request is held'
    )
    wake_cooldown_seconds: float = _seconds(10.0, "at most one wake call per model this often while requests stay held")
    # A second: at 1,000 busy replicas a read costs the pure build about 94 us, so twice a
    # second would take 14% of a core and once 9% (bench/scale.py's engines target).
    engine_metrics_seconds: float = _seconds(
        1.0, "read each busy replica's engine load this often (docs/routing.md); 0 = off", minimum=0.0
    )
    # Ten, not the endpoint picker's five: measured on the simulated fleet (docs/routing.md), five
    # sends a prefix's requests away from its cache at the queues an engine serves through in a moment.
    saturated_waiting: float = _setting(
        10.0,
        lambda w, k, v: check.number(w, k, v, minimum=0.001),
        "a replica whose engine has this many requests waiting is saturated: requests wait in the router",
    )
    saturated_kv: float = _setting(
        0.8,
        lambda w, k, v: check.number(w, k, v, minimum=0.001),
        "... or whose KV cache is this full while requests wait (a fraction; above 1: never)",
    )
    replicas: tuple[ReplicaConfig, ...] = ()
    models: Mapping[str, ModelConfig] = field(default_factory=lambda: MappingProxyType({}))
    # [[priority_classes]], highest first (router.core.config.tenants): interactive and batch unless declared.
    priority_classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    # [discovery.kubernetes]: the replica set comes from the Kubernetes API instead of [[replicas]].
    discovery: KubernetesDiscovery | None = None
    # [tracing]: OpenTelemetry traces (router.core.config.tracing); None: off, nothing of it runs.
    tracing: TracingConfig | None = None
    # [limits] and the tenants' limits (router.core.config.limits); None: no tenant is limited.
    limits: LimitsConfig | None = None
    source: str = "<defaults>"


def settings() -> dict[str, tuple[Any, Setting]]:
    """Every top-level scalar setting: its default and how it is read, in declaration order."""
    return {f.name: (f.default, f.metadata["setting"]) for f in fields(Config) if "setting" in f.metadata}


_SETTINGS = settings()
# The tables beside the settings.
_TOP_KEYS = set(_SETTINGS) | {"replicas", "models", "discovery", "priority_classes", "tracing", "limits"}
# `router scaler`'s table (router/scaler/settings.py reads and checks it), so
# that one file may configure both; `router serve` does not read it.
_OTHER_COMMANDS_TABLES = {"scaler"}
_REPLICA_KEYS = {"id", "model", "url", "labels", "engine", "node", "fabric"}


def _labels(where: check.Where, key: str, value: object) -> Mapping[str, LabelValue]:
    if not isinstance(value, dict):
        raise where.error(key, f"must be a table, got {check.type_name(value)}")
    out: dict[str, LabelValue] = {}
    for name, item in value.items():
        if not isinstance(item, str | int | float | bool):
            raise where.error(f"{key}.{name}", f"must be a string, number or boolean, got {check.type_name(item)}")
        out[name] = item
    # The labels `router ctl status` reads: a wrong one would drop the replica's GPUs silently.
    if "gpus" in out:
        gpus = out["gpus"]
        if isinstance(gpus, str) and gpus.isdigit():
            gpus = int(gpus)
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise where.error(f"{key}.gpus", f"must be a positive integer (the GPUs the replica holds), got {gpus!r}")
        out["gpus"] = gpus
    if "gpu_class" in out and (not isinstance(out["gpu_class"], str) or not out["gpu_class"]):
        raise where.error(f"{key}.gpu_class", f"must be a non-empty string, got {out['gpu_class']!r}")
    return MappingProxyType(out)


def parse_replicas(
    where: check.Where, key: str, value: object, environ: Mapping[str, str] | None = None
) -> tuple[ReplicaConfig, ...]:
    """Validate a whole replica set (config file or endpoint push). `environ`: the config file's
    (its replicas may name upstream credentials); None for a push, which may not."""
    if not isinstance(value, list):
        raise where.error(key, f"must be an array of tables, got {check.type_name(value)}")
    seen: dict[str, int] = {}
    return tuple(parse_replica(where, key, index, raw, seen, environ=environ) for index, raw in enumerate(value))


def parse_replica(
    where: check.Where,
    key: str,
    index: int,
    raw: object,
    seen: dict[str, int],
    *,
    environ: Mapping[str, str] | None = None,
) -> ReplicaConfig:
    """Validate `key[index]`, one replica of a set; `seen`: the ids before it, by index (this one is added).
    `environ` as parse_replicas'."""
    item_key = f"{key}[{index}]"
    table = check.table(where, item_key, raw, _REPLICA_KEYS | UPSTREAM_KEYS)
    upstream = None
    if UPSTREAM_KEYS & table.keys():
        if environ is None:
            name = sorted(UPSTREAM_KEYS & table.keys())[0]
            raise where.error(
                f"{item_key}.{name}",
                "is the config file's to set: a push may not make the router read its environment or files",
            )
        upstream = parse_upstream(where, item_key, table, environ)
    for name in ("id", "model", "url"):
        if name not in table:
            raise where.error(f"{item_key}.{name}", "is required")
    replica_id = check.string(where, f"{item_key}.id", table["id"])
    check_unique(where, key, index, replica_id, seen)
    return ReplicaConfig(
        id=replica_id,
        model=check.string(where, f"{item_key}.model", table["model"]),
        url=_replica_url(where, f"{item_key}.url", table["url"]),
        labels=_labels(where, f"{item_key}.labels", table.get("labels", {})),
        engine=_engine(where, f"{item_key}.engine", table.get("engine")),
        upstream=upstream,
        node=_name(where, f"{item_key}.node", table.get("node")),
        fabric=_name(where, f"{item_key}.fabric", table.get("fabric")),
    )


def _name(where: check.Where, key: str, value: object) -> str | None:
    """A node's or a fabric's name: absent is unknown (None), never an empty string standing for it."""
    if value is None:
        return None
    name = check.string(where, key, value)
    # A Kubernetes node name is a DNS subdomain: at most 253 characters.
    if len(name) > 253:
        raise where.error(key, f"must be at most 253 characters, got {len(name)}")
    return name


def _engine(where: check.Where, key: str, value: object) -> str | None:
    return None if value is None else check.one_of(where, key, value, ENGINES)


def check_unique(where: check.Where, key: str, index: int, replica_id: str, seen: dict[str, int]) -> None:
    """`key[index]`'s id is not one of `seen` (the ids before it, by index); it is one from now on."""
    if replica_id in seen:
        raise where.error(f"{key}[{index}].id", f"duplicate replica id {replica_id!r} (also {key}[{seen[replica_id]}])")
    seen[replica_id] = index


def parse_config(raw: Mapping[str, Any], source: str, environ: Mapping[str, str] | None = None) -> Config:
    where = check.Where(source)
    env = os.environ if environ is None else environ
    for key in raw:
        if key not in _TOP_KEYS and key not in _OTHER_COMMANDS_TABLES:
            raise check.unknown_key(where, key, key, _TOP_KEYS | _OTHER_COMMANDS_TABLES)
    values: dict[str, Any] = {}
    for key, (default, setting) in _SETTINGS.items():
        value = setting.parse(where, key, raw[key]) if key in raw else default
        if setting.fallback is not None and not value:
            value = setting.fallback(env)
        values[key] = value
    listen, admin = values["listen"], values["admin_listen"]
    wildcards = ("0.0.0.0", "::", "")
    if (
        listen.port
        and listen.port == admin.port
        and (listen.host == admin.host or listen.host in wildcards or admin.host in wildcards)
    ):
        raise where.error(
            "admin_listen", f"must differ from listen ({listen}): the client port and the admin API need two"
        )
    if values["admin_token_reads"] and not values["admin_token"]:
        raise where.error("admin_token_reads", "needs admin_token (or ROUTER_ADMIN_TOKEN): the token to require")
    replicas = parse_replicas(where, "replicas", raw.get("replicas", []), env)
    models = parse_models(where, raw.get("models", {}), {r.model for r in replicas}, env)
    discovery = _discovery(where, raw["discovery"]) if "discovery" in raw else None
    if discovery is not None and replicas:
        raise where.error("replicas", "cannot be used with [discovery.kubernetes], which owns the whole replica set")
    classes = parse_priority_classes(where, raw.get("priority_classes"), values["queue_timeout_seconds"])
    check_key_classes(where, values["api_keys"], classes)
    tracing = parse_tracing(where, raw["tracing"]) if "tracing" in raw else None
    return Config(
        **values,
        replicas=replicas,
        models=models,
        priority_classes=classes,
        discovery=discovery,
        tracing=tracing,
        limits=limits_of(where, raw.get("limits"), values["api_keys"], values["count_tokens"]),
        source=source,
    )


_DISCOVERY_KEYS = {"kubernetes"}
_KUBERNETES_KEYS = {
    "namespace",
    "selector",
    "selector_on",
    "port",
    "model_label",
    "engine_label",
    "labels_from",
    "kubeconfig",
    "fabric_label",
}
# RFC 1123 labels (namespaces, and EndpointSlice port names), label keys: what the API server accepts.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PORT_NAME = _DNS_LABEL


def _discovery(where: check.Where, value: object) -> KubernetesDiscovery:
    table = check.table(where, "discovery", value, _DISCOVERY_KEYS)
    if "kubernetes" not in table:
        raise where.error("discovery.kubernetes", "is required in [discovery] (the only kind of discovery)")
    key = "discovery.kubernetes"
    raw = check.table(where, key, table["kubernetes"], _KUBERNETES_KEYS)
    for name in ("selector", "port"):
        if name not in raw:
            raise where.error(f"{key}.{name}", "is required")
    selector = check.string(where, f"{key}.selector", raw["selector"])
    port_raw = raw["port"]
    port: str | int
    if isinstance(port_raw, str):
        # discovery/v1's EndpointPort.name: "" (a Service's one unnamed port) or a DNS label of up to 63.
        port = check.string(where, f"{key}.port", port_raw, empty_ok=True)
        if port and (not _PORT_NAME.fullmatch(port) or len(port) > 63):
            raise where.error(
                f"{key}.port", f"must be a port number or a port name of the EndpointSlices, got {port!r}"
            )
    elif isinstance(port_raw, int) and not isinstance(port_raw, bool):
        if not 1 <= port_raw <= 65535:
            raise where.error(f"{key}.port", f"must be 1-65535, got {port_raw}")
        port = port_raw
    else:
        raise where.error(f"{key}.port", f"must be a port number or name, got {check.type_name(port_raw)}")
    namespace = None
    if "namespace" in raw:
        namespace = check.string(where, f"{key}.namespace", raw["namespace"])
        if not _DNS_LABEL.fullmatch(namespace) or len(namespace) > 63:
            raise where.error(f"{key}.namespace", f"is not a namespace name: {namespace!r}")
    labels_raw = raw.get("labels_from", [])
    if not isinstance(labels_raw, list):
        raise where.error(f"{key}.labels_from", f"must be an array of label keys, got {check.type_name(labels_raw)}")
    labels_from = tuple(check.label_key(where, f"{key}.labels_from[{i}]", item) for i, item in enumerate(labels_raw))
    kubeconfig = check.string(where, f"{key}.kubeconfig", raw["kubeconfig"]) if "kubeconfig" in raw else None
    selector_on = check.string(where, f"{key}.selector_on", raw.get("selector_on", SELECTOR_ON[0]))
    if selector_on not in SELECTOR_ON:
        raise where.error(f"{key}.selector_on", f"must be 'endpointslices' or 'pods', got {selector_on!r}")
    fabric_label = None
    if "fabric_label" in raw:
        fabric_label = check.label_key(where, f"{key}.fabric_label", raw["fabric_label"])
        if selector_on != "pods":
            raise where.error(
                f"{key}.fabric_label",
                'is read from the pods: it needs selector_on = "pods" (an EndpointSlice carries no pod labels)',
            )
    return KubernetesDiscovery(
        selector=selector,
        port=port,
        namespace=namespace,
        model_label=check.label_key(where, f"{key}.model_label", raw.get("model_label", DEFAULT_MODEL_LABEL)),
        engine_label=check.label_key(where, f"{key}.engine_label", raw.get("engine_label", DEFAULT_ENGINE_LABEL)),
        labels_from=labels_from,
        kubeconfig=kubeconfig,
        selector_on=selector_on,
        fabric_label=fabric_label,
    )


def has_upstream(config: Config) -> bool:
    """Whether any model or replica of the file has credentials of its own for its engines."""
    return any(m.upstream is not None for m in config.models.values()) or any(
        r.upstream is not None for r in config.replicas
    )


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    source = str(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text: {exc}") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    return parse_config(raw, source, environ)


def check_files(config: Config) -> None:
    """The files the config names, tried before anything starts: a problem is one line naming the key, as for any."""
    target = config.access_log
    if target and target != "-":
        try:
            # As the access log opens it; a file that was not there is made, as it would be a moment later.
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640))
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConfigError(f"{config.source}: access_log: cannot open {target!r} for appending: {reason}") from exc


def replicas_where(source: str) -> check.Where:
    """The message prefix for a replica set that does not come from a file."""
    return check.Where(source)
