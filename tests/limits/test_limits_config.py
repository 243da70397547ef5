"""[limits] and the tenants' limits as written: each mistake one line naming it, as every setting's."""

from __future__ import annotations

from typing import Any

import pytest

from router.core.config.limits import RedisTarget, TenantLimit
from router.core.config.settings import parse_config
from router.core.errors import ConfigError


def config(limits: dict[str, Any] | None = None, count: bool = True, **key: Any) -> Any:
    raw: dict[str, Any] = {
        "count_tokens": count,
        "api_keys": {"alpha": {"key": "sk-a", "tenant": "a", **key}, "beta": {"key": "sk-b", "tenant": "b"}},
    }
    if limits is not None:
        raw["limits"] = limits
    return parse_config(raw, "router.toml", environ={})


def error(**kwargs: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        config(**kwargs)
    return str(caught.value)


def test_no_limited_tenant_is_no_limiter_at_all() -> None:
    assert config().limits is None
    assert config({"mode": "shadow"}).limits is None


def test_a_tenants_limits_come_from_its_keys_with_the_defaults_of_limits() -> None:
    limits = config(tokens_per_minute=1000, requests_per_minute=10).limits
    assert dict(limits.tenants) == {"a": TenantLimit(1000, 10)}
    assert (limits.mode, limits.unbounded_output_tokens, limits.redis, limits.redis_unavailable) == (
        "enforce",
        1024,
        None,
        "admit",
    )


def test_a_token_limit_without_counting_says_what_it_needs() -> None:
    assert error(count=False, tokens_per_minute=1000) == (
        "router.toml: api_keys.alpha.tokens_per_minute: needs count_tokens = true: a token limit is settled "
        "with each answer's usage, which only counting reads (docs/limits.md)"
    )
    # A request limit needs no counting.
    assert config(count=False, requests_per_minute=5).limits is not None


def test_keys_of_one_tenant_must_agree() -> None:
    raw = {
        "api_keys": {
            "one": {"key": "k1", "tenant": "t", "requests_per_minute": 5},
            "two": {"key": "k2", "tenant": "t", "requests_per_minute": 6},
        }
    }
    with pytest.raises(ConfigError, match=r"api_keys\.two: tenant .t. has other limits in api_keys\.one: one tenant"):
        parse_config(raw, "router.toml", environ={})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requests_per_minute": 0}, "api_keys.alpha.requests_per_minute: must be at least 1, got 0"),
        ({"tokens_per_minute": 1.5}, "api_keys.alpha.tokens_per_minute: must be an integer, got 1.5"),
        ({"tokens_per_minut": 1}, "api_keys.alpha.tokens_per_minut: unknown key (did you mean 'tokens_per_minute'?)"),
        (
            {"limits": {"mode": "enforced"}, "requests_per_minute": 1},
            "limits.mode: unknown value 'enforced' (known: enforce, shadow); did you mean 'enforce'?",
        ),
        ({"limits": {"redis_urls": "x"}}, "limits.redis_urls: unknown key (did you mean 'redis_url'?)"),
        ({"limits": {"redis_url": "http://h:1"}}, "limits.redis_url: must be redis://host:port/db or unix:///path"),
        ({"limits": {"redis_url": "redis://u:p@h:1"}}, "limits.redis_url: carries credentials"),
        ({"limits": {"redis_url": "redis://h:99999"}}, "limits.redis_url: must be redis://host:port/db"),
        ({"limits": {"redis_url": "redis://h:1/x"}}, "limits.redis_url: the database must be a number"),
        ({"limits": {"redis_url": "unix://run/r.sock"}}, "limits.redis_url: unix:// needs an absolute socket path"),
        ({"limits": {"redis_unavailable": "open"}}, "limits.redis_unavailable: unknown value 'open'"),
        ({"limits": {"redis_timeout_seconds": 0}}, "limits.redis_timeout_seconds: must be at least 0.001, got 0"),
    ],
)
def test_each_mistake_is_one_line_naming_it(kwargs: dict[str, Any], message: str) -> None:
    assert message in error(**kwargs)


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("redis://127.0.0.1:6380/2", RedisTarget(host="127.0.0.1", port=6380, db=2)),
        ("redis://cache", RedisTarget(host="cache", port=6379)),
        ("unix:///run/redis.sock", RedisTarget(path="/run/redis.sock")),
        ("unix:///run/redis.sock?db=3", RedisTarget(path="/run/redis.sock", db=3)),
    ],
)
def test_redis_urls(url: str, target: RedisTarget) -> None:
    limits = config({"redis_url": url}, requests_per_minute=1).limits
    assert limits.redis == target
