"""The router's exception tree.

    RouterError
    ├── ConfigError              a config file or pushed replica set is invalid
    │   └── CannotListen         an address of the config is in use, or not this host's
    └── ClientFacingError        becomes one OpenAI-shaped error body (proxy.py)
        ├── BadRequest           400 invalid_request_error
        ├── Unauthorized         401 invalid_api_key
        ├── ModelNotFound        404 model_not_found
        ├── ResponseNotFound     404 a response id this router did not see, or whose replica is gone
        ├── BodyTooLarge         413 request_too_large
        ├── RateLimited          429 rate_limit_exceeded: the tenant's share of a model's queue is full (Retry-After)
        ├── NoReplicaAvailable   503 no replica of the model (or its fallbacks) can serve
        ├── ModelCold            503 held past cold_start_seconds, or max_held reached (Retry-After)
        ├── Overloaded           503 every replica at its limit past the queue wait
        └── UpstreamError        a replica failed; `reason` labels the metric
            ├── UpstreamConnectError   502 could not connect
            ├── UpstreamResetError     502 connection closed or broken mid-answer
            └── UpstreamTimeout        504 no response head within the first-byte timeout

Library errors (aiohttp, OSError, orjson) are translated into this tree at the
boundary where they happen, with `raise ... from exc`; only the proxy turns the
tree into response bodies, in one place.
"""

from __future__ import annotations

import os

# What a message quotes of a name the client sent: enough to recognise it,
# never the megabyte a client may send as a model name or a response id.
QUOTED_CHARS = 256


def quoted(value: object) -> str:
    """`value` in quotes for an error message, cut to QUOTED_CHARS characters.

    A client's value that is not a string or a number is named by its kind,
    never printed: repr() of a list nested a thousand deep (orjson reads
    1,024 levels) raises RecursionError, and of a wide one costs its size.
    """
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, bool | int | float):
        text = repr(value)
    else:
        return f"(a JSON {_KINDS.get(type(value), type(value).__name__)})"
    if len(text) > QUOTED_CHARS:
        return f"'{text[:QUOTED_CHARS]}...' ({len(text)} characters)"
    return f"'{text}'"


_KINDS: dict[type, str] = {dict: "object", list: "array"}


class RouterError(Exception):
    """Base of everything the router raises on purpose."""


class ConfigError(RouterError):
    """One line naming the source, the key and the problem."""


class CannotListen(ConfigError):
    """An address the config names (`key`: listen, admin_listen) cannot be listened on: in use, or not this host's."""

    def __init__(self, source: str, key: str, address: str, exc: OSError) -> None:
        # The OS's words, without asyncio's "error while attempting to bind on address (...)".
        self.reason = os.strerror(exc.errno) if exc.errno else str(exc)
        self.key = key
        self.address = address
        super().__init__(f"{source}: {key}: cannot listen on {address}: {self.reason}")


class ClientFacingError(RouterError):
    """An error the client gets as one OpenAI-shaped body, with its status and code."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # Seconds after which trying again makes sense: the Retry-After header.
        self.retry_after = retry_after


class BadRequest(ClientFacingError):
    """400 invalid_request_error: the request itself is wrong."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(ClientFacingError):
    """401 invalid_api_key: no key, or not one of api_keys."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(ClientFacingError):
    """404 model_not_found: no model of that name is declared or served."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ResponseNotFound(ClientFacingError):
    """404: a response id this router did not see, or whose replica is gone."""

    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class BodyTooLarge(ClientFacingError):
    """413 request_too_large: the body is over max_body_bytes."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(ClientFacingError):
    """429 rate_limit_exceeded: the tenant's share of a model's queue is full."""

    status = 429
    # OpenAI's own for a limit on the number of requests.
    type = "requests"
    code = "rate_limit_exceeded"


class NoReplicaAvailable(ClientFacingError):
    """503: no replica of the model, or of its fallbacks, can serve now."""

    status = 503
    type = "server_error"
    code = "no_replica_available"


class ModelCold(ClientFacingError):
    """503 model_cold: held past cold_start_seconds, or max_held reached."""

    status = 503
    type = "server_error"
    code = "model_cold"


class Overloaded(ClientFacingError):
    """503 server_overloaded: every replica at its limit past the queue wait."""

    status = 503
    type = "server_error"
    code = "server_overloaded"


class UpstreamError(ClientFacingError):
    """A replica failed; `reason` labels the metric."""

    status = 502
    type = "server_error"
    code = "upstream_error"
    reason = "error"


class UpstreamConnectError(UpstreamError):
    """502: no connection to the replica."""

    reason = "connect"


class UpstreamResetError(UpstreamError):
    """502: the replica closed or broke the connection before its answer was whole."""

    reason = "reset"


class UpstreamTimeout(UpstreamError):
    """504: no response head within the first-byte timeout."""

    status = 504
    code = "upstream_timeout"
    reason = "timeout"
