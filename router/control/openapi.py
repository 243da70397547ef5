"""The admin API's OpenAPI document, served at GET /api/v1/openapi.json."""

from __future__ import annotations

from typing import Any

from router import __version__
from router.core.config.engines import ENGINES

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_REPLICA = {
    "type": "object",
    "required": ["id", "model", "url"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "model": {"type": "string", "minLength": 1},
        "url": {"type": "string", "description": "http(s) base URL; /v1/... is appended"},
        "labels": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}},
        "engine": {
            "type": "string",
            "enum": list(ENGINES),
            "description": "the engine it runs, whose load is read; absent: recognised from its /metrics",
        },
        "node": {
            "type": "string",
            "minLength": 1,
            "maxLength": 253,
            "description": "the node (machine) it runs on; absent: not said (status counts it under no_node)",
        },
        "fabric": {
            "type": "string",
            "minLength": 1,
            "maxLength": 253,
            "description": "the interconnect fabric of its node; status's `fabrics` groups the nodes by it",
        },
    },
}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(properties: dict[str, Any]) -> dict[str, Any]:
    """A required JSON object body with exactly these fields, all required."""
    schema = {"type": "object", "required": list(properties), "additionalProperties": False, "properties": properties}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": _json({"$ref": "#/components/schemas/Error"}, "Invalid request; the message names the problem"),
    "401": _json({"$ref": "#/components/schemas/Error"}, "Admin token missing or wrong"),
}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "router admin API", "version": __version__},
    "components": {
        "schemas": {"Error": _ERROR, "Replica": _REPLICA},
        "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
    },
    "paths": {
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": _json({"type": "object"})}}},
        "/readyz": {
            "get": {
                "summary": "Readiness (503 while starting or shutting down)",
                "responses": {"200": _json({"type": "object"}), "503": _json({"type": "object"}, "Not ready")},
            }
        },
        "/api/v1/usage": {
            "get": {
                "summary": "The usage map; a replica absent from last_used is unknown, not idle",
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": [
                                "router",
                                "started_at",
                                "generated_at",
                                "tick_seconds",
                                "last_used",
                                "watching_since",
                            ],
                            "properties": {
                                "router": {"type": "string"},
                                "started_at": {"type": "number"},
                                "generated_at": {"type": "number"},
                                "tick_seconds": {"type": "number"},
                                "last_used": {"type": "object", "additionalProperties": {"type": "number"}},
                                "watching_since": {"type": "object", "additionalProperties": {"type": "number"}},
                                "model": {"type": "object", "additionalProperties": {"type": "string"}},
                            },
                        }
                    )
                },
            }
        },
        "/api/v1/replicas": {
            "get": {
                "summary": "One object per replica",
                "responses": {
                    "200": _json(
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "serves_model": {
                                        "type": ["boolean", "null"],
                                        "description": "whether its /v1/models lists the model the router sends "
                                        "it (false: its engine answers 404); null: not read, or an engine that "
                                        "answers under any name",
                                    }
                                },
                            },
                        }
                    )
                },
            }
        },
        "/api/v1/status": {
            "get": {
                "summary": "The fleet summary",
                "parameters": [
                    {"name": "idle_for", "in": "query", "required": False, "schema": {"type": "number", "minimum": 0}},
                    {
                        "name": "replicas",
                        "in": "query",
                        "required": False,
                        "description": "true: also the rows of /api/v1/replicas, from the same snapshot",
                        "schema": {"type": "boolean", "default": False},
                    },
                ],
                "responses": {"200": _json({"type": "object"}), "400": _ERRORS["400"]},
            }
        },
        "/api/v1/endpoints": {
            "get": {"summary": "The current replica set", "responses": {"200": _json({"type": "object"})}},
            "put": {
                "summary": "Replace the whole replica set; answers the diff",
                "security": [{"adminToken": []}],
                "requestBody": _body(
                    {"replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}}}
                ),
                "responses": {"200": _json({"type": "object"}), **_ERRORS},
            },
        },
        "/api/v1/replicas/{id}/state": {
            "post": {
                "summary": "Drain a replica or put it back",
                "security": [{"adminToken": []}],
                "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "requestBody": _body({"state": {"enum": ["draining", "ready"]}}),
                "responses": {
                    "200": _json({"type": "object"}),
                    "404": _json({"$ref": "#/components/schemas/Error"}, "No such replica"),
                    **_ERRORS,
                },
            }
        },
        "/metrics": {"get": {"summary": "Prometheus text", "responses": {"200": {"description": "OK"}}}},
    },
}
