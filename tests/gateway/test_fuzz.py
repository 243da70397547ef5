"""Whatever the body and headers, the client gets a 2xx or an OpenAI-shaped 4xx, never a 500."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.config.settings import parse_config
from router.run.app import RouterServer
from router.tools.fake import FakeReplica

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(orjson.dumps),
    st.dictionaries(st.sampled_from(["model", "stream", "messages", "prompt", "input"]), json_values).map(orjson.dumps),
    st.fixed_dictionaries({"model": st.sampled_from(["m", "alias", "nope", ""]), "stream": json_values}).map(
        orjson.dumps
    ),
)
header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, content_type=header_values, auth=header_values)
async def test_no_input_makes_the_router_answer_500(body: bytes, content_type: str, auth: str) -> None:
    fake = FakeReplica(models=("m",))
    await fake.start()
    config = parse_config(
        {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "replicas": [{"id": "r0", "model": "m", "url": fake.url}],
            "models": {"m": {"aliases": ["alias"]}},
        },
        "<fuzz>",
        environ={},
    )
    server = RouterServer(config)
    await server.start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                server.client_url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": content_type, "Authorization": auth},
            ) as resp,
        ):
            answer = await resp.read()
            assert resp.status < 500, answer
            if resp.status >= 400:
                assert set(orjson.loads(answer)["error"]) == {"message", "type", "param", "code"}
    finally:
        await server.stop()
        await fake.stop()
    assert [r.in_flight for r in server.pool] == [0]


toml_keys = st.sampled_from(
    [
        "listen",
        "admin_listen",
        "tick_seconds",
        "api_keys",
        "max_body_bytes",
        "usage_push_url",
        "replicas",
        "models",
        "max_attempts",
        "health_check_path",
        "bogus",
    ]
)
toml_values = st.recursive(
    st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["id", "model", "url", "labels", "aliases", "fallbacks", "x"]), inner, max_size=4
        )
    ),
    max_leaves=10,
)


@given(raw=st.dictionaries(toml_keys, toml_values, max_size=5))
def test_the_config_loader_raises_only_config_errors(raw: dict[str, object]) -> None:
    from router.core.config.settings import parse_config
    from router.core.errors import ConfigError

    try:
        parse_config(raw, "<fuzz>", environ={})
    except ConfigError as exc:
        message = str(exc)
    else:
        return
    assert message.startswith("<fuzz>: ")
    assert "\n" not in message


@given(text=st.text(max_size=200))
def test_arbitrary_toml_text_is_a_config_error_or_a_config(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from router.core.config.settings import load_config
    from router.core.errors import ConfigError

    path = tmp_path_factory.mktemp("toml") / "router.toml"
    path.write_text(text)
    try:
        load_config(path, environ={})
    except ConfigError:
        pass
