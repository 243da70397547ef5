"""A real engine behind the router: two llama.cpp servers (Gemma 3 270M on the CPU).

Install the engine with `scripts/install-engine`, then run this tier alone with
`.venv/bin/pytest -m engine`. Without the engine these tests are skipped, unless
ROUTER_REQUIRE_ENGINE=1 (as .ci/run sets), where a missing engine fails them.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from router.run.app import RouterServer
from tests.conftest import StartRouter
from tests.support.clients import get_json, post
from tests.support.processes import free_port
from tests.support.waiting import polled, wait_for

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(os.environ.get("ROUTER_ENGINE_PYTHON", ROOT / ".venv-engine" / "bin" / "python"))
ENGINE_MODEL = Path(os.environ.get("ROUTER_ENGINE_MODEL", ROOT / ".cache" / "models" / "gemma3-270m-q4_k_m.gguf"))

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

GREEDY: dict[str, Any] = {"temperature": 0, "seed": 7}
# Gemma's end tokens (<eos>, <end_of_turn>) banned: a generation runs to max_tokens.
NO_END = {"1": -100, "106": -100}
JSON = {"Content-Type": "application/json"}
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


@dataclass
class Engine:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def engine_available() -> bool:
    return ENGINE_PYTHON.exists() and ENGINE_MODEL.exists()


def engine_argv(port: int) -> list[str]:
    """llama.cpp's OpenAI server for Gemma 3 270M on one thread (also used by bench/engine.py)."""
    return [
        str(ENGINE_PYTHON),
        "-m",
        "llama_cpp.server",
        "--model",
        str(ENGINE_MODEL),
        "--model_alias",
        "gemma",
        "--chat_format",
        "gemma",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--n_threads",
        "1",
    ]


def start_engine(log_dir: Path, name: str, port: int | None = None) -> Engine:
    # llama.cpp's server is told its port and does not say which it took: the one place left to free_port.
    port = port or free_port()
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(engine_argv(port), stdout=out, stderr=subprocess.STDOUT)
    return Engine(f"http://127.0.0.1:{port}", process, log)


def wait_ready(engine: Engine, timeout: float = 60.0) -> None:
    # llama.cpp has no health route; it binds its port only once the model is loaded.
    def loaded() -> bool:
        try:
            with urllib.request.urlopen(engine.url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        if engine.process.poll() is not None:
            raise RuntimeError(f"engine did not start: {engine.log.read_text()[-2000:]}")
        return False

    # Polled: llama.cpp says nothing when it has loaded.
    if not polled(loaded, timeout=timeout, every=0.1):
        raise RuntimeError(f"engine did not start: {engine.log.read_text()[-2000:]}")


def stop_engine(engine: Engine) -> None:
    engine.process.terminate()
    try:
        engine.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        engine.process.kill()
        engine.process.wait(timeout=10)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    if not engine_available():
        if os.environ.get("ROUTER_REQUIRE_ENGINE") == "1":
            pytest.fail(f"ROUTER_REQUIRE_ENGINE=1 but no engine at {ENGINE_PYTHON} / {ENGINE_MODEL}")
        pytest.skip("no llama.cpp engine installed (scripts/install-engine)")
    log_dir = tmp_path_factory.mktemp("engines")
    pair = (start_engine(log_dir, "a"), start_engine(log_dir, "b"))
    try:
        for engine in pair:
            wait_ready(engine)
        yield pair
    finally:
        for engine in pair:
            stop_engine(engine)


async def router_for(start_router: StartRouter, engines: tuple[Engine, Engine], **settings: Any) -> RouterServer:
    a, b = engines
    return await start_router(
        [{"id": "a", "model": "gemma", "url": a.url}, {"id": "b", "model": "gemma", "url": b.url}], **settings
    )


def normalized(sse: bytes) -> bytes:
    """The stream without what differs per request by design: ids and timestamps."""
    sse = re.sub(rb'"id":\s*"[^"]*"', b'"id":"-"', sse)
    return re.sub(rb'"created":\s*\d+', b'"created":0', sse)


async def test_sdk_answers_arrive_intact_streaming_and_not(
    engines: tuple[Engine, Engine], start_router: StartRouter
) -> None:
    server = await router_for(start_router, engines)
    server.pool.set_draining("b", True)
    direct = openai.AsyncOpenAI(base_url=engines[0].url + "/v1", api_key="x", max_retries=0)
    routed = openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0)
    try:
        want = await direct.chat.completions.create(model="gemma", messages=HELLO, max_tokens=8, temperature=0, seed=7)
        got = await routed.chat.completions.create(model="gemma", messages=HELLO, max_tokens=8, temperature=0, seed=7)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage == want.usage
        stream = await routed.chat.completions.create(
            model="gemma", messages=HELLO, max_tokens=8, stream=True, temperature=0, seed=7
        )
        parts = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want.choices[0].message.content
        assert parts[-1].choices[0].finish_reason == want.choices[0].finish_reason
        want_text = await direct.completions.create(
            model="gemma", prompt="The sky is", max_tokens=6, temperature=0, seed=7
        )
        got_text = await routed.completions.create(
            model="gemma", prompt="The sky is", max_tokens=6, temperature=0, seed=7
        )
        assert got_text.choices[0].text == want_text.choices[0].text
        assert got_text.usage == want_text.usage
        streamed = await routed.completions.create(
            model="gemma", prompt="The sky is", max_tokens=6, stream=True, temperature=0, seed=7
        )
        assert "".join([c.choices[0].text async for c in streamed]) == want_text.choices[0].text
    finally:
        await direct.close()
        await routed.close()


async def test_the_sse_bytes_equal_what_the_engine_sent(
    engines: tuple[Engine, Engine], start_router: StartRouter
) -> None:
    server = await router_for(start_router, engines)
    server.pool.set_draining("b", True)
    body = orjson.dumps({"model": "gemma", "messages": HELLO, "max_tokens": 8, "stream": True, **GREEDY})
    _, direct_headers, direct = await post(engines[0].url + "/v1/chat/completions", body)
    status, headers, routed = await post(server.client_url + "/v1/chat/completions", body)
    assert status == 200
    assert headers["Content-Type"] == direct_headers["Content-Type"]
    assert normalized(routed) == normalized(direct)
    assert routed.rstrip().endswith(b"data: [DONE]")


async def test_the_usage_map_stamps_the_replica_that_served_and_a_long_generation_is_use(
    engines: tuple[Engine, Engine], start_router: StartRouter
) -> None:
    server = await router_for(start_router, engines, tick_seconds=0.2)
    server.pool.set_draining("a", True)
    body = orjson.dumps(
        {"model": "gemma", "prompt": "Once upon a time", "max_tokens": 80, "stream": True, "logit_bias": NO_END}
    )
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server.client_url + "/v1/completions", data=body, headers=JSON)
        began = time.time()
        first = await resp.content.readany()
        assert resp.status == 200, first
        # Real time: a second of a real engine's stream, for the usage map's stamp to move.
        await asyncio.sleep(1.0)
        assert {r.id: r.in_flight for r in server.pool} == {"a": 0, "b": 1}, await resp.read()
        usage = await get_json(server.admin_url + "/api/v1/usage")
        assert list(usage["last_used"]) == ["b"]
        assert usage["last_used"]["b"] >= began + 0.5
        await resp.read()


async def test_a_client_that_leaves_mid_generation_frees_the_engine(
    engines: tuple[Engine, Engine], start_router: StartRouter
) -> None:
    server = await router_for(start_router, engines)
    server.pool.set_draining("b", True)
    long = orjson.dumps(
        {"model": "gemma", "prompt": "Once upon a time", "max_tokens": 1500, "stream": True, "logit_bias": NO_END}
    )
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server.client_url + "/v1/completions", data=long, headers=JSON)
        assert resp.status == 200
        await resp.content.readany()
        resp.close()
    await wait_for(lambda: [r.in_flight for r in server.pool if r.id == "a"] == [0])
    # Were the abandoned generation still running (~1 minute), this would queue behind it.
    began = time.perf_counter()
    short = orjson.dumps({"model": "gemma", "messages": HELLO, "max_tokens": 2})
    status, _, _ = await post(server.client_url + "/v1/chat/completions", short)
    assert status == 200
    assert time.perf_counter() - began < 5


async def test_the_engines_own_error_answers(engines: tuple[Engine, Engine], start_router: StartRouter) -> None:
    server = await router_for(start_router, engines, ejection_failures=2)
    too_long = orjson.dumps({"model": "gemma", "prompt": "word " * 5000, "max_tokens": 4})
    _, _, direct = await post(engines[0].url + "/v1/completions", too_long)
    status, _, routed = await post(server.client_url + "/v1/completions", too_long)
    assert status == 400
    assert routed == direct
    assert orjson.loads(routed)["error"]["code"] == "context_length_exceeded"
    status, _, answer = await post(server.client_url + "/v1/chat/completions", b'{"model": "gemma", "messages": [')
    assert status == 400
    assert orjson.loads(answer)["error"]["type"] == "invalid_request_error"
    bad_role = orjson.dumps({"model": "gemma", "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2})
    direct_status, _, direct_answer = await post(engines[0].url + "/v1/chat/completions", bad_role)
    assert direct_status == 500
    # Older llama-cpp-python answers a bare {"message": ...}, newer an OpenAI error.
    engine_doc = orjson.loads(direct_answer)
    engine_message = engine_doc["error"]["message"] if "error" in engine_doc else engine_doc["message"]
    for _ in range(6):
        status, headers, answer = await post(server.client_url + "/v1/chat/completions", bad_role)
        assert status == 500
        assert headers["Content-Type"].startswith("application/json")
        error = orjson.loads(answer)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] == engine_message
    # One client's bad requests never eject healthy replicas.
    assert {r.id: r.state.value for r in server.pool} == {"a": "ready", "b": "ready"}


async def test_a_replica_still_loading_its_model_is_routed_around(
    engines: tuple[Engine, Engine], start_router: StartRouter, tmp_path: Path
) -> None:
    # The engine that will load there later is told its port (start_engine below), so the port is named first.
    port = free_port()
    server = await start_router(
        [
            {"id": "loading", "model": "gemma", "url": f"http://127.0.0.1:{port}"},
            {"id": "ready", "model": "gemma", "url": engines[0].url},
        ],
    )
    loading = start_engine(tmp_path, "loading", port)
    try:
        short = orjson.dumps({"model": "gemma", "messages": HELLO, "max_tokens": 2})
        for _ in range(4):
            status, _, _ = await post(server.client_url + "/v1/chat/completions", short)
            assert status == 200
    finally:
        stop_engine(loading)
    loading_replica = server.pool.get("loading")
    assert loading_replica is not None
    assert loading_replica.responses == {}


async def test_the_routers_config_decides_routing_not_the_engines_model_name(
    engines: tuple[Engine, Engine], start_router: StartRouter
) -> None:
    a, b = engines
    server = await start_router(
        [{"id": "a", "model": "gemma-a", "url": a.url}, {"id": "b", "model": "gemma-b", "url": b.url}],
        tick_seconds=0.1,
    )
    short = orjson.dumps({"model": "gemma-b", "messages": HELLO, "max_tokens": 2})
    for _ in range(3):
        status, _, _ = await post(server.client_url + "/v1/chat/completions", short)
        assert status == 200
    status, _, _ = await post(server.client_url + "/v1/chat/completions", orjson.dumps({"model": "gemma-c"}))
    assert status == 404
    assert {r.id: r.requests for r in server.pool} == {"a": 0, "b": 3}
