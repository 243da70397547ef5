"""Client keys at run time: SIGHUP reads `api_keys` again, all at once, and a request under way keeps its tenant."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from router.tools.fake import Behaviour
from tests.conftest import StartFake
from tests.support.clients import access_log_lines
from tests.support.processes import Serve
from tests.support.waiting import wait_for

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def keys(*names: str) -> str:
    return "".join(f'[api_keys.{n}]\nkey = "sk-{n}-0000"\ntenant = "{n}"\n' for n in names)


def sdk(serve: Serve, name: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key=f"sk-{name}-0000", max_retries=0, timeout=30)


async def allowed(serve: Serve, name: str) -> bool:
    async with sdk(serve, name) as client:
        try:
            await client.chat.completions.create(model="m", messages=HI, max_tokens=2)
        except openai.AuthenticationError:
            return False
    return True


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_key_added_or_removed_takes_effect_at_sighup_and_a_stream_keeps_its_tenant(
    serve: Serve, start_fake: StartFake, tmp_path: Path, workers: int
) -> None:
    fake = await start_fake("m", behaviour=Behaviour(tokens=40, token_delay=0.05))
    log = tmp_path / "access.log"
    settings = f'access_log = "{log}"\nshutdown_delay_seconds = 0\n'
    replicas = [{"id": "r0", "model": "m", "url": fake.url}]
    serve.write(replicas, settings + keys("alpha"))
    await serve.start(*(("--workers", str(workers)) if workers > 1 else ()))
    assert await allowed(serve, "alpha") and not await allowed(serve, "beta")
    async with sdk(serve, "alpha") as client:
        stream = await client.chat.completions.create(model="m", messages=HI, stream=True)
        await stream.__anext__()
        # alpha goes, beta comes, while alpha's stream runs.
        serve.write(replicas, settings + keys("beta"))
        serve.signal(signal.SIGHUP)

        async def beta_in() -> bool:
            return await allowed(serve, "beta")

        for _ in range(100):
            if await beta_in():
                break
        else:
            raise AssertionError("beta's key never took effect")
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text.endswith("tok39 ")
    assert not await allowed(serve, "alpha")
    await wait_for(lambda: len(access_log_lines(log)) >= 5)
    lines = access_log_lines(log)
    streamed = [line for line in lines if line["status"] == 200 and line.get("tenant") == "alpha"]
    # The stream that began under alpha ended as alpha's, after alpha's key was gone.
    assert len(streamed) == 2, lines
    assert any(line["status"] == 200 and line.get("tenant") == "beta" for line in lines)


async def test_a_broken_file_at_sighup_changes_no_key(serve: Serve, start_fake: StartFake) -> None:
    fake = await start_fake("m")
    replicas = [{"id": "r0", "model": "m", "url": fake.url}]
    serve.write(replicas, "shutdown_delay_seconds = 0\n" + keys("alpha"))
    await serve.start()
    serve.write(replicas, "shutdown_delay_seconds = 0\n" + keys("beta") + "[api_keys.gamma]\ntenant = 'g'\n")
    serve.signal(signal.SIGHUP)
    # Nothing is to happen: the router's log says when it has read the file, and only then are
    # the keys looked at (real time on purpose: the log is read once the process has ended).
    await asyncio.sleep(1.0)
    assert await allowed(serve, "alpha") and not await allowed(serve, "beta")
    said = serve.output()
    assert "api_keys not reloaded, nothing changed" in said and "api_keys.gamma" in said
