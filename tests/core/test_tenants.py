"""api_keys as tables naming tenants, and [[priority_classes]]: read, defaulted, and every mistake named."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from router.core.config.settings import parse_config
from router.core.config.tenants import DEFAULT_CLASSES, Caller, ClientKey, PriorityClass, callers, unit_weight
from router.core.errors import ConfigError


def config(**raw: Any) -> Any:
    return parse_config(raw, "<test>", environ={})


def sha(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def test_the_list_form_still_works_and_makes_every_key_tenant_default_of_the_first_class() -> None:
    keys = config(api_keys=["k-one", "k-two"]).api_keys
    assert keys == (ClientKey("api_keys[0]", sha("k-one")), ClientKey("api_keys[1]", sha("k-two")))
    assert set(callers(keys, DEFAULT_CLASSES).values()) == {Caller("default", 1.0, 0)}


def test_table_keys_name_their_tenant_class_and_weight_and_keep_only_the_digest() -> None:
    digest = hashlib.sha256(b"sk-batch").hexdigest()
    loaded = config(
        api_keys={
            "search": {"key": "sk-search", "weight": 2},
            "nightly": {"key_sha256": digest.upper(), "tenant": "search", "priority": "batch", "weight": 2},
            "other": {"key": "sk-other"},
        }
    )
    search, nightly, other = loaded.api_keys
    assert search == ClientKey("api_keys.search", sha("sk-search"), "search", 2.0, None)
    assert nightly == ClientKey("api_keys.nightly", sha("sk-batch"), "search", 2.0, "batch")
    assert other.tenant == "other" and other.weight == 1.0
    assert "sk-search" not in repr(loaded)
    assert callers(loaded.api_keys, loaded.priority_classes) == {
        sha("sk-search"): Caller("search", 2.0, 0),
        sha("sk-batch"): Caller("search", 2.0, 1),
        sha("sk-other"): Caller("other", 1.0, 0),
    }
    assert unit_weight(loaded.api_keys) == 1.0


@pytest.mark.parametrize(
    ("api_keys", "where", "problem"),
    [
        ("k", "api_keys", "an array of strings or a table of named keys"),
        ({"a": {"tenant": "x"}}, "api_keys.a", "exactly one of key and key_sha256"),
        ({"a": {"key": "k", "key_sha256": "0" * 64}}, "api_keys.a", "exactly one of key and key_sha256"),
        ({"a": {"key_sha256": "xyz"}}, "api_keys.a.key_sha256", "64 hexadecimal digits"),
        ({"a": {"key": "k", "tenant": "has space"}}, "api_keys.a.tenant", "a tenant's name"),
        ({"bad name": {"key": "k"}}, "api_keys.bad name", "a tenant's name"),
        ({"a": {"key": "k", "weight": 0}}, "api_keys.a.weight", "at least"),
        ({"a": {"key": "k", "colour": "red"}}, "api_keys.a.colour", "unknown key"),
        ({"a": {"key": "k", "priority": "urgent"}}, "api_keys.a.priority", "unknown class 'urgent'"),
        (
            {"a": {"key": "k1", "tenant": "t"}, "b": {"key": "k2", "tenant": "t", "weight": 3}},
            "api_keys.b.weight",
            "tenant 't' has weight 1 in api_keys.a: one tenant, one weight",
        ),
        ({"a": {"key": "same"}, "b": {"key": "same"}}, "api_keys.b", "is the same key as api_keys.a"),
        (["same", "same"], r"api_keys\[1\]", r"is the same key as api_keys\[0\]"),
    ],
)
def test_a_mistake_in_api_keys_names_the_key_never_the_secret(api_keys: object, where: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^<test>: {where}: .*{problem}") as raised:
        config(api_keys=api_keys)
    assert "same'" not in str(raised.value) and "'k" not in str(raised.value)


def test_without_declared_classes_there_are_interactive_and_batch_on_queue_timeout_seconds() -> None:
    assert config().priority_classes == DEFAULT_CLASSES
    assert config(queue_timeout_seconds=2).priority_classes == (
        PriorityClass("interactive", 2.0),
        PriorityClass("batch", 60.0, 30.0),
    )
    # A longer queue timeout is batch's too: batch never waits less than interactive.
    assert config(queue_timeout_seconds=300).priority_classes[1] == PriorityClass("batch", 300.0, 150.0)


def test_declared_classes_are_ordered_highest_first_with_their_defaults() -> None:
    classes = config(
        queue_timeout_seconds=4,
        priority_classes=[
            {"name": "premium"},
            {"name": "standard", "queue_timeout_seconds": 20, "max_queue_seconds": 5},
            {"name": "bulk", "queue_timeout_seconds": 600},
        ],
    ).priority_classes
    assert classes == (
        PriorityClass("premium", 4.0),
        PriorityClass("standard", 20.0, 5.0),
        PriorityClass("bulk", 600.0, 300.0),
    )


@pytest.mark.parametrize(
    ("classes", "where", "problem"),
    [
        ([], "priority_classes", "one or more"),
        ({"name": "a"}, "priority_classes", "one or more"),
        ([{"queue_timeout_seconds": 1}], r"priority_classes\[0\].name", "is required"),
        ([{"name": "Interactive"}], r"priority_classes\[0\].name", "lower-case"),
        ([{"name": "a"}, {"name": "a"}], r"priority_classes\[1\].name", "declared twice"),
        ([{"name": "a", "max_queue_seconds": 1}], r"priority_classes\[0\].max_queue_seconds", "nothing to age"),
        (
            [{"name": "a"}, {"name": "b", "queue_timeout_seconds": 10, "max_queue_seconds": 10}],
            r"priority_classes\[1\].max_queue_seconds",
            r"must be below the class's queue_timeout_seconds \(10\)",
        ),
        ([{"name": "a", "weight": 2}], r"priority_classes\[0\].weight", "unknown key"),
    ],
)
def test_a_mistake_in_priority_classes_is_named(classes: object, where: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^<test>: {where}: .*{problem}"):
        config(priority_classes=classes)


def test_a_key_may_name_a_declared_class_only() -> None:
    loaded = config(
        priority_classes=[{"name": "gold"}, {"name": "bronze"}], api_keys={"a": {"key": "k", "priority": "bronze"}}
    )
    assert callers(loaded.api_keys, loaded.priority_classes)[sha("k")].priority == 1
    with pytest.raises(ConfigError, match=r"api_keys.a.priority: unknown class 'batch' \(known: 'gold', 'bronze'\)"):
        config(
            priority_classes=[{"name": "gold"}, {"name": "bronze"}], api_keys={"a": {"key": "k", "priority": "batch"}}
        )


def test_max_queued_per_tenant_is_a_count() -> None:
    assert config().max_queued_per_tenant == 0
    assert config(max_queued_per_tenant=50).max_queued_per_tenant == 50
    with pytest.raises(ConfigError, match="max_queued_per_tenant: must be an integer"):
        config(max_queued_per_tenant=1.5)
