"""Endpoint pushes read from what changed: the set, and the error, that reading the whole body gives."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from functools import partial

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.control.endpoints import BadPush, PushedSets, _whole
from router.core.config.settings import ReplicaConfig

# Label values that hold what a cut looks for: separators, braces, quotes, a backslash.
TRICKY = ["plain", "}, {", "},{", '"}, {"id": "x"', "{", "}", 'a"b', "a\\b", "é"]


def entry(rng: random.Random, i: int) -> dict[str, object]:
    doc: dict[str, object] = {
        "id": f"r{i}",
        "model": f"m{i % 3}",
        "url": f"http://10.0.0.{i}:{8000 + rng.randrange(3)}",
    }
    if rng.random() < 0.7:
        doc["labels"] = {"node": rng.choice(TRICKY), "gpus": rng.choice([1, 2, "2"])}
    return doc


def written(doc: object, rng: random.Random) -> bytes:
    """A body as some writer writes it: compact, Python's default, indented."""
    style = rng.randrange(4)
    if style == 0:
        return orjson.dumps(doc)
    if style == 1:
        return json.dumps(doc).encode()
    if style == 2:
        return json.dumps(doc, indent=2).encode()
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def spoiled(body: bytes, rng: random.Random) -> bytes:
    """A push that is wrong: bad JSON, an unknown key, a bad entry, a duplicate, an unknown field."""
    kind = rng.randrange(5)
    if kind == 0:
        return body[: len(body) // 2]
    if kind == 1:
        return body.replace(b'"model"', b'"modle"', 1)
    if kind == 2:
        return body.replace(b"http://", b"ftp://", 1)
    if kind == 3:
        return body.replace(b'"r1"', b'"r0"', 1)
    return body[:-1] + b', "extra": 1}'


def outcome(read: Callable[[], tuple[ReplicaConfig, ...]]) -> object:
    try:
        return read()
    except BadPush as exc:
        return str(exc)


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32))
def test_a_push_read_from_its_changes_is_the_push_read_whole(seed: int) -> None:
    rng = random.Random(seed)
    pushed = PushedSets()
    entries = [entry(rng, i) for i in range(rng.randrange(1, 12))]
    for _ in range(12):
        # Change a few entries, drop one, add one, reorder now and then.
        for _ in range(rng.randrange(3)):
            index = rng.randrange(len(entries))
            entries[index] = entry(rng, int(str(entries[index]["id"])[1:]))
        if rng.random() < 0.3 and len(entries) > 1:
            entries.pop(rng.randrange(len(entries)))
        if rng.random() < 0.3:
            entries.append(entry(rng, 20 + rng.randrange(20)))
        if rng.random() < 0.1:
            rng.shuffle(entries)
        body = written({"replicas": list({str(e["id"]): e for e in entries}.values())}, rng)
        if rng.random() < 0.3:
            body = spoiled(body, rng)
        assert outcome(partial(pushed.read, body)) == outcome(partial(_whole, body))


def test_an_unchanged_entry_is_the_same_replica_again() -> None:
    pushed = PushedSets()
    replicas = [{"id": f"r{i}", "model": "m", "url": f"http://10.0.0.{i}:8000"} for i in range(100)]
    first = pushed.read(orjson.dumps({"replicas": replicas}))
    replicas[40] = {**replicas[40], "url": "http://10.9.9.9:8000"}
    second = pushed.read(orjson.dumps({"replicas": replicas}))
    assert second[40] == ReplicaConfig("r40", "m", "http://10.9.9.9:8000")
    # The same objects: the pool takes them for unchanged without comparing them.
    assert all(a is b for i, (a, b) in enumerate(zip(first, second, strict=True)) if i != 40)


GOOD = b'{"replicas": [{"id": "a", "model": "m", "url": "http://x:1"}, {"id": "b", "model": "m", "url": "http://x:2"}]}'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (GOOD.replace(b'"b"', b'"a"'), "duplicate replica id 'a' (also replicas[0])"),
        (GOOD.replace(b', "url": "http://x:2"', b""), "replicas[1].url: is required"),
        (GOOD[:-2], "The body is not valid JSON"),
    ],
)
def test_a_wrong_push_after_a_good_one_names_its_first_problem(body: bytes, message: str) -> None:
    pushed = PushedSets()
    pushed.read(GOOD)
    with pytest.raises(BadPush, match=re.escape(message)):
        pushed.read(body)
    # And a good one after it is read as ever.
    assert [c.id for c in pushed.read(GOOD)] == ["a", "b"]
