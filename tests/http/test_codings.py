"""router.http.codings: a replica's content codings undone for the router's own reading, never past a bound."""

from __future__ import annotations

import gzip
import zlib

import pytest

from router.http.codings import StreamDecoder, decoded

TEXT = b'{"detail": "the prompt is too long"}'


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("body", "coding"),
    [
        (TEXT, None),
        (TEXT, b"identity"),
        (gzip.compress(TEXT), b"gzip"),
        (gzip.compress(TEXT), b"X-GZIP"),
        (zlib.compress(TEXT), b"deflate"),
        (raw_deflate(TEXT), b"deflate"),
        (gzip.compress(zlib.compress(TEXT)), b"deflate, gzip"),
        (gzip.compress(TEXT[:10]) + gzip.compress(TEXT[10:]), b"gzip"),
    ],
    ids=["none", "identity", "gzip", "x-gzip", "deflate", "raw-deflate", "deflate-then-gzip", "two-gzip-members"],
)
def test_the_codings_the_standard_library_knows_are_undone(body: bytes, coding: bytes | None) -> None:
    assert decoded(body, coding, 1 << 20) == TEXT


@pytest.mark.parametrize(
    ("body", "coding"),
    [
        (gzip.compress(TEXT), b"br"),
        (gzip.compress(TEXT), b"gzip, zstd"),
        (gzip.compress(TEXT)[:-6], b"gzip"),
        (TEXT, b"gzip"),
        (gzip.compress(b" " * 4096), b"gzip"),
    ],
    ids=["unknown", "one-unknown-of-two", "cut-short", "not-gzip", "past-the-bound"],
)
def test_what_cannot_be_read_within_the_bound_is_none(body: bytes, coding: bytes) -> None:
    assert decoded(body, coding, 4095) is None


def test_a_stream_is_undone_piece_by_piece_up_to_its_bound() -> None:
    coded = gzip.compress(b"data: " + b"x" * 1000 + b"\n\n")
    decoder = StreamDecoder(b"gzip", 100)
    pieces = [decoder.feed(coded[i : i + 5]) for i in range(0, len(coded), 5)]
    plain = b"".join(piece for piece in pieces if piece is not None)
    assert plain == (b"data: " + b"x" * 1000)[:100]
    assert pieces[-1] is None


@pytest.mark.parametrize("coding", [b"br", b"gzip, gzip"])
def test_a_stream_in_a_coding_it_cannot_undo_is_unreadable(coding: bytes) -> None:
    assert StreamDecoder(coding, 100).feed(b"\x1f\x8b") is None


def test_a_stream_whose_coded_bytes_go_bad_is_unreadable_from_there() -> None:
    """Bytes that are no deflate data after a good start: the decoder gives what it had, then None."""
    coded = gzip.compress(TEXT)
    decoder = StreamDecoder(b"gzip", 1 << 20)
    start = decoder.feed(coded[:10])
    assert start == b""
    assert decoder.feed(b"\xff" * 64) is None
    assert decoder.feed(coded[10:]) is None
