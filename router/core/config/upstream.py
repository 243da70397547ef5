"""What the router sends a replica of its own: the engine's API key and extra headers.

An engine started with an API key (vLLM's `--api-key`, SGLang's `--api-key`,
llama-server's `--api-key`) refuses a request without it, and the router,
which consumes its clients' keys when `api_keys` is set, must then send the
engine's own. Set per model (`[models."NAME"]`, for every replica of it,
discovered ones too) or per replica (`[[replicas]]` in the config file:
never in a push, which would make the router read its own environment or
files for whoever pushes): `upstream_api_key_env` names an environment
variable, `upstream_api_key_file` a file (a Kubernetes Secret mounted as
one), `upstream_headers` a table of extra headers. The key is read once, at
start and on SIGHUP, and is never shown: not in a log line, the admin API,
an error or a repr.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.core.config import checks as check

UPSTREAM_KEYS = frozenset({"upstream_api_key_env", "upstream_api_key_file", "upstream_headers"})

# A header name (RFC 9110 5.1: a token).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# Headers the router frames or sets itself, which an extra header may not name.
_FRAMED = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer", "keep-alive", "expect"}
)
_FRAMED |= {"x-request-id"}
# A key as engines take it: printable ASCII, no space (a Bearer token).
_KEY = re.compile(r"[\x21-\x7e]+")
_VALUE = re.compile(r"[\x20-\x7e\t]*")
MAX_KEY_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Upstream:
    """The header lines a replica is sent besides the client's: framed once, never shown."""

    # As sent: b"Authorization: Bearer ...\r\nX-Org: a\r\n".
    lines: bytes = field(repr=False)
    # The same as pairs, for the readers that use aiohttp (the model cards).
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    # What a log line may say of it: which headers, whether a key is set.
    names: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Upstream(headers={list(self.names)!r})"


def parse_upstream(
    where: check.Where, key: str, table: Mapping[str, Any], environ: Mapping[str, str]
) -> Upstream | None:
    """The upstream credentials of one model's or replica's table; None when it sets none."""
    env_name = table.get("upstream_api_key_env")
    file_name = table.get("upstream_api_key_file")
    extra = table.get("upstream_headers", {})
    if env_name is None and file_name is None and not extra:
        return None
    if env_name is not None and file_name is not None:
        raise where.error(f"{key}.upstream_api_key_env", "give upstream_api_key_env or upstream_api_key_file, not both")
    api_key: str | None = None
    if env_name is not None:
        name = check.string(where, f"{key}.upstream_api_key_env", env_name)
        api_key = environ.get(name, "")
        if not api_key:
            raise where.error(f"{key}.upstream_api_key_env", f"the environment variable {name} is not set, or empty")
        api_key = api_key.strip()
    elif file_name is not None:
        path = check.string(where, f"{key}.upstream_api_key_file", file_name)
        try:
            api_key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise where.error(f"{key}.upstream_api_key_file", f"cannot read {path!r}: {reason}") from None
        if not api_key:
            raise where.error(f"{key}.upstream_api_key_file", f"{path!r} is empty")
    headers: list[tuple[str, str]] = []
    if api_key is not None:
        # Said by name only: the key itself is never part of a message.
        if len(api_key) > MAX_KEY_BYTES or not _KEY.fullmatch(api_key):
            where_from = "upstream_api_key_env" if env_name is not None else "upstream_api_key_file"
            raise where.error(f"{key}.{where_from}", "the key must be printable ASCII without spaces")
        headers.append(("Authorization", f"Bearer {api_key}"))
    if not isinstance(extra, dict):
        raise where.error(f"{key}.upstream_headers", f"must be a table of header names, got {check.type_name(extra)}")
    for name, value in extra.items():
        if not _TOKEN.fullmatch(name):
            raise where.error(f"{key}.upstream_headers", f"{name!r} is not a valid header name")
        lowered = name.lower()
        if lowered in _FRAMED:
            raise where.error(f"{key}.upstream_headers", f"{name!r} is a header the router frames or sets itself")
        if lowered == "authorization" and api_key is not None:
            raise where.error(f"{key}.upstream_headers", "Authorization is set by the upstream key already")
        if not isinstance(value, str) or not _VALUE.fullmatch(value):
            raise where.error(f"{key}.upstream_headers.{name}", "must be a string of printable characters")
        headers.append((name, value))
    lines = b"".join(f"{name}: {value}\r\n".encode("ascii") for name, value in headers)
    return Upstream(lines, tuple(headers), tuple(name for name, _ in headers))
