"""A replica's content codings undone, with a bound, for what the router itself reads of an answer.

The router passes answers on as the replica coded them (it forwards the
client's Accept-Encoding, and the OpenAI SDKs ask for gzip), and reads one
only to give an error OpenAI's shape or to find a /v1/responses id. Both
must read the text, not the compressed bytes: the codings the standard
library undoes (gzip, deflate) are undone here, never past a bound on what
they decode to (a small body can inflate without end); any other (br,
zstd, compress) is unreadable, and the caller then leaves the answer as it
came.
"""

from __future__ import annotations

import zlib

# zlib's window bits: a gzip member, a zlib stream (what HTTP calls
# deflate, RFC 9110 8.4.1.2), and raw deflate, which some servers send
# under that name all the same.
_GZIP = 16 + zlib.MAX_WBITS
_ZLIB = zlib.MAX_WBITS
_RAW = -zlib.MAX_WBITS
_WBITS = {b"gzip": _GZIP, b"x-gzip": _GZIP, b"deflate": _ZLIB}


def _codings(content_encoding: bytes) -> list[int] | None:
    """The window bits of each coding, in the order they were applied; None if one is unknown."""
    applied: list[int] = []
    for token in content_encoding.split(b","):
        name = token.strip().lower()
        if not name or name == b"identity":
            continue
        wbits = _WBITS.get(name)
        if wbits is None:
            return None
        applied.append(wbits)
    return applied


def _inflate(data: bytes, wbits: int, limit: int) -> bytes | None:
    """One coding undone; None if the data is not of it, ends short, or decodes past `limit` bytes."""
    out: list[bytes] = []
    total = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            piece = inflater.decompress(data, limit - total + 1)
        except zlib.error:
            return None
        total += len(piece)
        if total > limit or not inflater.eof:
            return None
        out.append(piece)
        # gzip allows members one after another (RFC 1952 2.2).
        data = inflater.unused_data
        if not data or wbits != _GZIP:
            return b"".join(out)


def decoded(body: bytes, content_encoding: bytes | None, limit: int) -> bytes | None:
    """`body` with the codings its Content-Encoding names undone, or None if that cannot be done within `limit`."""
    if content_encoding is None or not body:
        return body
    applied = _codings(content_encoding)
    if applied is None:
        return None
    for wbits in reversed(applied):
        plain = _inflate(body, wbits, limit)
        if plain is None and wbits == _ZLIB:
            plain = _inflate(body, _RAW, limit)
        if plain is None:
            return None
        body = plain
    return body


class StreamDecoder:
    """The first bytes of a coded stream, undone piece by piece as they arrive, up to `limit` of them.

    For one coding of gzip or deflate (a stream with two codings, or an
    unknown one, is unreadable: `feed` answers None).
    """

    __slots__ = ("_inflater", "_left")

    def __init__(self, content_encoding: bytes, limit: int) -> None:
        applied = _codings(content_encoding)
        self._inflater = zlib.decompressobj(applied[0]) if applied is not None and len(applied) == 1 else None
        self._left = limit

    def feed(self, chunk: bytes) -> bytes | None:
        """What `chunk` decodes to (b"" if nothing yet); None once the stream is unreadable or the limit is reached."""
        inflater = self._inflater
        if inflater is None or self._left <= 0:
            return None
        try:
            piece = inflater.decompress(chunk, self._left)
        except zlib.error:
            self._inflater = None
            return None
        self._left -= len(piece)
        return piece
