"""Engines with API keys of their own: the router sends each its key and headers, never the client's, never shown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client import CollectorRegistry

from router.core.config.settings import parse_config
from router.core.errors import ConfigError
from router.run.app import RouterServer
from router.tools.fake import FakeReplica
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import get_json
from tests.support.waiting import wait_for

CLIENTS = {"app": {"key": "sk-client-0001", "tenant": "app"}}
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

StartWithEnv = Callable[..., Awaitable[RouterServer]]


@pytest.fixture
async def start_with_env() -> AsyncIterator[StartWithEnv]:
    """A router whose config reads `environ` (the test's own, not the process's)."""
    servers: list[RouterServer] = []

    async def start(replicas: list[dict[str, Any]], environ: dict[str, str], **settings: Any) -> RouterServer:
        raw = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", **settings, "replicas": replicas}
        server = RouterServer(parse_config(raw, "<test>", environ=environ), registry=CollectorRegistry())
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


def authorizations(fake: FakeReplica) -> list[str | None]:
    return [seen.headers.get("Authorization") for seen in fake.seen]


async def test_each_engine_gets_its_own_key_and_headers_and_never_the_clients(
    start_fake: StartFake, start_with_env: StartWithEnv, tmp_path: Path
) -> None:
    by_model = await start_fake("llama", api_key="sk-engine-llama")
    by_replica = await start_fake("llama", api_key="sk-engine-own")
    key_file = tmp_path / "own-key"
    key_file.write_text("sk-engine-own\n")  # as a mounted Secret: a trailing newline
    replicas = [
        replica_entry("r0", by_model),
        {**replica_entry("r1", by_replica), "upstream_api_key_file": str(key_file)},
    ]
    server = await start_with_env(
        replicas,
        {"LLAMA_KEY": "sk-engine-llama"},
        api_keys=CLIENTS,
        models={"llama": {"upstream_api_key_env": "LLAMA_KEY", "upstream_headers": {"X-Org": "research"}}},
    )
    async with openai.AsyncOpenAI(
        base_url=server.client_url + "/v1", api_key="sk-client-0001", max_retries=0
    ) as client:
        await asyncio.gather(*(client.chat.completions.create(model="llama", messages=HI) for _ in range(8)))
    assert by_model.seen and by_replica.seen
    assert set(authorizations(by_model)) == {"Bearer sk-engine-llama"}
    assert set(authorizations(by_replica)) == {"Bearer sk-engine-own"}
    # The model's headers go to its replicas without headers of their own.
    assert {seen.headers.get("X-Org") for seen in by_model.seen} == {"research"}
    # Never shown: not in the admin API.
    for path in ("/api/v1/replicas", "/api/v1/endpoints", "/api/v1/status"):
        async with aiohttp.ClientSession() as session, session.get(server.admin_url + path) as resp:
            assert "sk-engine" not in await resp.text()


async def test_without_keys_of_their_own_engines_get_the_clients_key_as_before(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m", api_key="sk-shared")
    server = await start_router([replica_entry("r0", fake)])
    async with openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="sk-shared", max_retries=0) as client:
        await client.chat.completions.create(model="m", messages=HI)
        client_with_wrong = client.with_options(api_key="sk-wrong")
        with pytest.raises(openai.AuthenticationError):
            await client_with_wrong.chat.completions.create(model="m", messages=HI)
    # The engine's own refusal reaches the client: the router passed the client's key on, untouched.
    assert authorizations(fake) == ["Bearer sk-shared"]


async def test_the_model_cards_are_read_with_the_engines_key(
    start_fake: StartFake, start_with_env: StartWithEnv
) -> None:
    fake = await start_fake("llama", api_key="sk-engine", card={"max_model_len": 8192})
    server = await start_with_env(
        [replica_entry("r0", fake)],
        {"K": "sk-engine"},
        model_cards=True,
        models={"llama": {"upstream_api_key_env": "K"}},
    )
    assert server.proxy is not None
    cards = server.proxy.catalog.cards
    await wait_for(lambda: cards.get("llama") is not None)
    doc = await get_json(server.client_url + "/v1/models/llama")
    assert doc["max_model_len"] == 8192


async def test_a_push_may_not_name_upstream_credentials(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    body = {"replicas": [{**replica_entry("r0", fake), "upstream_api_key_env": "HOME"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.put(server.admin_url + "/api/v1/endpoints", json=body) as resp,
    ):
        text = await resp.text()
        assert resp.status == 400, text
    assert "upstream_api_key_env" in text and "config file" in text


@pytest.mark.parametrize(
    ("table", "environ", "message"),
    [
        ({"upstream_api_key_env": "NOPE"}, {}, "the environment variable NOPE is not set, or empty"),
        ({"upstream_api_key_file": "/nonexistent/key"}, {}, "cannot read '/nonexistent/key'"),
        ({"upstream_api_key_env": "K", "upstream_api_key_file": "/x"}, {"K": "a"}, "not both"),
        ({"upstream_api_key_env": "K"}, {"K": "has space"}, "printable ASCII without spaces"),
        ({"upstream_headers": {"Host": "x"}}, {}, "a header the router frames or sets itself"),
        ({"upstream_headers": {"bad name": "x"}}, {}, "is not a valid header name"),
        ({"upstream_headers": {"X-A": "line\r\nbreak"}}, {}, "printable characters"),
        ({"upstream_api_key_env": "K", "upstream_headers": {"Authorization": "x"}}, {"K": "k"}, "set by the upstream"),
    ],
)
def test_bad_credentials_are_refused_by_key_and_never_said(
    table: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    raw = {"models": {"m": table}, "replicas": [{"id": "r0", "model": "m", "url": "http://127.0.0.1:9"}]}
    with pytest.raises(ConfigError) as refused:
        parse_config(raw, "router.toml", environ=environ)
    assert message in str(refused.value) and 'models."m"' in str(refused.value)
    assert "has space" not in str(refused.value)


def test_the_key_is_in_no_repr() -> None:
    raw = {
        "models": {"m": {"upstream_api_key_env": "K"}},
        "replicas": [{"id": "r0", "model": "m", "url": "http://127.0.0.1:9", "upstream_api_key_env": "K"}],
    }
    config = parse_config(raw, "router.toml", environ={"K": "sk-secret-1234"})
    assert "sk-secret" not in repr(config) and "sk-secret" not in str(config.replicas[0].as_json())
    assert config.models["m"].upstream is not None and b"sk-secret-1234" in config.models["m"].upstream.lines
