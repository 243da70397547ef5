"""The checks of one config value each, and the `file: key: problem` line every mistake becomes.

Each check takes where the value comes from (a `Where`: the file, or the
admin API's push), the key as the operator wrote it, and the raw value; it
returns the value, or raises the ConfigError that names all three. The
router's config (router.core.config.settings) and the scaler's table
(router.scaler.settings) are read with them, so both say a mistake alike.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from router.core.errors import ConfigError


class Where:
    """Builds the `file: key: problem` prefix of every message."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {problem}")


def type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def string(where: Where, key: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise where.error(key, f"must be a string, got {type_name(value)}")
    if not empty_ok and not value.strip():
        raise where.error(key, "must not be empty")
    if any(ch in value for ch in "\r\n\x00"):
        raise where.error(key, "must not contain CR, LF or NUL")
    return value


def boolean(where: Where, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise where.error(key, f"must be true or false, got {type_name(value)}")
    return value


def number(where: Where, key: str, value: object, *, minimum: float, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "an integer" if integer else "a number"
        raise where.error(key, f"must be {kind}, got {type_name(value)}")
    if integer and not isinstance(value, int):
        raise where.error(key, f"must be an integer, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise where.error(key, f"must be at least {minimum:g}, got {value!r}")
    return value


def url(where: Where, key: str, value: object) -> str:
    """A replica base URL: http(s), a host, no credentials, no query or fragment.

    The proxy appends the client's `/v1/...` path to it, so anything that could
    redirect a request elsewhere (userinfo, a query, a fragment) is refused.
    """
    text = string(where, key, value)
    if any(ch.isspace() for ch in text):
        raise where.error(key, f"must not contain whitespace, got {text!r}")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise where.error(key, f"is not a valid URL ({exc}): {text!r}") from exc
    if parts.scheme not in ("http", "https"):
        raise where.error(key, f"must start with http:// or https://, got {text!r}")
    if not parts.hostname:
        raise where.error(key, f"has no host: {text!r}")
    if parts.username is not None or parts.password is not None:
        raise where.error(key, "must not carry credentials (user:password@)")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise where.error(key, f"must not have a query or fragment: {text!r}")
    del port  # parsed only so that a bad port is reported here
    return text.rstrip("/")


def string_list(where: Where, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise where.error(key, f"must be an array of strings, got {type_name(value)}")
    return tuple(string(where, f"{key}[{i}]", item) for i, item in enumerate(value))


def optional_url(where: Where, key: str, value: object) -> str:
    text = string(where, key, value, empty_ok=True)
    return url(where, key, text) if text else ""


def paths(where: Where, key: str, value: object) -> tuple[str, ...]:
    found = string_list(where, key, value)
    for i, item in enumerate(found):
        path(where, f"{key}[{i}]", item)
    return found


def optional_path(where: Where, key: str, value: object) -> str:
    text = string(where, key, value, empty_ok=True)
    if "\x00" in text:
        raise where.error(key, "must not contain NUL")
    return text


def path(where: Where, key: str, value: object) -> str:
    text = string(where, key, value)
    if not text.startswith("/") or "?" in text or "#" in text or " " in text:
        raise where.error(key, f"must be a path starting with /, got {text!r}")
    return text


def table(where: Where, key: str, value: object, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise where.error(key, f"must be a table, got {type_name(value)}")
    for name in value:
        if name not in allowed:
            raise unknown_key(where, f"{key}.{name}", name, allowed)
    return value


def unknown_key(where: Where, key: str, name: str, known: Iterable[str]) -> ConfigError:
    """`key` is no setting: the error, with the one it most likely means (`tick_second`: `tick_seconds`)."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return where.error(key, f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key")


def one_of(where: Where, key: str, value: object, known: Iterable[str]) -> str:
    """A string that is one of `known`: an error that lists them, and the one it most likely means."""
    text = string(where, key, value)
    names = sorted(known)
    if text not in names:
        close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise where.error(key, f"unknown value {text!r} (known: {', '.join(names)}){hint}")
    return text


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def label_key(where: Where, key: str, value: object) -> str:
    text = string(where, key, value)
    prefix, _, name = text.rpartition("/")
    if (
        not _LABEL_NAME.fullmatch(name)
        or len(name) > 63
        or ("/" in text and (not _LABEL_PREFIX.fullmatch(prefix) or len(prefix) > 253))
    ):
        raise where.error(key, f"is not a Kubernetes label key (like 'router.llm/model' or 'gpu_class'): {text!r}")
    return text
