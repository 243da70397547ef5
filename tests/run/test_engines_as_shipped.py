"""Engine-aware routing as it ships: `router serve` in front of `router fake --engine` processes, the `openai` SDK.

Each simulated engine is its own process and exports its engine's real
metric names (router/tools/fake/exposition.py: vLLM's `vllm:` gauges and its
ORCA answer header, SGLang's `/v1/loads`, llama.cpp's `llamacpp:` gauges,
TGI's `tgi_` ones). The router is told no engine: it recognises each from
the replica's /v1/models, as it would a real one, and reads each under its
own names. What is judged is what the SDK and the admin API see.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.support.clients import access_log_lines, get_json
from tests.support.processes import Serve
from tests.support.waiting import until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "count to ten " * 40}]

StartEngine = Callable[..., str]


@pytest.fixture
def start_engine() -> Any:
    """`router fake --engine KIND` as a process on port 0: its URL, once it listens."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(kind: str, *args: str) -> str:
        command = [sys.executable, "-m", "router.tools.fake", "--port", "0", "--model", "m", "--engine", kind]
        process = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        processes.append(process)
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        assert "fake replica of" in line, line
        return next(word for word in line.split() if word.startswith("http://")).rstrip(",")

    yield start
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            # Still a failure, but not one that leaves a process and its pipe to the next test.
            process.kill()
            process.communicate()
            raise


async def busy(serve: Serve, requests: int, *, stream: bool, tokens: int = 24) -> AsyncIterator[str]:
    """`requests` chat completions at once through the router; each answer's text as it ends."""
    async with openai.AsyncOpenAI(
        base_url=serve.client_url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:

        async def one() -> str:
            if stream:
                chunks = await client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=tokens, stream=True
                )
                return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=tokens)
            return answer.choices[0].message.content or ""

        for text in await asyncio.gather(*(one() for _ in range(requests))):
            yield text


async def test_each_engine_is_recognised_and_read_under_its_own_names(serve: Serve, start_engine: Any) -> None:
    kinds = ("vllm", "sglang", "llamacpp", "tgi")
    urls = {kind: start_engine(kind, "--time-scale", "4", "--max-running", "2") for kind in kinds}
    serve.write(
        [{"id": kind, "model": "m", "url": url} for kind, url in urls.items()],
        "engine_metrics_seconds = 0.05",
    )
    await serve.start()
    # Streams keep the engines busy while they are read; every answer arrives whole.
    texts = [text async for text in busy(serve, 16, stream=True)]
    assert len(texts) == 16 and all(texts)
    texts = [text async for text in busy(serve, 8, stream=False)]
    assert all(texts)

    async def rows() -> dict[str, dict[str, Any]]:
        return {row["id"]: row for row in await get_json(serve.admin_url + "/api/v1/replicas")}

    seen: dict[str, dict[str, Any]] = {}

    async def every_engine_read() -> bool:
        seen.update(await rows())
        return all(seen[kind]["engine"] == kind and seen[kind]["engine_load"] is not None for kind in kinds)

    await until(every_engine_read, timeout=10)
    loads = {kind: seen[kind]["engine_load"] for kind in kinds}
    # SGLang's small JSON first; vLLM's answers carry their load (ORCA) when not streamed, else its page.
    assert loads["sglang"]["source"] == "loads"
    assert loads["vllm"]["source"] in ("orca", "metrics")
    assert loads["llamacpp"]["source"] == loads["tgi"]["source"] == "metrics"
    # llama.cpp exports no KV use; the others do.
    assert loads["llamacpp"]["kv_cache_usage"] is None
    assert all(isinstance(loads[kind]["kv_cache_usage"], float) for kind in ("vllm", "sglang", "tgi"))
    async with aiohttp.ClientSession() as session, session.get(serve.admin_url + "/metrics") as resp:
        metrics = await resp.text()
    gauges = {
        tuple(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "router_model_saturation"
    }
    assert set(gauges) == {(("model", "m"),)}


async def test_a_saturated_engine_holds_requests_in_the_router_until_it_frees(
    serve: Serve, start_engine: Any, tmp_path: Path
) -> None:
    """One vLLM engine that runs one sequence at a time: once one request waits in it, the rest wait
    in the router instead (the access log says why), and every one of them is answered in the end."""
    url = start_engine("vllm", "--time-scale", "2", "--max-running", "1", "--metrics-seconds", "0.01")
    log = tmp_path / "access.log"
    serve.write(
        [{"id": "r0", "model": "m", "url": url}],
        f'engine_metrics_seconds = 0.02\nsaturated_waiting = 1\naccess_log = "{log}"',
    )
    await serve.start()

    async def wave(requests: int) -> list[str]:
        # Long answers (two seconds each of engine time): the engine stays saturated a while.
        return [text async for text in busy(serve, requests, stream=True, tokens=400)]

    first = asyncio.create_task(wave(4))

    async def saturated() -> bool:
        (row,) = await get_json(serve.admin_url + "/api/v1/replicas")
        return bool(row["saturated"])

    await until(saturated, timeout=10)
    texts = await wave(8) + await first
    assert len(texts) == 12 and all(texts)

    async def all_logged() -> bool:
        # A line is written once its request is over, a moment after the client has the last byte.
        return len(access_log_lines(log)) == 12

    await until(all_logged, timeout=10)
    lines = access_log_lines(log)
    assert len(lines) == 12 and all(line["status"] == 200 for line in lines)
    held = [line for line in lines if line.get("queued_for") == "engines"]
    assert held and all(line["queued_seconds"] > 0 for line in held)
    assert "Traceback" not in serve.output()


async def test_a_learned_prefix_goes_back_to_the_engine_whose_cache_holds_it(serve: Serve, start_engine: Any) -> None:
    """routing = "prefix" with prefix_placement = "learned" as it ships: four system prompts first sent
    together take one vLLM engine each, and their next requests find their prompts in that engine's cache."""
    urls = [start_engine("vllm", "--time-scale", "2") for _ in range(4)]
    serve.write(
        [{"id": f"r{n}", "model": "m", "url": url} for n, url in enumerate(urls)],
        "engine_metrics_seconds = 0.05\nexpose_replica_header = true\n"
        '[models.m]\nrouting = "prefix"\nprefix_chars = 256\nprefix_placement = "learned"',
    )
    await serve.start()
    systems = [f"You are assistant number {n}, and a careful one. " * 12 for n in range(4)]

    async with openai.AsyncOpenAI(
        base_url=serve.client_url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:

        async def replica(system: str, question: str, tokens: int) -> str:
            messages: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=messages, max_tokens=tokens
            )
            assert raw.parse().choices[0].message.content
            return raw.headers["x-router-replica"]

        # A second of engine time each: the four are in flight together.
        first = await asyncio.gather(*(replica(system, "first", 200) for system in systems))
        assert sorted(first) == ["r0", "r1", "r2", "r3"]
        again = [await replica(system, "again", 8) for system in systems]
    assert again == first

    async def prefix_hits(url: str) -> float:
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            text = await resp.text()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:prefix_cache_hits_total"
        )

    # Each engine saw its prompt twice, the second time from its cache.
    assert all([await prefix_hits(url) > 0 for url in urls])
