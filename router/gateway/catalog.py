"""The names clients may ask for (models, aliases, fallbacks), and `GET /v1/models`."""

from __future__ import annotations

from typing import Any

import orjson

from router.core.config import Config
from router.core.errors import ClientFacingError, ModelNotFound, quoted
from router.core.pool import Pool
from router.gateway.answers import JSON, error_response
from router.gateway.keys import ApiKeys
from router.http.messages import Reply, Request


class Routes:
    """Which names clients may ask for, and where each leads."""

    def __init__(self, config: Config) -> None:
        self.aliases: dict[str, str] = {}
        self.fallbacks: dict[str, tuple[str, ...]] = {}
        self.declared: set[str] = set()
        for name, model in config.models.items():
            self.declared.add(name)
            self.fallbacks[name] = model.fallbacks
            for alias in model.aliases:
                self.aliases[alias] = name


class Catalog:
    """`GET /v1/models` and `/v1/models/{model}`: the models with a replica now, and their aliases."""

    def __init__(self, pool: Pool, routes: Routes, keys: ApiKeys, created: int) -> None:
        self.pool = pool
        self.routes = routes
        self.keys = keys
        self.created = created

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
        return names

    def _doc(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "router"}
