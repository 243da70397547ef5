"""Per-tenant rate limits: `[limits]` (how they are kept and enforced) and each tenant's own.

A tenant's limits are written on its keys (`[api_keys.NAME]`
`tokens_per_minute`, `requests_per_minute`): every key of one tenant says the
same, or says nothing (one tenant, one limit). `[limits]` says how they are
enforced (`mode`), what a request that bounds nothing of its answer is
estimated to take (`unbounded_output_tokens`), and where the counters live:
in memory (the default), or in Redis, shared by every router (`redis_url`).
docs/limits.md explains them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from router.core.config import checks as check

LIMIT_MODES = ("enforce", "shadow")
UNAVAILABLE = ("admit", "refuse")
LIMITS_KEYS = {
    "mode",
    "unbounded_output_tokens",
    "redis_url",
    "redis_timeout_seconds",
    "redis_unavailable",
    "redis_key_prefix",
}
# A Redis key prefix: printable, no spaces (a key is PREFIX + tenant).
_PREFIX = re.compile(r"[A-Za-z0-9_.:{}-]{1,64}")


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits per minute; None: that kind is not limited."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the shared counters are: TCP `host:port` and database, or a Unix socket's path."""

    host: str = ""
    port: int = 6379
    path: str = ""
    db: int = 0

    def __str__(self) -> str:
        where = f"unix://{self.path}" if self.path else f"redis://{self.host}:{self.port}"
        return f"{where}/{self.db}" if self.db else where


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """[limits]: how the tenants' limits are enforced and where their counters live."""

    mode: str = "enforce"
    # A request naming neither max_tokens nor max_completion_tokens is estimated to take this many.
    unbounded_output_tokens: int = 1024
    redis: RedisTarget | None = None
    # One round trip's deadline; past it Redis is unavailable for that request.
    redis_timeout_seconds: float = 0.05
    # What a request gets while Redis is unavailable: admitted unchecked (the default), or refused (503).
    redis_unavailable: str = "admit"
    redis_key_prefix: str = "router:limits:"
    # Each limited tenant's limits (from its keys).
    tenants: Mapping[str, TenantLimit] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def shadow(self) -> bool:
        return self.mode == "shadow"


def parse_redis_url(where: check.Where, key: str, value: object) -> RedisTarget:
    """`redis://host[:port][/db]` or `unix:///path[?db=N]`."""
    text = check.string(where, key, value)
    if text.startswith("unix://"):
        path, _, query = text[len("unix://") :].partition("?")
        db = 0
        if query:
            name, _, number = query.partition("=")
            if name != "db" or not number.isdigit():
                raise where.error(key, f"a unix:// URL may carry only ?db=N, got {query!r}")
            db = int(number)
        if not path.startswith("/"):
            raise where.error(key, f"unix:// needs an absolute socket path (unix:///run/redis.sock), got {text!r}")
        return RedisTarget(path=path, db=db)
    if not text.startswith("redis://"):
        raise where.error(key, f"must be redis://host:port/db or unix:///path (no TLS, no password), got {text!r}")
    rest = text[len("redis://") :]
    if "@" in rest:
        raise where.error(key, "carries credentials: the router's Redis client speaks neither AUTH nor TLS")
    authority, _, db_text = rest.partition("/")
    host, colon, port_text = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "")
    if not colon:
        host, port_text = authority, "6379"
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise where.error(key, f"must be redis://host:port/db, got {text!r}")
    if db_text and not db_text.isdigit():
        raise where.error(key, f"the database must be a number (redis://host:port/0), got {db_text!r}")
    return RedisTarget(host=host, port=int(port_text), db=int(db_text or 0))


def parse_limits(where: check.Where, raw: object, tenants: Mapping[str, TenantLimit]) -> LimitsConfig:
    """The [limits] table (absent: the defaults) with the tenants' limits from their keys."""
    table = check.table(where, "limits", raw if raw is not None else {}, LIMITS_KEYS)
    mode = check.one_of(where, "limits.mode", table.get("mode", "enforce"), LIMIT_MODES)
    unbounded = int(
        check.number(
            where, "limits.unbounded_output_tokens", table.get("unbounded_output_tokens", 1024), minimum=0, integer=True
        )
    )
    redis = parse_redis_url(where, "limits.redis_url", table["redis_url"]) if "redis_url" in table else None
    timeout = check.number(
        where, "limits.redis_timeout_seconds", table.get("redis_timeout_seconds", 0.05), minimum=0.001
    )
    unavailable = check.one_of(where, "limits.redis_unavailable", table.get("redis_unavailable", "admit"), UNAVAILABLE)
    prefix = check.string(where, "limits.redis_key_prefix", table.get("redis_key_prefix", "router:limits:"))
    if not _PREFIX.fullmatch(prefix):
        raise where.error("limits.redis_key_prefix", f"letters, digits and _.:{{}}- only, at most 64, got {prefix!r}")
    return LimitsConfig(mode, unbounded, redis, float(timeout), unavailable, prefix, MappingProxyType(dict(tenants)))


def per_minute(where: check.Where, key: str, table: Mapping[str, Any]) -> int | None:
    """A key's `tokens_per_minute` or `requests_per_minute` (key names which): a whole number above 0, or None."""
    name = key.rpartition(".")[2]
    if name not in table:
        return None
    return int(check.number(where, key, table[name], minimum=1, integer=True))


def tenant_limits(where: check.Where, keys: Iterable[Any]) -> dict[str, TenantLimit]:
    """Each tenant's limits from its keys (ClientKey): every key of a tenant says the same, or nothing."""
    found: dict[str, tuple[TenantLimit, str]] = {}
    for client_key in keys:
        limit = TenantLimit(client_key.tokens_per_minute, client_key.requests_per_minute)
        if limit == TenantLimit():
            continue
        known = found.setdefault(client_key.tenant, (limit, client_key.name))
        if known[0] != limit:
            raise where.error(
                client_key.name,
                f"tenant {client_key.tenant!r} has other limits in {known[1]}: one tenant, one limit "
                "(write them on every key of the tenant alike)",
            )
    # A key of the tenant with no limits is still the tenant's: it shares them.
    return {tenant: limit for tenant, (limit, _) in found.items()}


def limits_of(where: check.Where, raw: object, keys: Iterable[Any], counting: bool) -> LimitsConfig | None:
    """[limits] with the tenants' limits; None when no key limits its tenant (nothing of it then runs)."""
    tenants = tenant_limits(where, keys)
    limits = parse_limits(where, raw, tenants)
    if not counting:
        for client_key in keys:
            if client_key.tokens_per_minute is not None:
                raise where.error(
                    f"{client_key.name}.tokens_per_minute",
                    "needs count_tokens = true: a token limit is settled with each answer's usage, "
                    "which only counting reads (docs/limits.md)",
                )
    return limits if tenants else None
