"""The fake's sleep mode: vLLM's sleep API exactly (levels, tags, /is_sleeping), SGLang's two calls, 503 or held."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from router.tools.fake import FakeReplica, SleepMode
from tests.conftest import StartFake
from tests.support.clients import CHAT
from tests.support.waiting import wait_for

Session = aiohttp.ClientSession


async def sleeping(session: Session, fake: FakeReplica) -> bool:
    async with session.get(fake.url + "/is_sleeping") as resp:
        doc = await resp.json()
        assert isinstance(doc["is_sleeping"], bool)
        return bool(doc["is_sleeping"])


async def chat(session: Session, fake: FakeReplica) -> tuple[int, bytes]:
    async with session.post(fake.url + "/v1/chat/completions", data=orjson.dumps(CHAT)) as resp:
        return resp.status, await resp.read()


async def test_levels_tags_and_is_sleeping_as_vllm_answers_them(start_fake: StartFake) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    async with Session() as session:
        assert not await sleeping(session, fake)
        async with session.post(fake.url + "/sleep?level=1") as resp:
            assert resp.status == 200
        assert await sleeping(session, fake)
        # One tag back: still asleep while the other sleeps (vLLM's partial wake).
        async with session.post(fake.url + "/wake_up?tags=weights") as resp:
            assert resp.status == 200
        assert await sleeping(session, fake)
        async with session.post(fake.url + "/wake_up?tags=kv_cache") as resp:
            assert resp.status == 200
        assert not await sleeping(session, fake)
        async with session.post(fake.url + "/sleep?level=2") as resp:
            assert resp.status == 200
        async with session.post(fake.url + "/wake_up") as resp:
            assert resp.status == 200
        assert not await sleeping(session, fake)
        for bad in ("level=3", "level=x", "level=1&mode=nap"):
            async with session.post(fake.url + "/sleep?" + bad) as resp:
                assert resp.status == 400
    assert fake.sleep is not None
    assert fake.sleep.calls == ["sleep 1", "wake_up weights", "wake_up kv_cache", "sleep 2", "wake_up"]


async def test_asleep_it_answers_503_saying_sleeping_and_serves_once_woken(start_fake: StartFake) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    async with Session() as session:
        await session.post(fake.url + "/sleep?level=1")
        status, body = await chat(session, fake)
        assert status == 503
        assert "sleeping" in orjson.loads(body)["error"]["message"]
        # What needs no weights still answers.
        async with session.get(fake.url + "/v1/models") as resp:
            assert resp.status == 200
        await session.post(fake.url + "/wake_up")
        assert (await chat(session, fake))[0] == 200


async def test_asleep_answer_hold_keeps_the_request_until_woken_as_vllm_does(start_fake: StartFake) -> None:
    fake = await start_fake("m", sleep=SleepMode(asleep_answer="hold"))
    async with Session() as session:
        await session.post(fake.url + "/sleep?level=1")
        held = asyncio.ensure_future(chat(session, fake))
        assert fake.sleep is not None
        await wait_for(lambda: fake.sleep is not None and fake.sleep.refused == 1)
        assert not held.done()
        await session.post(fake.url + "/wake_up")
        assert (await held)[0] == 200


async def test_sglang_release_and_resume(start_fake: StartFake) -> None:
    fake = await start_fake("m", sleep=SleepMode())
    async with Session() as session:
        async with session.post(fake.url + "/release_memory_occupation", data=b"{}") as resp:
            assert resp.status == 200
        assert (await chat(session, fake))[0] == 503
        async with session.post(
            fake.url + "/resume_memory_occupation", data=b'{"tags": ["weights", "kv_cache"]}'
        ) as resp:
            assert resp.status == 200
        assert (await chat(session, fake))[0] == 200
        async with session.post(fake.url + "/release_memory_occupation", data=b"{nope") as resp:
            assert resp.status == 400


async def test_without_sleep_mode_the_paths_are_not_served(start_fake: StartFake) -> None:
    fake = await start_fake("m")
    async with Session() as session, session.post(fake.url + "/sleep?level=1") as resp:
        assert resp.status in (404, 405)
