"""What crosses the proxy's two sides: end-to-end headers, without the hop-by-hop ones."""

from __future__ import annotations

from collections.abc import Sequence

# Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, never the
# message; Host and Content-Length are recomputed for the other side.
_NOT_FORWARDED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-connection",
        b"host",
        b"content-length",
        # The router answers Expect itself; the replica gets the body at once.
        b"expect",
    }
)


# A byte tested by its value: `b"_" in x` first tries the argument as an
# integer, raises and clears a TypeError inside, and costs ten times more.
_UNDERSCORE = ord("_")


# A header name's verdict: passed on, left out, or left out and read (Connection).
_KEEP, _DROP, _CONNECTION = 0, 1, 2

# Names judged and remembered per filter, at most: a client that sends new
# names on every request only stops being remembered, never misjudged.
_REMEMBERED_NAMES = 1024


class HeaderFilter:
    """A message's end-to-end headers, for the other side: hop-by-hop ones and `drop` left out.

    Each name's verdict is remembered as the name was spelled: a connection
    sends the same few names on every request, and one lookup then replaces
    lowering the name and testing it four ways. A header that Connection
    names is left out too (RFC 9110 7.6.1); that takes a second pass, only
    when Connection names something.
    """

    __slots__ = ("_drop", "_verdicts")

    def __init__(self, drop: frozenset[bytes] = frozenset()) -> None:
        self._drop = _NOT_FORWARDED | drop
        self._verdicts: dict[bytes, int] = {}

    def _judge(self, name: bytes) -> int:
        lower = name.lower()
        if lower == b"connection":
            verdict = _CONNECTION
        elif lower in self._drop or lower.startswith(b"proxy-"):
            verdict = _DROP
        elif _UNDERSCORE in lower and self._judge_folded(lower.replace(b"_", b"-")):
            # `Content_Length` is `Content-Length` to servers that fold `_`
            # into `-` (CGI, WSGI, some engines' frameworks): a framing or
            # hop-by-hop name spelled so is left out like the name it copies.
            verdict = _DROP
        else:
            verdict = _KEEP
        if len(self._verdicts) < _REMEMBERED_NAMES:
            self._verdicts[name] = verdict
        return verdict

    def _judge_folded(self, folded: bytes) -> bool:
        return folded in self._drop or folded.startswith(b"proxy-")

    def kept(self, raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The headers passed on, as (name, value) pairs in their order."""
        kept: list[tuple[bytes, bytes]] = []
        named: set[bytes] | None = None
        verdicts = self._verdicts
        for name, value in raw:
            verdict = verdicts.get(name)
            if verdict is None:
                verdict = self._judge(name)
            if verdict == _KEEP:
                kept.append((name, value))
            elif verdict == _CONNECTION:
                named = _named(value, named)
        if named:
            return [(name, value) for name, value in kept if name.lower() not in named]
        return kept

    def framed(self, raw: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The headers passed on, framed for the wire (each line ends CRLF).

        The parser on the client side has already refused values with CR, LF
        or NUL, so the raw bytes are safe to pass on as they came.
        """
        lines: list[bytes] = []
        named = False
        verdicts = self._verdicts
        for name, value in raw:
            verdict = verdicts.get(name)
            if verdict is None:
                verdict = self._judge(name)
            if verdict == _KEEP:
                lines.append(name + b": " + value + b"\r\n")
            elif verdict == _CONNECTION:
                named = True
        if named:
            # Rare: the names Connection lists are left out as well.
            return b"".join([name + b": " + value + b"\r\n" for name, value in self.kept(raw)])
        return b"".join(lines)


def _named(value: bytes, named: set[bytes] | None) -> set[bytes]:
    """The header names a Connection value lists, added to those already listed."""
    tokens = {token.strip().lower() for token in value.split(b",")}
    tokens.discard(b"")
    return tokens if named is None else named | tokens


# The router sets X-Request-Id itself, both ways: the client's (checked) or its own.
REQUEST_ID = frozenset({b"x-request-id"})

# The replica's headers for the answer to the client.
RESPONSE_HEADERS = HeaderFilter(REQUEST_ID)
