"""router.gateway.codings: a replica's content codings undone for the router's own reading, never past a bound."""

from __future__ import annotations

import gzip
import zlib

import pytest

from router.gateway.codings import MAX_MEMBERS, StreamDecoder, decoded

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


def empty_members(count: int) -> bytes:
    """`count` gzip members of nothing: about 20 bytes each, no output at all."""
    return gzip.compress(b"") * count


def test_a_body_of_thousands_of_empty_members_is_unreadable_at_once() -> None:
    """50,000 members in under 1 MiB: the work is bounded by members, not only by what they decode to."""
    body = empty_members(50_000) + gzip.compress(TEXT)
    assert len(body) < 1 << 20
    # (Read to its end, as before the bound, it took 0.7 s of the event loop.)
    assert decoded(body, b"gzip", 1 << 20) is None
    decoder = StreamDecoder(b"gzip", 1 << 20)
    fed = [decoder.feed(body[i : i + 65536]) for i in range(0, len(body), 65536)]
    assert fed[-1] is None


@pytest.mark.parametrize("members", [2, MAX_MEMBERS])
def test_up_to_the_bound_members_are_read_in_full(members: int) -> None:
    pieces = [TEXT[i::members] for i in range(members)]
    body = b"".join(gzip.compress(piece) for piece in pieces)
    assert decoded(body, b"gzip", 1 << 20) == b"".join(pieces)


def test_a_long_body_in_many_members_is_not_copied_member_by_member() -> None:
    """Each member's leftover is at most a window, not the rest of a body of megabytes."""
    body = gzip.compress(b"x" * (3 << 20)) + empty_members(MAX_MEMBERS - 2) + gzip.compress(b"end")
    assert decoded(body, b"gzip", 4 << 20) == b"x" * (3 << 20) + b"end"


def feed_in_pieces(decoder: StreamDecoder, coded: bytes, size: int) -> bytes | None:
    out = b""
    for i in range(0, len(coded), size):
        piece = decoder.feed(coded[i : i + size])
        if piece is None:
            return None
        out += piece
    return out


@pytest.mark.parametrize("size", [1, 2, 7, 4096])
def test_a_raw_deflate_stream_is_undone_as_a_whole_body_is(size: int) -> None:
    """Servers send raw deflate under `deflate`: the stream decoder tells it from zlib by its first two bytes."""
    assert feed_in_pieces(StreamDecoder(b"deflate", 1 << 20), raw_deflate(TEXT), size) == TEXT
    assert feed_in_pieces(StreamDecoder(b"deflate", 1 << 20), zlib.compress(TEXT), size) == TEXT


@pytest.mark.parametrize("size", [1, 5, 4096])
def test_a_stream_over_two_gzip_members_is_read_across_them(size: int) -> None:
    coded = gzip.compress(TEXT[:7]) + gzip.compress(TEXT[7:])
    assert feed_in_pieces(StreamDecoder(b"gzip", 1 << 20), coded, size) == TEXT
