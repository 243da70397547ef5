"""Who a request is for and how soon it goes when its model is full: tenants, keys and priority classes.

A client key (`api_keys`) names a tenant, the priority class of its requests
and the tenant's weight; without keys every request is tenant `default`, of
the first class. While a model's replicas are all at their limits its
requests wait (router.core.pool.fairness): a higher class first, a lower one aged
past its `max_queue_seconds`, and within a class the tenants in proportion
to their weights. A request may lower its own class, never raise it
(`lowered`).

Only a key's SHA-256 is kept, never the key: nothing the router logs, counts
or shows can carry it, only the tenant's name.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from router.core.config import checks as check
from router.core.config.limits import per_minute

DEFAULT_TENANT = "default"
# A tenant's and a class's name is a label value, an access-log field and a
# header's value: short, printable, no spaces.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CLASS_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_KEY_KEYS = {"key", "key_sha256", "tenant", "priority", "weight", "tokens_per_minute", "requests_per_minute"}
_CLASS_KEYS = {"name", "queue_timeout_seconds", "max_queue_seconds"}
# The class of batch work when no [[priority_classes]] is declared: it may wait
# this long (or queue_timeout_seconds, if longer), and is aged at half of it.
BATCH_QUEUE_TIMEOUT_SECONDS = 60.0
# What a tenant's share of a full model counts (`fairness_unit`).
FAIRNESS_UNITS = ("requests", "tokens")
# With tokens: a turn of a tenant of the smallest weight is worth this many tokens. Large
# enough that most turns serve a whole request, small enough that a turn is short.
QUANTUM_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is for, as its key says: the tenant, its weight, and the rank of its class (0 the first)."""

    tenant: str
    weight: float = 1.0
    priority: int = 0


# A request when no key is configured, or a key of the list form.
ANYONE = Caller(DEFAULT_TENANT)


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One client key of `api_keys`: its SHA-256 (never the key), and whose requests it makes."""

    # The table's name, or `api_keys[i]` for the list form: what a message may name.
    name: str
    sha256: bytes
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    # A class name of priority_classes; None: the first class.
    priority: str | None = None
    # The tenant's rate limits (router.core.config.limits); None: not limited by this key.
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """One class of [[priority_classes]], highest first."""

    name: str
    # How long its requests may wait for a slot before 503 server_overloaded.
    queue_timeout_seconds: float
    # A request of the class that has waited this long is served before the
    # higher classes' (aging: no starvation). None for the first class, which
    # nothing is served before, and for a class that never waits.
    max_queue_seconds: float | None = None


def default_classes(queue_timeout: float) -> tuple[PriorityClass, ...]:
    """`interactive` and `batch`, when no [[priority_classes]] is declared."""
    batch = max(BATCH_QUEUE_TIMEOUT_SECONDS, queue_timeout)
    return (PriorityClass("interactive", queue_timeout), PriorityClass("batch", batch, batch / 2))


DEFAULT_CLASSES = default_classes(5.0)


@dataclass(frozen=True, slots=True)
class Queueing:
    """How a model's waiting requests are ordered: the classes, and the bound per tenant."""

    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    # Per model and tenant, requests waiting at once; 0: no bound.
    max_queued_per_tenant: int = 0
    # The smallest weight of any tenant. A tenant's turn serves weight / unit_weight
    # requests (at least one), so that a pick never passes over a tenant in vain.
    unit_weight: float = 1.0
    # "tokens": a request costs its estimate (router.core.pool.waiters.Charge), not one.
    unit: str = "requests"
    # With tokens: an output token counts this many prompt tokens.
    output_weight: float = 4.0


def parse_api_keys(where: check.Where, key: str, value: object) -> tuple[ClientKey, ...]:
    """`api_keys`: a list of keys (tenant `default`), or a table of named keys with their tenant and class."""
    if isinstance(value, list):
        keys = check.string_list(where, key, value)
        found = tuple(ClientKey(f"{key}[{i}]", _digest(k)) for i, k in enumerate(keys))
    elif isinstance(value, dict):
        found = tuple(_table_key(where, f"{key}.{name}", name, raw) for name, raw in value.items())
    else:
        raise where.error(
            key, f"must be an array of strings or a table of named keys ([{key}.NAME]), got {check.type_name(value)}"
        )
    seen: dict[bytes, str] = {}
    weights: dict[str, tuple[float, str]] = {}
    for client_key in found:
        if client_key.sha256 in seen:
            # Never the key itself in a message: only where it was written.
            raise where.error(client_key.name, f"is the same key as {seen[client_key.sha256]}")
        seen[client_key.sha256] = client_key.name
        known = weights.setdefault(client_key.tenant, (client_key.weight, client_key.name))
        if known[0] != client_key.weight:
            raise where.error(
                f"{client_key.name}.weight",
                f"tenant {client_key.tenant!r} has weight {known[0]:g} in {known[1]}: one tenant, one weight",
            )
    return found


def _table_key(where: check.Where, key: str, name: str, raw: object) -> ClientKey:
    table = check.table(where, key, raw, _KEY_KEYS)
    if ("key" in table) == ("key_sha256" in table):
        raise where.error(key, "needs exactly one of key and key_sha256 (the key's SHA-256, hex: better kept)")
    if "key" in table:
        digest = _digest(check.string(where, f"{key}.key", table["key"]))
    else:
        text = check.string(where, f"{key}.key_sha256", table["key_sha256"])
        if not _SHA256_HEX.fullmatch(text):
            raise where.error(f"{key}.key_sha256", "must be 64 hexadecimal digits (`printf %s KEY | sha256sum`)")
        digest = bytes.fromhex(text)
    tenant = check.string(where, f"{key}.tenant", table.get("tenant", name))
    if not _NAME.fullmatch(tenant):
        raise where.error(
            f"{key}.tenant" if "tenant" in table else key,
            f"a tenant's name is letters, digits, '.', '_' and '-', at most 64, got {tenant!r}",
        )
    weight = float(check.number(where, f"{key}.weight", table.get("weight", 1.0), minimum=0.001))
    priority = check.string(where, f"{key}.priority", table["priority"]) if "priority" in table else None
    tokens = per_minute(where, f"{key}.tokens_per_minute", table)
    requests = per_minute(where, f"{key}.requests_per_minute", table)
    return ClientKey(key, digest, tenant, weight, priority, tokens, requests)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_priority_classes(where: check.Where, value: object, queue_timeout: float) -> tuple[PriorityClass, ...]:
    """[[priority_classes]], highest first; `queue_timeout` is queue_timeout_seconds, each class's default."""
    if value is None:
        return default_classes(queue_timeout)
    if not isinstance(value, list) or not value:
        raise where.error(
            "priority_classes", "must be one or more [[priority_classes]] tables, highest first, each with a name"
        )
    found: list[PriorityClass] = []
    for i, raw in enumerate(value):
        key = f"priority_classes[{i}]"
        table = check.table(where, key, raw, _CLASS_KEYS)
        if "name" not in table:
            raise where.error(f"{key}.name", "is required")
        name = check.string(where, f"{key}.name", table["name"])
        if not _CLASS_NAME.fullmatch(name):
            raise where.error(f"{key}.name", f"is lower-case letters, digits, '_' and '-', at most 32, got {name!r}")
        if any(c.name == name for c in found):
            raise where.error(f"{key}.name", f"{name!r} is declared twice")
        timeout = check.number(
            where, f"{key}.queue_timeout_seconds", table.get("queue_timeout_seconds", queue_timeout), minimum=0.0
        )
        aged: float | None = None
        if i == 0 and "max_queue_seconds" in table:
            raise where.error(f"{key}.max_queue_seconds", "the first class is served first already: nothing to age")
        if i > 0 and timeout > 0:
            aged = check.number(
                where, f"{key}.max_queue_seconds", table.get("max_queue_seconds", timeout / 2), minimum=0.001
            )
            if aged >= timeout:
                raise where.error(
                    f"{key}.max_queue_seconds",
                    f"must be below the class's queue_timeout_seconds ({timeout:g}), or its requests are refused "
                    "before they are ever aged",
                )
        found.append(PriorityClass(name, float(timeout), None if aged is None else float(aged)))
    return tuple(found)


def check_key_classes(where: check.Where, keys: tuple[ClientKey, ...], classes: tuple[PriorityClass, ...]) -> None:
    """Every key's class is one of priority_classes."""
    names = [c.name for c in classes]
    for client_key in keys:
        if client_key.priority is not None and client_key.priority not in names:
            known = ", ".join(repr(n) for n in names)
            raise where.error(f"{client_key.name}.priority", f"unknown class {client_key.priority!r} (known: {known})")


def callers(keys: tuple[ClientKey, ...], classes: tuple[PriorityClass, ...]) -> dict[bytes, Caller]:
    """Each key's SHA-256 and whose requests it makes (check_key_classes has passed)."""
    ranks = {c.name: rank for rank, c in enumerate(classes)}
    return {k.sha256: Caller(k.tenant, k.weight, 0 if k.priority is None else ranks[k.priority]) for k in keys}


def unit_weight(keys: tuple[ClientKey, ...]) -> float:
    """The smallest weight of any tenant (1 without keys)."""
    return min((k.weight for k in keys), default=1.0)


def lowered(priority: int, header: bytes | None, body_priority: object, ranks: Mapping[bytes, int]) -> int:
    """A request's class: its key's (`priority`), lowered, never raised, by what the request says.

    `header` is X-Priority's value, a class name (`ranks`: each lower-case
    name's rank); a name that is no class changes nothing. `body_priority`
    is the body's `priority` as vLLM reads it (lower is sooner): a number
    above 0 puts the request in the second class at least (`batch` of the
    default two). Neither can raise a key's class: a client cannot buy its
    way up by asking.
    """
    rank = priority
    if header is not None:
        named = ranks.get(header.strip().lower())
        if named is not None and named > rank:
            rank = named
    if (
        isinstance(body_priority, int | float)
        and not isinstance(body_priority, bool)
        and math.isfinite(body_priority)
        and body_priority > 0
        and len(ranks) > 1
        and rank < 1
    ):
        rank = 1
    return rank
