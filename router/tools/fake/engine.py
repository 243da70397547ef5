"""A simulated engine, good enough to judge routing by: continuous batching, a paged KV cache, a prefix cache.

What a real engine does that decides where a request should go, and nothing
more (no model): requests wait in a first-come-first-served queue; each step
of the engine decodes one token for every running sequence and prefills
waiting ones within a token budget (chunked prefill, as vLLM's V1 scheduler);
a sequence holds KV blocks for its prompt and what it generated, in a pool
of a fixed number of blocks; the blocks of a finished sequence stay cached,
least recently used evicted first, and a new prompt finds the blocks of its
prefix there (a block only after every block before it, as vLLM's automatic
prefix caching hashes them); when decoding needs a block and none is free,
the newest running sequence is preempted back to the queue, to be prefilled
again. A step takes `step_seconds` plus a little per sequence decoded plus the
prefill of its chunk, which grows with the prompt's uncached tokens (a
calibration quoted for vLLM's router: 0.066 s + 0.057 s per 1k tokens +
0.0044 s per 1k^2; docs/routing.md says what it stands on); `time_scale` runs
engine time that many times faster than wall time.

The engine publishes what its metrics say (EngineReport) at the end of a
step, at most once per `metrics_seconds`: the lag of a real engine's gauges.
Defaults (EngineParams) are those of an 8B model on one H100 with vLLM's
defaults, from published figures (docs/routing.md: where each comes from).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

# Characters a token, as the tokenizers of English text make them.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class EngineParams:
    """The simulated engine's size and speed (docs/routing.md says where each default comes from)."""

    # Sequences running at once (vLLM's --max-num-seqs; 256 by default, bound here by KV first).
    max_running: int = 128
    # Tokens one step may process, decodes and prefill chunks together (--max-num-batched-tokens).
    step_tokens: int = 8192
    # KV cache: blocks of `block_tokens` tokens (vLLM's num_gpu_blocks for an 8B model in bf16 on an
    # 80 GB GPU at 0.9 memory use is about 30,000 blocks of 16 tokens; a smaller cache makes the
    # pressure of a few replicas show at a few hundred requests).
    kv_blocks: int = 4096
    block_tokens: int = 16
    # A step's fixed cost, and what each sequence decoded in it adds (time per output token of an
    # 8B model: about 10 ms alone, about 25 ms in a batch of 100).
    step_seconds: float = 0.010
    per_sequence_seconds: float = 0.00015
    # What a request costs before the GPU sees it (the server, the tokenizer, the scheduler's
    # first look): the fixed part of vLLM's router's calibration of a prefill (0.066 s), paid
    # by each request on arrival, not by the GPU's steps.
    overhead_seconds: float = 0.066
    # Prefill of k uncached tokens in one step: per 1k, and per 1k squared (attention).
    prefill_per_1k_seconds: float = 0.057
    prefill_per_1k2_seconds: float = 0.0044
    # The engine's gauges are published at most this often (engine seconds; 0: every step).
    metrics_seconds: float = 0.0
    # Engine time runs this many times faster than wall time.
    time_scale: float = 1.0


@dataclass(slots=True)
class EngineReport:
    """What the engine's metrics say, as of its last publication."""

    waiting: int = 0
    running: int = 0
    # Used KV blocks over all blocks, 0..1 (vLLM's kv_cache_usage_perc is this fraction).
    kv_usage: float = 0.0
    kv_blocks: int = 0
    block_tokens: int = 16
    # Prompt tokens looked up in the prefix cache, and those found there (counters).
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    # Requests finished, and prompt and generation tokens (counters).
    finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine: its prompt's blocks, what it generated, and its tokens as they come."""

    prompt_tokens: int
    max_tokens: int
    # The chained hashes of the prompt's whole blocks, in order.
    hashes: list[bytes]
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    generated: int = 0
    # Tokens of the prompt (and, after a preemption, of what it generated) still to prefill.
    to_prefill: int = 0
    # Prompt tokens found in the prefix cache at its (last) admission.
    cached_tokens: int = 0
    # Blocks it holds only for itself, and the cached blocks it shares (pinned while it runs).
    own_blocks: int = 0
    shared: list[bytes] = field(default_factory=list)
    aborted: bool = False

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated


def block_hashes(text: str, block_tokens: int) -> list[bytes]:
    """The prompt's whole blocks, each hash covering every block before it (found only after its prefix)."""
    size = block_tokens * CHARS_PER_TOKEN
    chain = b""
    out = []
    for start in range(0, len(text) - size + 1, size):
        chain = hashlib.blake2b(chain + text[start : start + size].encode(), digest_size=16).digest()
        out.append(chain)
    return out


class Engine:
    """One simulated engine: its queue, its running batch, its KV blocks and prefix cache, stepped on the loop."""

    def __init__(self, params: EngineParams | None = None) -> None:
        self.params = params = params or EngineParams()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Cached blocks no running sequence uses: evictable, least recently used first.
        self.cached: OrderedDict[bytes, None] = OrderedDict()
        # Cached blocks running sequences use, with how many use each.
        self.pinned: dict[bytes, int] = {}
        self.own_blocks = 0
        self.report = EngineReport(kv_blocks=params.kv_blocks, block_tokens=params.block_tokens)
        self._counts = EngineReport(kv_blocks=params.kv_blocks, block_tokens=params.block_tokens)
        self._published_at = -math.inf
        # This step's prefill chunks: (sequence, tokens), laid out by _step_plan.
        self._chunks: list[tuple[Sequence, int]] = []
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # Requests ---------------------------------------------------------------------------

    def submit(self, prompt: str, max_tokens: int) -> Sequence:
        """A request into the queue: its tokens arrive on `tokens` (None at the end)."""
        tokens = max(1, len(prompt) // CHARS_PER_TOKEN)
        seq = Sequence(tokens, max(1, max_tokens), block_hashes(prompt, self.params.block_tokens))
        seq.to_prefill = tokens
        params = self.params
        asyncio.get_running_loop().call_later(params.overhead_seconds / params.time_scale, self._arrive, seq)
        return seq

    def _arrive(self, seq: Sequence) -> None:
        if not seq.aborted:
            self.waiting.append(seq)
            self._start()

    def abort(self, seq: Sequence) -> None:
        """The client left: the sequence leaves the engine, its blocks with it."""
        if seq.aborted:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq, keep=False)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass

    @property
    def used_blocks(self) -> int:
        return self.own_blocks + len(self.pinned)

    def _start(self) -> None:
        self._work.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for seq in [*self.running, *self.waiting]:
            seq.tokens.put_nowait(None)

    # The loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        scale = self.params.time_scale
        while True:
            if not self.running and not self.waiting:
                self._publish(self._engine_time(loop.time(), started, scale), force=True)
                self._work.clear()
                await self._work.wait()
                continue
            seconds = self._step_plan()
            await asyncio.sleep(seconds / scale)
            self._step_done()
            # What arrived during the step is admitted before the reading is taken, as vLLM's
            # scheduler takes its input queue into the next schedule and reports its stats after it
            # (vllm/v1/engine/core.py, EngineCore.step): an engine's `waiting` counts what its batch
            # could not take in, never a request between its arrival and the next step.
            self._admit()
            self._publish(self._engine_time(loop.time(), started, scale))

    @staticmethod
    def _engine_time(now: float, started: float, scale: float) -> float:
        return (now - started) * scale

    def _step_plan(self) -> float:
        """Admit what fits and lay out this step's work; how long it takes, in engine seconds."""
        p = self.params
        self._admit()
        budget = p.step_tokens
        decoding = [s for s in self.running if not s.to_prefill]
        budget -= len(decoding)
        seconds = p.step_seconds + p.per_sequence_seconds * len(decoding)
        chunk_tokens = 0
        self._chunks = []
        for seq in self.running:
            if not seq.to_prefill or budget <= 0:
                continue
            chunk = min(seq.to_prefill, budget)
            budget -= chunk
            chunk_tokens += chunk
            self._chunks.append((seq, chunk))
        k = chunk_tokens / 1000
        return seconds + p.prefill_per_1k_seconds * k + p.prefill_per_1k2_seconds * k * k

    def _admit(self) -> None:
        """Waiting sequences into the batch, first come first served, while a slot and their blocks are free."""
        p = self.params
        while self.waiting and len(self.running) < p.max_running:
            seq = self.waiting[0]
            if seq.aborted:
                self.waiting.popleft()
                continue
            found = 0
            for digest in seq.hashes:
                if digest not in self.cached and digest not in self.pinned:
                    break
                found += 1
            # Blocks of its own: what the cache does not hold of its context, and one to grow into.
            need = math.ceil(seq.context / p.block_tokens) - found + 1
            if not self._make_room(need):
                # Head-of-line: nothing behind it jumps the queue (FCFS).
                return
            self.waiting.popleft()
            shared = seq.hashes[:found]
            for digest in shared:
                if digest in self.cached:
                    del self.cached[digest]
                self.pinned[digest] = self.pinned.get(digest, 0) + 1
            seq.shared = shared
            seq.own_blocks = need
            self.own_blocks += need
            cached = found * p.block_tokens
            seq.cached_tokens = min(cached, seq.prompt_tokens)
            seq.to_prefill = max(1, seq.context - cached)
            counts = self._counts
            counts.prefix_queries += seq.prompt_tokens
            counts.prefix_hits += seq.cached_tokens
            self.running.append(seq)

    def _make_room(self, blocks: int) -> bool:
        """Free blocks for `blocks` more, evicting cached ones least recently used first; False if none can."""
        free = self.params.kv_blocks - self.used_blocks - len(self.cached)
        while free < blocks and self.cached:
            self.cached.popitem(last=False)
            free += 1
        return free >= blocks

    def _step_done(self) -> None:
        """The step's tokens: one per decoding sequence, the first for those whose prefill ended."""
        p = self.params
        prefilled = dict(self._chunks)
        self._chunks = []
        for seq in list(self.running):
            if seq.aborted:
                continue
            chunk = prefilled.get(seq)
            if chunk is not None:
                seq.to_prefill -= chunk
                if seq.to_prefill:
                    continue
                self._cache_prompt(seq)
            elif seq.to_prefill:
                continue
            # A token: one more block when it crosses into a new one.
            if seq.context % p.block_tokens == 0 and not self._grow(seq):
                continue
            seq.tokens.put_nowait(seq.generated)
            seq.generated += 1
            self._counts.generation_tokens += 1
            if seq.generated >= seq.max_tokens:
                self.running.remove(seq)
                self._release(seq, keep=True)
                seq.tokens.put_nowait(None)
                self._counts.finished += 1
                self._counts.prompt_tokens += seq.prompt_tokens

    def _cache_prompt(self, seq: Sequence) -> None:
        """A prompt prefilled: its whole blocks are cached at once (shared, pinned while it runs),
        so that a prompt arriving now finds them, as vLLM's prefix caching does."""
        fresh = seq.hashes[len(seq.shared) :]
        for digest in fresh:
            users = self.pinned.get(digest)
            if users is None and digest in self.cached:
                # Computed again meanwhile by another: the cached copy is taken, this one freed.
                del self.cached[digest]
                users = 0
            self.pinned[digest] = (users or 0) + 1
        seq.own_blocks -= len(fresh)
        self.own_blocks -= len(fresh)
        seq.shared = list(seq.hashes)

    def _grow(self, seq: Sequence) -> bool:
        """A block for `seq`'s next token; if none is free, the newest running sequence is preempted."""
        while not self._make_room(1):
            victim = self.running[-1]
            self.running.remove(victim)
            self._release(victim, keep=False)
            # Back to the front of the queue, to prefill its prompt and what it generated again.
            victim.to_prefill = victim.context
            self.waiting.appendleft(victim)
            self._counts.preemptions += 1
            if victim is seq:
                return False
        seq.own_blocks += 1
        self.own_blocks += 1
        return True

    def _release(self, seq: Sequence, *, keep: bool) -> None:
        """`seq`'s blocks back to the pool; with `keep`, its prompt's blocks stay cached for the next prompt."""
        self.own_blocks -= seq.own_blocks
        seq.own_blocks = 0
        for digest in seq.shared:
            users = self.pinned[digest] - 1
            if users:
                self.pinned[digest] = users
            else:
                del self.pinned[digest]
                self.cached[digest] = None
        seq.shared = []
        if keep:
            for digest in seq.hashes:
                if digest in self.cached:
                    self.cached.move_to_end(digest)

    def _publish(self, now: float, force: bool = False) -> None:
        if not force and now - self._published_at < self.params.metrics_seconds:
            return
        self._published_at = now
        counts = self._counts
        counts.waiting = len(self.waiting)
        counts.running = len(self.running)
        counts.kv_usage = self.used_blocks / self.params.kv_blocks
        self.report = EngineReport(**{name: getattr(counts, name) for name in EngineReport.__slots__})
