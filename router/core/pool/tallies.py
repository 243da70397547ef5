"""Per-model figures of the data path that belong to no replica, and the names a client may have kept.

A model name in a request comes from the client: it is counted and shown
(a Prometheus label, a row of `ctl status`) only when it could name a model,
and only so many distinct ones, so that no client can grow a tally without
bound.
"""

from __future__ import annotations

from collections.abc import Mapping

# Demand for model names that nobody serves comes from clients and is unbounded;
# past this many distinct names the rest are tallied under one label value.
MAX_UNSERVED_NAMES = 100
# With --workers that bound is the supervisor's, applied once the workers'
# tallies are merged (`bounded_unserved`): a worker counts this many names
# exactly, so that a name one worker saw late still adds up whole. Only past
# this (a client making names up by the thousand) does a worker's count of a
# shown name fall short.
WORKER_UNSERVED_NAMES = 10_000
# ... and so is each name's size: a name is kept (a label, a tally, a row of
# `ctl status`) only when it could name a model: printable and at most this
# many bytes. Hugging Face repo ids stop at 96 characters; a local path may
# run longer, and 256 bytes covers both. Entries times bytes bounds the tally.
MAX_NAME_BYTES = 256
OTHER_MODELS = "__other__"
# Tenants are the names of api_keys' tables, so the config bounds them; a
# deployment with thousands of keys would still make thousands of series per
# model and kind. Past this many distinct tenants (the first ones seen keep
# their own), tokens are tallied under OTHER_TENANTS.
MAX_TOKEN_TENANTS = 100
OTHER_TENANTS = "__other__"
# The kinds of router_tokens_total, in the order Tallies.tokens keeps them.
TOKEN_KINDS = ("prompt", "cached", "completion")


def bounded_unserved(counts: Mapping[str, int], kept: dict[str, None]) -> dict[str, int]:
    """`counts` with at most MAX_UNSERVED_NAMES names, the rest under OTHER_MODELS; each name's count whole.

    `kept` (ordered) are the names shown so far, and gains the new ones while
    there is room, in the order of `counts`: a name once shown stays shown,
    and one left out stays out, so that no series comes and goes and the
    sum under OTHER_MODELS never goes down.
    """
    bounded: dict[str, int] = {}
    other = 0
    for name, count in counts.items():
        if name != OTHER_MODELS and (name in kept or len(kept) < MAX_UNSERVED_NAMES):
            kept[name] = None
            bounded[name] = count
        else:
            other += count
    if other:
        bounded[OTHER_MODELS] = other
    return bounded


def keepable_name(name: str) -> bool:
    """Whether a name a client sent may be kept and shown: printable, at most MAX_NAME_BYTES in UTF-8."""
    # isprintable() first: it refuses lone surrogates, which cannot be encoded.
    return len(name) <= MAX_NAME_BYTES and name.isprintable() and len(name.encode()) <= MAX_NAME_BYTES


class TokenRow:
    """One tenant's tokens of one model, added to in place at the end of each counted answer.

    A class of its own, not a list: compiled, each count is a field of a struct added to,
    where a list's item is read, boxed and stored again.
    """

    __slots__ = ("cached", "completion", "prompt", "said", "unknown")

    def __init__(self) -> None:
        # The tokens the answers said they took (TOKEN_KINDS).
        self.prompt = 0
        self.cached = 0
        self.completion = 0
        # The answers that said nothing readable of them (unknown, not 0).
        self.unknown = 0
        # The answers that said them: whether the row has token series at all.
        self.said = 0

    def counts(self) -> tuple[int, int, int]:
        """The tokens, in TOKEN_KINDS' order."""
        return (self.prompt, self.cached, self.completion)


class Tallies:
    """Per-model figures of the data path that belong to no replica."""

    __slots__ = (
        "affinity",
        "fallbacks",
        "hold_outcomes",
        "hold_probes",
        "last_asked",
        "max_unserved_names",
        "overloaded",
        "retries",
        "stalled",
        "token_rows",
        "unserved",
    )

    def __init__(self, max_unserved_names: int = MAX_UNSERVED_NAMES) -> None:
        # Distinct names counted in `unserved` (a worker's: WORKER_UNSERVED_NAMES).
        self.max_unserved_names = max_unserved_names
        # First picks of the session and prefix policies per model: [hit, spill, none]
        # (picking.AFFINITY_OUTCOMES), counted by the model's policy itself.
        self.affinity: dict[str, list[int]] = {}
        # Held requests' ends, by (model, outcome): served, timeout, overflow, client_gone, shutdown.
        self.hold_outcomes: dict[tuple[str, str], int] = {}
        # Held requests' tries of a cold model's replicas, by (model, outcome): refused
        # (connection refused), loading (503), answered (anything else: the request's attempt).
        self.hold_probes: dict[tuple[str, str], int] = {}
        # Monotonic time a request for the model last found nothing to serve it (held, or refused).
        self.last_asked: dict[str, float] = {}
        self.overloaded: dict[str, int] = {}
        self.stalled: dict[str, int] = {}
        self.retries: dict[str, int] = {}
        self.fallbacks: dict[tuple[str, str], int] = {}
        self.unserved: dict[str, int] = {}
        # By tenant, then model, one row added to in place (the end of a counted stream finds it in
        # two lookups of names, no key made).
        self.token_rows: dict[str, dict[str, TokenRow]] = {}

    def retried(self, model: str) -> None:
        self.retries[model] = self.retries.get(model, 0) + 1

    def refused_overloaded(self, model: str) -> None:
        self.overloaded[model] = self.overloaded.get(model, 0) + 1

    def client_stalled(self, model: str) -> None:
        self.stalled[model] = self.stalled.get(model, 0) + 1

    def fell_back(self, model: str, to: str) -> None:
        key = (model, to)
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1

    def hold_ended(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.hold_outcomes[key] = self.hold_outcomes.get(key, 0) + 1

    def hold_probed(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.hold_probes[key] = self.hold_probes.get(key, 0) + 1

    def _token_row(self, model: str, tenant: str) -> TokenRow:
        """`model`'s row of `tenant`'s, made when first counted; past MAX_TOKEN_TENANTS tenants, OTHER_TENANTS'."""
        rows = self.token_rows
        by_model = rows.get(tenant)
        if by_model is None:
            if len(rows) - (OTHER_TENANTS in rows) >= MAX_TOKEN_TENANTS:
                tenant = OTHER_TENANTS
            by_model = rows.get(tenant)
            if by_model is None:
                by_model = rows[tenant] = {}
        row = by_model.get(model)
        if row is None:
            row = by_model[model] = TokenRow()
        return row

    def count_tokens(self, model: str, tenant: str, prompt: int, cached: int | None, completion: int) -> None:
        """An answer of `model` for `tenant` said it took these tokens (`cached` None: it did not say)."""
        by_model = self.token_rows.get(tenant)
        row = None if by_model is None else by_model.get(model)
        if row is None:
            row = self._token_row(model, tenant)
        row.prompt += prompt
        if cached is not None:
            row.cached += cached
        row.completion += completion
        row.said += 1

    def count_unknown_usage(self, model: str, tenant: str) -> None:
        """An answer of `model` for `tenant` said nothing readable of its tokens."""
        by_model = self.token_rows.get(tenant)
        row = None if by_model is None else by_model.get(model)
        if row is None:
            row = self._token_row(model, tenant)
        row.unknown += 1

    def token_counts(self) -> dict[tuple[str, str, str], int]:
        """The tokens by (model, tenant, kind), as the snapshot keeps them: of rows with an answer that said them."""
        return {
            (model, tenant, kind): n
            for tenant, by_model in self.token_rows.items()
            for model, row in by_model.items()
            if row.said
            for kind, n in zip(TOKEN_KINDS, row.counts(), strict=True)
        }

    def unknown_counts(self) -> dict[tuple[str, str], int]:
        """Answers that said nothing readable of their tokens, by (model, tenant)."""
        return {
            (model, tenant): row.unknown
            for tenant, by_model in self.token_rows.items()
            for model, row in by_model.items()
            if row.unknown
        }

    def unserved_request(self, model: str) -> None:
        if model not in self.unserved and (len(self.unserved) >= self.max_unserved_names or not keepable_name(model)):
            model = OTHER_MODELS
        self.unserved[model] = self.unserved.get(model, 0) + 1

    def asked(self, model: str, now: float) -> None:
        """A request for `model` found nothing to serve it at `now`: demand the control plane should see."""
        last_asked = self.last_asked
        if model in last_asked or len(last_asked) < MAX_UNSERVED_NAMES:
            last_asked[model] = now
