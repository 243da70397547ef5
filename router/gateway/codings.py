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


# gzip allows members one after another (RFC 1952 2.2), and servers that
# join compressed pieces send a few; each costs a decompressor and a copy of
# what follows it, so a body of thousands of empty members (a few bytes
# each) would be work without output: past this many it is unreadable.
MAX_MEMBERS = 16
# Input is fed this much at a time: what a member leaves over (and zlib
# copies) is never more than this, however long the body.
_WINDOW = 64 * 1024


def _inflate(data: bytes, wbits: int, limit: int) -> bytes | None:
    """One coding undone; None if the data is not of it, ends short, decodes past `limit` bytes,
    or has more than MAX_MEMBERS members."""
    out: list[bytes] = []
    total = 0
    members = 0
    inflater = zlib.decompressobj(wbits)
    view = memoryview(data)
    position = 0
    size = len(data)
    while True:
        window = view[position : position + _WINDOW]
        position += len(window)
        try:
            piece = inflater.decompress(window, limit - total + 1)
        except zlib.error:
            return None
        total += len(piece)
        if total > limit:
            return None
        out.append(piece)
        if inflater.eof:
            members += 1
            left = len(inflater.unused_data)
            if (not left and position >= size) or wbits != _GZIP:
                return b"".join(out)
            if members >= MAX_MEMBERS:
                return None
            # What followed the member's end in this window is the next member's start.
            position -= left
            inflater = zlib.decompressobj(wbits)
        elif position >= size:
            return None


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


def _is_zlib(head: bytes) -> bool:
    """Whether two bytes open a zlib stream (RFC 1950 2.2: deflate, and a header check that divides by 31)."""
    return head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0


class StreamDecoder:
    """The first bytes of a coded stream, undone piece by piece as they arrive, up to `limit` of them.

    For one coding of gzip or deflate (a stream with two codings, or an
    unknown one, is unreadable: `feed` answers None), as decoded() reads a
    whole body: gzip over several members (up to MAX_MEMBERS), deflate as a
    zlib stream or, when its first two bytes are no zlib header, raw.
    """

    __slots__ = ("_head", "_inflater", "_left", "_members", "_wbits")

    def __init__(self, content_encoding: bytes, limit: int) -> None:
        applied = _codings(content_encoding)
        self._wbits = applied[0] if applied is not None and len(applied) == 1 else 0
        self._inflater = zlib.decompressobj(_GZIP) if self._wbits == _GZIP else None
        # A deflate stream's first bytes, until there are two to tell zlib from raw.
        self._head = b""
        self._left = limit
        self._members = 0

    def feed(self, chunk: bytes) -> bytes | None:
        """What `chunk` decodes to (b"" if nothing yet); None once the stream is unreadable or the limit is reached."""
        if self._left <= 0 or not self._wbits:
            return None
        inflater = self._inflater
        if inflater is None:
            # deflate: which of its two forms shows in its first two bytes.
            self._head += chunk
            if len(self._head) < 2:
                return b""
            chunk, self._head = self._head, b""
            inflater = self._inflater = zlib.decompressobj(_ZLIB if _is_zlib(chunk) else _RAW)
        out = b""
        while True:
            try:
                piece = inflater.decompress(chunk, self._left)
            except zlib.error:
                self._wbits = 0
                return None
            self._left -= len(piece)
            out += piece
            if not inflater.eof or self._wbits != _GZIP or self._left <= 0:
                return out
            # One member ended: the next starts with what followed it.
            chunk = inflater.unused_data
            self._members += 1
            if self._members >= MAX_MEMBERS:
                self._wbits = 0
                return out or None
            inflater = self._inflater = zlib.decompressobj(_GZIP)
            if not chunk:
                return out
