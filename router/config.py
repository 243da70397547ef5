"""Load and validate the router's TOML configuration into frozen dataclasses.

Every mistake becomes a `ConfigError` whose message names the file, the key
and what is wrong, so that an operator can fix it from one line of output.
The replica-set validation is shared with the admin API's endpoint pushes,
which must reject exactly what the config file would reject.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from router.errors import ConfigError

LabelValue = str | int | float | bool

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9090"


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    id: str
    model: str
    url: str
    labels: Mapping[str, LabelValue] = field(default_factory=lambda: MappingProxyType({}))

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "url": self.url, "labels": dict(self.labels)}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    listen: Address = Address("127.0.0.1", 8080)
    admin_listen: Address = Address("127.0.0.1", 9090)
    router_name: str = ""
    tick_seconds: float = 5.0
    admin_token: str = ""
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 1024 * 1024
    usage_push_url: str = ""
    # How long to wait for a TCP connection to a replica; a replica that does
    # not accept within this is treated as down and the request retried.
    connect_timeout_seconds: float = 5.0
    # From sending the request to the response head. Generous, because a busy
    # engine queues requests before its first token; never applied to a body.
    first_byte_timeout_seconds: float = 300.0
    # Idle upstream connections are dropped before the replicas drop them
    # (vLLM/uvicorn: 5 s), so that a reused connection is rarely a dead one.
    upstream_keepalive_seconds: float = 2.0
    # A client that takes no bytes for this long while its stream waits to be
    # written is cut off, so that a slow reader holds neither memory nor a replica.
    write_stall_timeout_seconds: float = 30.0
    # A connection whose request head (any request, not only the first) has
    # not fully arrived this long after its first byte is closed (slowloris).
    header_timeout_seconds: float = 10.0
    # A request body must arrive whole within this of its head's end (408
    # after it), so that a body that stops arriving holds no buffer forever.
    body_timeout_seconds: float = 60.0
    # Request bodies held by all client connections together: new bodies
    # beyond it get 503 at once (100 slow 32 MiB uploads must not take 3 GB).
    max_buffered_body_bytes: int = 1 << 30
    # A replica that sends nothing for this long after its response head is
    # cut off (a stream then ends with an error event): no answer hangs forever.
    upstream_idle_timeout_seconds: float = 300.0
    # Concurrency limits (0 = none): past them a request waits up to
    # queue_timeout_seconds for a slot, then gets a prompt 503.
    max_in_flight_per_replica: int = 0
    max_in_flight: int = 0
    queue_timeout_seconds: float = 5.0
    # Upstream attempts per model for one client request (first try included).
    max_attempts: int = 3
    shutdown_grace_seconds: float = 30.0
    # Passive outlier ejection: this many failures in a row eject a replica
    # for the base time, doubled with each ejection in a row, up to the max.
    ejection_failures: int = 5
    ejection_base_seconds: float = 10.0
    ejection_max_seconds: float = 300.0
    # Active health checks: GET health_check_path on every replica this often
    # (0 = off). A 2xx readmits an ejected replica early; anything else, or no
    # answer, ejects a ready one before a client meets it.
    health_check_interval_seconds: float = 0.0
    health_check_path: str = "/health"
    health_check_timeout_seconds: float = 2.0
    replicas: tuple[ReplicaConfig, ...] = ()
    models: Mapping[str, ModelConfig] = field(default_factory=lambda: MappingProxyType({}))
    source: str = "<defaults>"


_TOP_KEYS = {
    "listen",
    "admin_listen",
    "router_name",
    "tick_seconds",
    "admin_token",
    "api_keys",
    "max_body_bytes",
    "usage_push_url",
    "connect_timeout_seconds",
    "first_byte_timeout_seconds",
    "upstream_keepalive_seconds",
    "write_stall_timeout_seconds",
    "header_timeout_seconds",
    "body_timeout_seconds",
    "max_buffered_body_bytes",
    "upstream_idle_timeout_seconds",
    "max_in_flight_per_replica",
    "max_in_flight",
    "queue_timeout_seconds",
    "max_attempts",
    "shutdown_grace_seconds",
    "ejection_failures",
    "ejection_base_seconds",
    "ejection_max_seconds",
    "health_check_interval_seconds",
    "health_check_path",
    "health_check_timeout_seconds",
    "replicas",
    "models",
}
_REPLICA_KEYS = {"id", "model", "url", "labels"}
_MODEL_KEYS = {"aliases", "fallbacks"}


class _Where:
    """Builds the `file: key: problem` prefix of every message."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {problem}")


def _type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _string(where: _Where, key: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise where.error(key, f"must be a string, got {_type_name(value)}")
    if not empty_ok and not value.strip():
        raise where.error(key, "must not be empty")
    if any(ch in value for ch in "\r\n\x00"):
        raise where.error(key, "must not contain CR, LF or NUL")
    return value


def _number(where: _Where, key: str, value: object, *, minimum: float, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "an integer" if integer else "a number"
        raise where.error(key, f"must be {kind}, got {_type_name(value)}")
    if integer and not isinstance(value, int):
        raise where.error(key, f"must be an integer, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise where.error(key, f"must be at least {minimum:g}, got {value!r}")
    return value


def parse_address(where: _Where, key: str, value: object) -> Address:
    text = _string(where, key, value)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise where.error(key, f"must be host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise where.error(key, f"port must be 0-65535, got {port_text!r}")
    return Address(host, int(port_text))


def check_url(where: _Where, key: str, value: object) -> str:
    """A replica base URL: http(s), a host, no credentials, no query or fragment.

    The proxy appends the client's `/v1/...` path to it, so anything that could
    redirect a request elsewhere (userinfo, a query, a fragment) is refused.
    """
    text = _string(where, key, value)
    if any(ch.isspace() for ch in text):
        raise where.error(key, f"must not contain whitespace, got {text!r}")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise where.error(key, f"is not a valid URL ({exc}): {text!r}") from exc
    if parts.scheme not in ("http", "https"):
        raise where.error(key, f"must start with http:// or https://, got {text!r}")
    if not parts.hostname:
        raise where.error(key, f"has no host: {text!r}")
    if parts.username is not None or parts.password is not None:
        raise where.error(key, "must not carry credentials (user:password@)")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise where.error(key, f"must not have a query or fragment: {text!r}")
    del port  # parsed only so that a bad port is reported here
    return text.rstrip("/")


def _labels(where: _Where, key: str, value: object) -> Mapping[str, LabelValue]:
    if not isinstance(value, dict):
        raise where.error(key, f"must be a table, got {_type_name(value)}")
    out: dict[str, LabelValue] = {}
    for name, item in value.items():
        if not isinstance(item, str | int | float | bool):
            raise where.error(f"{key}.{name}", f"must be a string, number or boolean, got {_type_name(item)}")
        out[name] = item
    return MappingProxyType(out)


def _table(where: _Where, key: str, value: object, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise where.error(key, f"must be a table, got {_type_name(value)}")
    for name in value:
        if name not in allowed:
            raise where.error(f"{key}.{name}", "unknown key")
    return value


def parse_replicas(where: _Where, key: str, value: object) -> tuple[ReplicaConfig, ...]:
    """Validate a whole replica set (config file or endpoint push)."""
    if not isinstance(value, list):
        raise where.error(key, f"must be an array of tables, got {_type_name(value)}")
    seen: dict[str, int] = {}
    out: list[ReplicaConfig] = []
    for index, raw in enumerate(value):
        item_key = f"{key}[{index}]"
        _table(where, item_key, raw, _REPLICA_KEYS)
        for name in ("id", "model", "url"):
            if name not in raw:
                raise where.error(f"{item_key}.{name}", "is required")
        replica_id = _string(where, f"{item_key}.id", raw["id"])
        if replica_id in seen:
            raise where.error(f"{item_key}.id", f"duplicate replica id {replica_id!r} (also {key}[{seen[replica_id]}])")
        seen[replica_id] = index
        out.append(
            ReplicaConfig(
                id=replica_id,
                model=_string(where, f"{item_key}.model", raw["model"]),
                url=check_url(where, f"{item_key}.url", raw["url"]),
                labels=_labels(where, f"{item_key}.labels", raw.get("labels", {})),
            )
        )
    return tuple(out)


def _string_list(where: _Where, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise where.error(key, f"must be an array of strings, got {_type_name(value)}")
    return tuple(_string(where, f"{key}[{i}]", item) for i, item in enumerate(value))


def _models(where: _Where, value: object, replicas: tuple[ReplicaConfig, ...]) -> Mapping[str, ModelConfig]:
    if not isinstance(value, dict):
        raise where.error("models", f"must be a table, got {_type_name(value)}")
    served = {r.model for r in replicas}
    declared = set(value) | served
    alias_owner: dict[str, str] = {}
    out: dict[str, ModelConfig] = {}
    for name, raw in value.items():
        key = f'models."{name}"'
        _table(where, key, raw, _MODEL_KEYS)
        aliases = _string_list(where, f"{key}.aliases", raw.get("aliases", []))
        fallbacks = _string_list(where, f"{key}.fallbacks", raw.get("fallbacks", []))
        for i, alias in enumerate(aliases):
            if alias in declared:
                raise where.error(f"{key}.aliases[{i}]", f"alias {alias!r} shadows the model of that name")
            if alias in alias_owner:
                raise where.error(
                    f"{key}.aliases[{i}]", f"alias {alias!r} is already an alias of {alias_owner[alias]!r}"
                )
            alias_owner[alias] = name
        for i, target in enumerate(fallbacks):
            if target == name:
                raise where.error(f"{key}.fallbacks[{i}]", "a model cannot fall back to itself")
            if target not in declared:
                raise where.error(
                    f"{key}.fallbacks[{i}]",
                    f"fallback to {target!r}, a model that no replica serves and no [models] table declares",
                )
        out[name] = ModelConfig(name=name, aliases=aliases, fallbacks=fallbacks)
    return MappingProxyType(out)


def parse_config(raw: Mapping[str, Any], source: str, environ: Mapping[str, str] | None = None) -> Config:
    where = _Where(source)
    env = os.environ if environ is None else environ
    for key in raw:
        if key not in _TOP_KEYS:
            raise where.error(key, "unknown key")
    replicas = parse_replicas(where, "replicas", raw.get("replicas", []))
    models = _models(where, raw.get("models", {}), replicas)
    admin_token = _string(where, "admin_token", raw.get("admin_token", ""), empty_ok=True)
    if not admin_token:
        admin_token = env.get("ROUTER_ADMIN_TOKEN", "")
    api_keys = _string_list(where, "api_keys", raw.get("api_keys", []))
    push_url = _string(where, "usage_push_url", raw.get("usage_push_url", ""), empty_ok=True)
    if push_url:
        push_url = check_url(where, "usage_push_url", push_url)
    router_name = _string(where, "router_name", raw.get("router_name", socket.gethostname() or "router"))

    def num(key: str, default: float, minimum: float, integer: bool = False) -> float:
        return _number(where, key, raw.get(key, default), minimum=minimum, integer=integer)

    tick = num("tick_seconds", 5.0, 0.01)
    health_path = _string(where, "health_check_path", raw.get("health_check_path", "/health"))
    if not health_path.startswith("/") or "?" in health_path or "#" in health_path or " " in health_path:
        raise where.error("health_check_path", f"must be a path starting with /, got {health_path!r}")
    return Config(
        listen=parse_address(where, "listen", raw.get("listen", DEFAULT_LISTEN)),
        admin_listen=parse_address(where, "admin_listen", raw.get("admin_listen", DEFAULT_ADMIN_LISTEN)),
        router_name=router_name,
        tick_seconds=tick,
        admin_token=admin_token,
        api_keys=api_keys,
        max_body_bytes=int(num("max_body_bytes", 32 * 1024 * 1024, 1, integer=True)),
        usage_push_url=push_url,
        connect_timeout_seconds=num("connect_timeout_seconds", 5.0, 0.001),
        first_byte_timeout_seconds=num("first_byte_timeout_seconds", 300.0, 0.001),
        upstream_keepalive_seconds=num("upstream_keepalive_seconds", 2.0, 0.0),
        header_timeout_seconds=num("header_timeout_seconds", 10.0, 0.001),
        body_timeout_seconds=num("body_timeout_seconds", 60.0, 0.001),
        max_buffered_body_bytes=int(num("max_buffered_body_bytes", 1 << 30, 1, integer=True)),
        upstream_idle_timeout_seconds=num("upstream_idle_timeout_seconds", 300.0, 0.001),
        max_in_flight_per_replica=int(num("max_in_flight_per_replica", 0, 0, integer=True)),
        max_in_flight=int(num("max_in_flight", 0, 0, integer=True)),
        queue_timeout_seconds=num("queue_timeout_seconds", 5.0, 0.0),
        write_stall_timeout_seconds=num("write_stall_timeout_seconds", 30.0, 0.001),
        max_attempts=int(num("max_attempts", 3, 1, integer=True)),
        shutdown_grace_seconds=num("shutdown_grace_seconds", 30.0, 0.0),
        ejection_failures=int(num("ejection_failures", 5, 1, integer=True)),
        ejection_base_seconds=num("ejection_base_seconds", 10.0, 0.001),
        ejection_max_seconds=num("ejection_max_seconds", 300.0, 0.001),
        health_check_interval_seconds=num("health_check_interval_seconds", 0.0, 0.0),
        health_check_path=health_path,
        health_check_timeout_seconds=num("health_check_timeout_seconds", 2.0, 0.001),
        replicas=replicas,
        models=models,
        source=source,
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


def replicas_where(source: str) -> _Where:
    """The message prefix for a replica set that does not come from a file."""
    return _Where(source)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
