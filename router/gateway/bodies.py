"""A request body's model name, read once: JSON, or multipart form data without copying its files.

Only `model` and `stream` are looked at; the body is forwarded byte for byte,
except that an alias's or a fallback's request reaches the replica under the
model's own name (with_model), since engines refuse names they do not serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from router.core.errors import BadRequest


def parse_request(body: bytes) -> tuple[dict[str, Any], str | None, bool]:
    """The body as a JSON object, its model name (None: it names none), and whether it asks for a stream."""
    if not body:
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        # Absent or null: the request names no model (vLLM's /tokenize takes such a body), and the
        # gateway picks one; any other value names none the router could ever find.
        if model is None:
            return obj, None, obj.get("stream") is True
        raise BadRequest("The request must name a model: 'model' must be a non-empty string.", param="model")
    return obj, model, obj.get("stream") is True


def parse_form(body: bytes, content_type: bytes | None) -> tuple[dict[str, Any], str | None, bool]:
    """Multipart form data: the `model` field (None: there is none) and `stream`, the file parts never copied."""
    boundary = _boundary(content_type)
    if boundary is None:
        raise BadRequest("The request body looks like multipart form data, but its Content-Type has no boundary.")
    model = form_field(body, boundary, b"model")
    if model is not None and not model.strip():
        raise BadRequest("The request must name a model: the form field 'model' is empty.", param="model")
    stream = form_field(body, boundary, b"stream")
    obj: dict[str, Any] = {"model": model, _FORM: boundary}
    return obj, model, stream is not None and stream.strip().lower() == "true"


# Where parse_form() leaves the boundary, for with_model().
_FORM = "\x00form-boundary"


def _boundary(content_type: bytes | None) -> bytes | None:
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        return None
    for param in content_type.split(b";")[1:]:
        name, _, value = param.strip().partition(b"=")
        if name.lower() == b"boundary" and value:
            return value.strip(b'"')
    return None


def _form_parts(body: bytes, boundary: bytes) -> Iterator[tuple[bytes, int, int]]:
    """(headers, start, end) of each part: the part's bytes are body[start:end], never copied here."""
    delimiter = b"--" + boundary
    position = body.find(delimiter)
    while position >= 0:
        start = position + len(delimiter)
        if body[start : start + 2] == b"--":
            return
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            return
        following = body.find(b"\r\n" + delimiter, head_end + 4)
        if following < 0:
            return
        yield body[start:head_end], head_end + 4, following
        position = following + 2


def form_field(body: bytes, boundary: bytes, name: bytes) -> str | None:
    """A text field of multipart form data; the search skips over file parts without copying them."""
    wanted = b'name="' + name + b'"'
    for headers, start, end in _form_parts(body, boundary):
        if wanted in headers and b"filename=" not in headers:
            return body[start:end].decode("utf-8", "replace")
    return None


def with_model(body: bytes, obj: dict[str, Any], model: str) -> bytes:
    """The body with another model's name (an alias's, a fallback's): re-encoded JSON, or the form field replaced."""
    boundary = obj.get(_FORM)
    if boundary is None:
        try:
            return orjson.dumps({**obj, "model": model})
        except TypeError as exc:
            # orjson writes 255 levels at most, and reads 1,024: a body it
            # read may be too deep to write again under another name.
            raise BadRequest(
                f"The request body is nested too deeply to send under the model's own name ({exc})."
            ) from exc
    for headers, start, end in _form_parts(body, boundary):
        if b'name="model"' in headers and b"filename=" not in headers:
            return body[:start] + model.encode() + body[end:]
    return body
