"""OpenAI-shaped answers: every error the router makes, and a replica's errors reshaped.

Every error a client can get from the router is `{"error": {"message",
"type", "param", "code"}}`, made here and nowhere else; a replica's error
that lacks that shape gets it, keeping the replica's status and words. Its
words are read under its Content-Encoding (router.gateway.codings): an error the
router cannot read is passed on as it came, never reshaped as if it were
text, and a reshaped one no longer names the replica's coding.
"""

from __future__ import annotations

import orjson

from router.core.errors import ClientFacingError
from router.gateway.codings import decoded
from router.http.messages import Reply

JSON = (b"Content-Type", b"application/json")

# The most an error's words may decode to; past it the answer is not read,
# and goes on as the replica sent it.
ERROR_TEXT_BYTES = 1 << 20


def error_body(status: int, message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(exc: ClientFacingError) -> Reply:
    headers = [JSON]
    if exc.retry_after is not None:
        headers.append((b"Retry-After", b"%d" % exc.retry_after))
    if exc.status == 401:
        # RFC 9110 11.6.1: a 401 names the scheme that would be accepted.
        headers.append((b"WWW-Authenticate", b"Bearer"))
    return Reply(exc.status, error_body(exc.status, exc.message, exc.type, exc.code, exc.param), headers)


def server_error(status: int, message: str, *, code: str | None = None) -> Reply:
    """The server's own answers (unparsable request, body too large, handler failure)."""
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return Reply(status, error_body(status, message, type_, code), [JSON])


def openai_shaped(body: bytes, status: int) -> bytes | None:
    """None if `body` already is an OpenAI error; else the body wrapped into one."""
    text = body.decode("utf-8", "replace").strip()
    message = text
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return None
        for key in ("message", "detail", "error"):
            value = parsed.get(key)
            if isinstance(value, str) and value:
                message = value
                break
    if not message:
        message = f"The replica answered {status} with an empty body."
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return error_body(status, message[:4096], type_, None)


def content_encoding(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """Every Content-Encoding field's value, joined as one list; None when there is none."""
    values = [value for name, value in headers if name.lower() == b"content-encoding"]
    return b", ".join(values) if values else None


def replica_answer(status: int, reason: bytes, data: bytes, headers: list[tuple[bytes, bytes]]) -> Reply:
    """A replica's whole answer for the client; an error gets OpenAI's shape if it lacks it and can be read."""
    if status >= 400:
        text = decoded(data, content_encoding(headers), ERROR_TEXT_BYTES)
        wrapped = openai_shaped(text, status) if text is not None else None
        if wrapped is not None:
            data = wrapped
            headers = [h for h in headers if h[0].lower() not in (b"content-type", b"content-encoding")]
            headers.append(JSON)
    return Reply(status, data, headers, reason)
