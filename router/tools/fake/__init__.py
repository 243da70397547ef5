"""A fake OpenAI replica: good enough to stand in for vLLM in tests, demo, bench.

switches.py   `Behaviour`, the switches a test flips while the replica runs, and `Seen`
replica.py    `FakeReplica`: the aiohttp app, its routes, what it records, start and kill
inference.py  chat, completions and embeddings, whole or streamed
streams.py    vLLM's chunk framing and the stream writer (pacing, resets, raw bytes)
prefix.py     the prefix cache an engine keeps, and the prompt as a chat template lays it out
responses.py  the Responses API and its store: only the replica that made a response knows it
echo.py       the other endpoints vLLM and SGLang serve, answered with an echo; audio
messages.py   Anthropic's Messages API as vLLM and llama.cpp serve it, whole or streamed
engine.py     a simulated engine (`--engine`): continuous batching, a paged KV cache, a prefix cache
simulated.py  chat and completions answered with the simulated engine's tokens, as they come
exposition.py the simulated engine's load under each engine's names: /metrics, /v1/loads, ORCA
sleep.py      vLLM's sleep API and SGLang's memory release (`--enable-sleep-mode`), with their times
cli.py        `router fake`, or `python -m router.tools.fake` (`__main__.py`)
"""

from router.tools.fake.replica import FakeReplica
from router.tools.fake.sleep import SleepMode
from router.tools.fake.switches import Behaviour, Seen

__all__ = ["Behaviour", "FakeReplica", "Seen", "SleepMode"]
