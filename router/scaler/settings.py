"""The scaler's settings: the `[scaler]` table of a TOML file, then the command line over it.

    [scaler]
    servers = ["router-a:9090", "router-b:9090"]
    servers_from_dns = "router-admin.default.svc.cluster.local:9090"
    listen = "127.0.0.1:9091"
    http_listen = "127.0.0.1:9092"
    poll_seconds = 1
    timeout_seconds = 2
    token = ""
    tls_cert = ""        # optional: serve KEDA's gRPC over TLS with this PEM certificate chain ...
    tls_key = ""         # ... and its PEM private key
    tls_client_ca = ""   # optional: require KEDA's client certificate (its tlsClientCert), signed by this CA

The table may sit in a router's own config file (`router serve` skips it).
A mistake is one line naming the source, the key and the problem, as the
router's config errors are.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.core.config import checks as check
from router.core.config.settings import Address, parse_address, replicas_where
from router.core.errors import ConfigError

if TYPE_CHECKING:
    # The `file: key: problem` builder of the router's config, reused so that both read alike.
    from router.core.config.checks import Where

SECTION = "scaler"


@dataclass(frozen=True, slots=True)
class ScalerSettings:
    """The scaler's settings: its [scaler] table and flags, checked."""

    # Admin addresses of the routers, host:port or http(s) URLs.
    servers: tuple[str, ...] = ()
    # host:port resolved before every round to every router pod (a headless Service); None: not used.
    servers_from_dns: Address | None = None
    # KEDA's gRPC calls.
    listen: Address = Address("127.0.0.1", 9091)  # noqa: RUF009 (Address is frozen)
    # /healthz, /metrics and POST /wake.
    http_listen: Address = Address("127.0.0.1", 9092)  # noqa: RUF009
    poll_seconds: float = 1.0
    # One router's answer to one round; a router slower than this did not answer.
    timeout_seconds: float = 2.0
    # The routers' admin token: sent on every poll, required on POST /wake.
    token: str = ""
    # gRPC over TLS (KEDA's enableTLS / caCert): PEM files; "" each: plain gRPC.
    tls_cert: str = ""
    tls_key: str = ""
    # KEDA's client certificates (tlsClientCert, tlsClientKey): required, and checked against this CA.
    tls_client_ca: str = ""


# Each key: its help line (docs/kubernetes.md's [scaler] block holds the same), and its parser.
HELP = {
    "servers": "admin addresses of every router (host:port or URL)",
    "servers_from_dns": 'or "host:port" resolved each round to every router pod (a headless Service)',
    "listen": "gRPC, for KEDA (scalerAddress)",
    "http_listen": "/healthz, /metrics, and POST /wake (point the routers' wake_url here)",
    "poll_seconds": "a round over every router this often, and at once on a wake call",
    "timeout_seconds": "a router that does not answer within this makes the round incomplete",
    "token": "or env ROUTER_ADMIN_TOKEN: the routers' admin token, also required on POST /wake",
    "tls_cert": "optional: serve KEDA's gRPC over TLS with this PEM certificate chain ...",
    "tls_key": "... and its PEM private key",
    "tls_client_ca": "optional: require KEDA's client certificate (its tlsClientCert), signed by this CA",
}


def server_url(server: str) -> str:
    """An admin address as a base URL; ValueError names the problem."""
    text = server.strip().rstrip("/")
    if not text:
        raise ValueError("must not be empty")
    if any(ch.isspace() or ch in "\x00" for ch in text):
        raise ValueError(f"must not contain whitespace, got {server!r}")
    if "://" not in text:
        return "http://" + text
    if not text.startswith(("http://", "https://")):
        raise ValueError(f"must be host:port or an http(s) URL, got {server!r}")
    return text


def _seconds(where: Where, key: str, value: object, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise where.error(key, f"must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value < minimum:
        raise where.error(key, f"must be at least {minimum:g}, got {value!r}")
    return float(value)


def _servers(where: Where, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise where.error(key, f"must be an array of strings, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise where.error(f"{key}[{i}]", f"must be a string, got {type(item).__name__}")
        try:
            server_url(item)
        except ValueError as exc:
            raise where.error(f"{key}[{i}]", str(exc)) from None
        out.append(item.strip())
    return tuple(out)


def _token(where: Where, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise where.error(key, f"must be a string, got {type(value).__name__}")
    if any(ch in value for ch in "\r\n\x00"):
        raise where.error(key, "must not contain CR, LF or NUL")
    return value


def _dns(where: Where, key: str, value: object) -> Address | None:
    if value == "":
        return None
    address = parse_address(where, key, value)
    if address.port == 0:
        raise where.error(key, "needs the routers' admin port, got port 0")
    return address


_PARSERS: dict[str, Callable[[Where, str, object], object]] = {
    "servers": _servers,
    "servers_from_dns": _dns,
    "listen": parse_address,
    "http_listen": parse_address,
    "poll_seconds": lambda w, k, v: _seconds(w, k, v, 0.05),
    "timeout_seconds": lambda w, k, v: _seconds(w, k, v, 0.05),
    "token": _token,
    "tls_cert": _token,
    "tls_key": _token,
    "tls_client_ca": _token,
}


def apply(
    settings: ScalerSettings, raw: Mapping[str, object], source: str, *, label: Callable[[str], str] = str
) -> ScalerSettings:
    """`settings` with the keys of `raw` parsed over it; a ConfigError names `label(key)` (a file key, a flag)."""
    where = replicas_where(source)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        parse = _PARSERS.get(key)
        if parse is None:
            raise check.unknown_key(where, label(key), key, _PARSERS)
        values[key] = parse(where, label(key), value)
    return replace(settings, **values)


def load_section(path: str | Path) -> ScalerSettings:
    """The `[scaler]` table of a TOML file; the rest of the file (a router's settings) is not read."""
    source = str(path)
    try:
        raw = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    table = raw.get(SECTION)
    if table is None:
        raise ConfigError(f"{source}: {SECTION}: no [{SECTION}] table in this file")
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {SECTION}: must be a table, got {type(table).__name__}")
    return apply(ScalerSettings(), table, source, label=lambda key: f"{SECTION}.{key}")


def finish(settings: ScalerSettings, source: str, environ: Mapping[str, str] | None = None) -> ScalerSettings:
    """The checks across keys, and the token from the environment when none is set."""
    env = os.environ if environ is None else environ
    if not settings.servers and settings.servers_from_dns is None:
        raise ConfigError(
            f"{source}: servers: no router to poll (--server or servers, --servers-from-dns or servers_from_dns)"
        )
    if settings.listen == settings.http_listen and settings.listen.port != 0:
        raise ConfigError(f"{source}: http_listen: must differ from listen ({settings.listen})")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigError(f"{source}: tls_key: tls_cert and tls_key go together (a certificate and its key)")
    if settings.tls_client_ca and not settings.tls_cert:
        raise ConfigError(f"{source}: tls_client_ca: checks KEDA's certificate over TLS, which needs tls_cert")
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(settings, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"{source}: {key}: no such file: {path!r}")
    if not settings.token:
        token = _token(replicas_where("environment"), "ROUTER_ADMIN_TOKEN", env.get("ROUTER_ADMIN_TOKEN", ""))
        settings = replace(settings, token=token)
    return settings
