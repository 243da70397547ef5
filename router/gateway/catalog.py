"""The names clients may ask for (models, aliases, fallbacks), and `GET /v1/models`."""

from __future__ import annotations

from typing import Any

import orjson

from router.core.config.cards import Cards
from router.core.config.settings import Config
from router.core.errors import BadRequest, ClientFacingError, ModelNotFound, quoted
from router.core.pool.pool import Pool
from router.gateway.answers import JSON, error_response
from router.gateway.keys import ApiKeys
from router.http.messages import Reply, Request


class Routes:
    """Which names clients may ask for, and where each leads."""

    def __init__(self, config: Config) -> None:
        self.aliases: dict[str, str] = {}
        self.fallbacks: dict[str, tuple[str, ...]] = {}
        self.declared: set[str] = set()
        # Where a request that names no model goes; None: the only model served, if there is one.
        self.default_model = config.default_model or None
        for name, model in config.models.items():
            self.declared.add(name)
            self.fallbacks[name] = model.fallbacks
            for alias in model.aliases:
                self.aliases[alias] = name

    def unnamed(self, pool: Pool) -> str:
        """The name a request that names no model is served under: default_model, else the
        only model served; a 400 naming the models served when there is no telling."""
        if self.default_model is not None:
            return self.default_model
        served = pool.models()
        if len(served) == 1:
            return served[0]
        names = ", ".join(quoted(name) for name in sorted(served)) or "none"
        raise BadRequest(
            f"The request names no model and no default_model is set; name one of the models served: {names}.",
            param="model",
        )


class Catalog:
    """`GET /v1/models` and `/v1/models/{model}`: the models with a replica now, their aliases, and the
    LoRA adapters their replicas list."""

    def __init__(self, pool: Pool, routes: Routes, keys: ApiKeys, created: int) -> None:
        self.pool = pool
        self.routes = routes
        self.keys = keys
        self.created = created
        # What the replicas' own /v1/models say of each model (read by router.control.cards).
        self.cards = Cards()

    def models(self, request: Request) -> Reply:
        try:
            self.keys.check(request)
        except ClientFacingError as exc:
            return error_response(exc)
        data = [self._doc(name) for name in self.names()]
        return Reply(200, orjson.dumps({"object": "list", "data": data}), [JSON])

    def model_info(self, request: Request, name: str) -> Reply:
        """GET /v1/models/{model}: one entry of the catalog (the SDK's models.retrieve)."""
        try:
            self.keys.check(request)
            if name not in self.names():
                raise ModelNotFound(f"The model {quoted(name)} does not exist or no replica serves it.", param="model")
        except ClientFacingError as exc:
            return error_response(exc)
        return Reply(200, orjson.dumps(self._doc(name)), [JSON])

    def names(self) -> list[str]:
        names = self.pool.models()
        names += [alias for alias, target in self.routes.aliases.items() if self.pool.serves(target)]
        served = set(names)
        names += [adapter for adapter in self.pool.adapters.listed() if adapter not in served]
        return names

    def _doc(self, name: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": name, "object": "model", "created": self.created, "owned_by": "router"}
        if not self.pool.serves(name) and name not in self.routes.aliases:
            base = self.pool.adapters.base_of(name)
            if base is not None:
                # A LoRA adapter's card, as vLLM's: its base model as `parent`.
                doc["parent"] = base
                return doc
        target = self.routes.aliases.get(name)
        card = self.cards.get(name if target is None else target)
        if card is not None:
            doc.update(card.fields())
        if target is not None:
            # An alias's card says what it resolves to, as vLLM's card of a LoRA adapter names its base.
            doc["parent"] = target
        return doc
