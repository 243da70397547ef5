"""A model's settings: its [models."NAME"] table (aliases, fallbacks, routing, holds, saturation), checked."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from router.core.config import checks as check
from router.core.config.upstream import UPSTREAM_KEYS, Upstream, parse_upstream

# The picking policies a model may be routed by (each one of
# router.core.pool.picking.POLICIES, a test holds the two the same): named
# here, so that the settings do not depend on the pool that reads them.
ROUTINGS = ("least_loaded", "session", "prefix")
DEFAULT_ROUTING = "least_loaded"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model's settings: aliases, fallbacks, routing, holding for a cold start."""

    name: str
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    # The picking policy (one of ROUTINGS: router.core.pool.picking.POLICIES) for this model's replicas.
    routing: str = DEFAULT_ROUTING
    # routing = "session": the header that names the session (then the body's
    # `user`, then `previous_response_id`); "prefix": how much of the prompt
    # makes the key. Both: no replica above ceil(balance_factor x mean in flight).
    session_header: str = "X-Session-Id"
    prefix_chars: int = 1024
    # routing = "session": a session's replica is one of about this many around its prompt
    # prefix's place on the ring, so that a conversation's first turn finds its shared
    # system prompt in a prefix cache (0: anywhere, by the session's key alone). "prefix": a
    # prefix's requests share this many replicas (the least loaded of them for each request).
    prefix_replicas: int = 0
    # routing = "prefix": where a prefix's replicas are: "ring" (its place on the hash ring, the
    # same on every router) or "learned" (the least loaded when it was first sent, and where it
    # spilled since: its prompt cached on as few replicas as its load needs).
    prefix_placement: str = "ring"
    balance_factor: float = 1.25
    # Scale from zero: how long a request may be held waiting for a replica
    # that answers (0: a prompt 503 as before), and how many at once.
    cold_start_seconds: float = 0.0
    max_held: int = 100
    # A replica is saturated when its engine's queue (waiting, with what this router sent since
    # the reading) or its KV cache use reaches these: max(waiting / w, kv / k) >= 1. None: the
    # top level's saturated_waiting and saturated_kv.
    saturated_waiting: float | None = None
    saturated_kv: float | None = None
    # The engines' own API key and extra headers, for every replica of it (router.core.config.upstream).
    upstream: Upstream | None = None


_MODEL_KEYS = {
    "aliases",
    "fallbacks",
    "routing",
    "session_header",
    "prefix_chars",
    "prefix_replicas",
    "prefix_placement",
    "balance_factor",
    "cold_start_seconds",
    "max_held",
    "saturated_waiting",
    "saturated_kv",
}

# A header name (RFC 9110 5.1: a token).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# Headers the router itself frames, consumes or sets: never a session's name.
_OWN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "expect",
        "upgrade",
        "authorization",
        "x-request-id",
        "te",
        "trailer",
        "keep-alive",
    }
)


def parse_models(
    where: check.Where, value: object, served: set[str], environ: Mapping[str, str] | None = None
) -> Mapping[str, ModelConfig]:
    """The [models] tables, checked: each model's aliases, fallbacks (to models `served` or declared), routing."""
    if not isinstance(value, dict):
        raise where.error("models", f"must be a table, got {check.type_name(value)}")
    declared = set(value) | served
    alias_owner: dict[str, str] = {}
    out: dict[str, ModelConfig] = {}
    for name, raw in value.items():
        key = f'models."{name}"'
        check.table(where, key, raw, _MODEL_KEYS | UPSTREAM_KEYS)
        upstream = parse_upstream(where, key, raw, os.environ if environ is None else environ)
        aliases = check.string_list(where, f"{key}.aliases", raw.get("aliases", []))
        fallbacks = check.string_list(where, f"{key}.fallbacks", raw.get("fallbacks", []))
        routing = check.string(where, f"{key}.routing", raw.get("routing", DEFAULT_ROUTING))
        cold_start = check.number(where, f"{key}.cold_start_seconds", raw.get("cold_start_seconds", 0.0), minimum=0.0)
        max_held = int(check.number(where, f"{key}.max_held", raw.get("max_held", 100), minimum=1, integer=True))
        if routing not in ROUTINGS:
            known = ", ".join(repr(name) for name in ROUTINGS)
            raise where.error(f"{key}.routing", f"unknown policy {routing!r} (known: {known})")
        session_header = check.string(where, f"{key}.session_header", raw.get("session_header", "X-Session-Id"))
        if not _TOKEN.fullmatch(session_header):
            raise where.error(f"{key}.session_header", f"{session_header!r} is not a valid header name")
        if session_header.lower() in _OWN_HEADERS:
            raise where.error(
                f"{key}.session_header", f"{session_header!r} is a header the router reads or sets itself"
            )
        prefix_chars = check.number(
            where, f"{key}.prefix_chars", raw.get("prefix_chars", 1024), minimum=1, integer=True
        )
        prefix_replicas = int(
            check.number(where, f"{key}.prefix_replicas", raw.get("prefix_replicas", 0), minimum=0, integer=True)
        )
        if prefix_replicas and routing not in ("session", "prefix"):
            needs = f'spreads a prefix over replicas: it needs routing = "session" or "prefix", not {routing!r}'
            raise where.error(f"{key}.prefix_replicas", needs)
        placement = check.string(where, f"{key}.prefix_placement", raw.get("prefix_placement", "ring"))
        if placement not in ("ring", "learned"):
            raise where.error(f"{key}.prefix_placement", f'{placement!r} is not "ring" or "learned"')
        if placement != "ring" and routing != "prefix":
            needs = f'places a prompt prefix: it needs routing = "prefix", not {routing!r}'
            raise where.error(f"{key}.prefix_placement", needs)
        balance_factor = check.number(where, f"{key}.balance_factor", raw.get("balance_factor", 1.25), minimum=1.0)
        bounds = {
            name: float(check.number(where, f"{key}.{name}", raw[name], minimum=0.001)) if name in raw else None
            for name in ("saturated_waiting", "saturated_kv")
        }
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
        out[name] = ModelConfig(
            name=name,
            aliases=aliases,
            fallbacks=fallbacks,
            routing=routing,
            session_header=session_header,
            prefix_chars=int(prefix_chars),
            prefix_replicas=prefix_replicas,
            prefix_placement=placement,
            balance_factor=float(balance_factor),
            cold_start_seconds=float(cold_start),
            max_held=max_held,
            saturated_waiting=bounds["saturated_waiting"],
            saturated_kv=bounds["saturated_kv"],
            upstream=upstream,
        )
    return MappingProxyType(out)
