"""How a fake replica's answers end: at the request's limit ("length"), or on their own ("stop"), as an engine's."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.conftest import StartFake, StartRouter, replica_entry


@pytest.mark.parametrize(("max_tokens", "finish"), [(100, "stop"), (None, "stop"), (16, "length"), (4, "length")])
async def test_an_answer_shorter_than_its_limit_ends_with_stop(
    max_tokens: int | None, finish: str, start_fake: StartFake, start_router: StartRouter
) -> None:
    fake = await start_fake("m")  # 16 tokens an answer, at most
    server = await start_router([replica_entry("r0", fake)])
    async with openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0) as client:
        whole = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
        )
        text = await client.completions.create(model="m", prompt="hi", max_tokens=max_tokens)
        chunks = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=max_tokens
        )
        last = [chunk async for chunk in chunks if chunk.choices][-1]
        assert whole.choices[0].finish_reason == text.choices[0].finish_reason == finish
        assert last.choices[0].finish_reason == finish
        if finish == "stop":
            # The SDK's helpers, which raise LengthFinishReasonError on "length", work against it.
            async with client.chat.completions.stream(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
            ) as stream:
                final = await stream.get_final_completion()
            assert final.choices[0].message.content
    async with anthropic.AsyncAnthropic(base_url=server.client_url, api_key="x", max_retries=0) as claude:
        message = await claude.messages.create(
            model="m", max_tokens=max_tokens or 1000, messages=[{"role": "user", "content": "hi"}]
        )
    assert message.stop_reason == ("end_turn" if finish == "stop" else "max_tokens")
