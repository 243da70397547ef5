"""The API server's answers as the watch loop meets them: list bodies, errors, and how to name each in a log line.

kubernetes_asyncio builds the requests; with `_preload_content=False` it
hands over aiohttp's response, whose body is read here and decoded with
orjson (the library's models would cost the event loop some 0.8 s for a
list of 1,000 pods). An answer that is not 2xx becomes the library's
`ApiException`, carrying the API server's `Status`, as the watch's own
errors do; `Gone` is the one of them that only a new list can get past.
"""

from __future__ import annotations

import aiohttp
import orjson
from kubernetes_asyncio.client.exceptions import ApiException


class Gone(Exception):
    """410 Gone: the watch's resourceVersion is too old; only a new list can go on."""


def api_problem(exc: ApiException) -> str:
    """One line from the API server's Status body, if it sent one."""
    message = exc.reason or ""
    body = exc.body
    if body:
        try:
            status = orjson.loads(body)
        except orjson.JSONDecodeError:
            status = None
        if isinstance(status, dict) and isinstance(status.get("message"), str):
            message = status["message"]
    return f"HTTP {exc.status}: {message}".strip()


async def read_body(response: object, kind: str) -> object:
    """A list's JSON; ApiException with the API server's Status for an answer that is not 2xx, or not JSON."""
    # With _preload_content=False the library hands over aiohttp's response
    # (its stubs do not say so) and leaves the status to us: its rest.py
    # checks for 2xx only inside `if _preload_content` (kubernetes_asyncio 36).
    if not isinstance(response, aiohttp.ClientResponse):
        raise TypeError(f"the {kind} list came back as {type(response).__name__}, not an HTTP response")
    async with response:
        body = await response.read()
    if not 200 <= response.status <= 299:
        error = ApiException(status=response.status, reason=response.reason)
        error.body = body
        raise error
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiException(status=response.status, reason=f"the {kind} list is not JSON: {exc}") from exc


def describe(exc: BaseException) -> str:
    """An error that ended a list-and-watch cycle, as a log line quotes it."""
    if isinstance(exc, ApiException):
        return api_problem(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
