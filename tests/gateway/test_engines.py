"""What the engines really serve, through the real router: requests that name no model.

(Anthropic's Messages API, model cards and WebSocket tunnels have files of their own.)
"""

from __future__ import annotations

import orjson

from tests.conftest import StartFake, StartRouter, replica_entry
from tests.gateway.test_endpoints import post_json


async def test_a_request_naming_no_model_goes_to_the_only_model_served(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """vLLM's /tokenize takes a body without a model: with one model served, that is where it goes."""
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    body = b'{"prompt": "hello there"}'
    status, _, doc = await post_json(server, "/tokenize", body)
    assert status == 200 and doc["served_by"] == fake.name
    # The body crosses as it came: the engine takes a body without a model.
    assert fake.seen[-1].body == body
    status, _, doc = await post_json(server, "/detokenize", {"model": None, "tokens": [1, 2]})
    assert status == 200 and doc["served_by"] == fake.name


async def test_a_request_naming_no_model_goes_to_default_model_among_several(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """default_model names where it goes, an alias as well as a model (rewritten for the engine, as aliases are)."""
    small, large = await start_fake("small"), await start_fake("large")
    server = await start_router(
        [replica_entry("s", small), replica_entry("l", large)],
        default_model="big",
        models={"large": {"aliases": ["big"]}},
    )
    status, _, doc = await post_json(server, "/tokenize", {"prompt": "x"})
    assert status == 200 and doc["served_by"] == large.name
    assert orjson.loads(large.seen[-1].body) == {"prompt": "x", "model": "large"}
    assert small.seen == []


async def test_a_request_naming_no_model_among_several_without_a_default_is_400_naming_them(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    small, large = await start_fake("small"), await start_fake("large")
    server = await start_router([replica_entry("s", small), replica_entry("l", large)])
    status, _, doc = await post_json(server, "/v1/chat/completions", {"messages": []})
    assert status == 400
    assert doc["error"]["param"] == "model"
    assert "'large', 'small'" in doc["error"]["message"]
    assert small.seen == [] and large.seen == []


async def test_a_model_that_is_not_a_string_is_still_400(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    for model in (7, "", ["m"]):
        status, _, doc = await post_json(server, "/tokenize", {"model": model, "prompt": "x"})
        assert status == 400 and doc["error"]["param"] == "model"
    assert fake.seen == []
