"""The LoRA adapters each replica serves, and the replicas a request naming one may reach.

An adapter is not a model of the router's configuration: it is a name that
some replicas of a base model answer to, because their engine has loaded it
(vLLM: `--lora-modules`, or `/v1/load_lora_adapter` at run time). Which
replicas do is what each one's `/v1/models` lists (router.control.cards reads
it when a replica joins, and again while it has traffic). A request naming an
adapter is served as a request for its base model, by the base model's
policy, queue and limits, but only ever by a replica that lists the adapter,
and under the adapter's name (the engine applies it). A name that no replica
lists is unknown, as any unknown model is.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.core.pool.replicas import Replica


class Adapters:
    """Which replicas list each adapter name: kept from their /v1/models, pruned of replicas that left."""

    __slots__ = ("_serving",)

    def __init__(self) -> None:
        # Adapter name -> the replicas that listed it when last read (a replica that
        # left is dropped when the name is next looked up).
        self._serving: dict[str, dict[Replica, None]] = {}

    def learn(self, replica: Replica, names: frozenset[str]) -> None:
        """`replica` lists `names` now: adapters it unloaded are no longer sent to it."""
        before = replica.adapters
        if names == before:
            return
        serving = self._serving
        for name in before - names:
            replicas = serving.get(name)
            if replicas is not None:
                replicas.pop(replica, None)
                if not replicas:
                    del serving[name]
        for name in names - before:
            serving.setdefault(name, {})[replica] = None
        replica.adapters = names

    def base_of(self, name: str) -> str | None:
        """The base model an adapter runs on, by a replica that lists it; None: no replica does."""
        replicas = self._serving.get(name)
        if replicas is None:
            return None
        for replica in list(replicas):
            if not replica.removed:
                return replica.model
            del replicas[replica]
        del self._serving[name]
        return None

    def lacking(self, name: str, candidates: Iterable[Replica]) -> set[Replica]:
        """The candidates that do not list `name`: replicas a request for it must not reach."""
        return {replica for replica in candidates if name not in replica.adapters}

    def listed(self) -> dict[str, str]:
        """Every adapter some replica lists, and its base model (the catalog's /v1/models)."""
        out: dict[str, str] = {}
        for name in list(self._serving):
            base = self.base_of(name)
            if base is not None:
                out[name] = base
        return out
