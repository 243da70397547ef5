"""What the engines report of their load: a Prometheus page, SGLang's /v1/loads, vLLM's ORCA header. Pure.

Only the few families routing needs are read, never the whole page: a vLLM
page is tens of kilobytes, mostly histograms that come after its gauges,
and a thousand replicas read a second would spend a core on full parses.
Each family's lines are found with `bytes.find` and only they are split.
The names are each engine's own (docs/routing.md names the source files):

- vllm: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc` (before 0.9.2, and hidden from 0.11: the same as
  `vllm:gpu_cache_usage_perc`, read when the other is missing);
- sglang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`;
- llamacpp: `llamacpp:requests_deferred`, `llamacpp:requests_processing`, and no
  KV gauge in current llama-server;
- tgi: `tgi_queue_size`, `tgi_batch_current_size`, and the KV use as
  `tgi_batch_current_max_tokens` over `tgi_batch_max_total_tokens`.

An engine with several cores (vLLM's data parallel `engine="k"`, SGLang's
`dp_rank`) has a line per core: the queues and batches are summed, the KV
use is the fullest core's. SGLang with priority scheduling also writes a
line per priority besides the total (`priority=""`): only the total counts.
A family that is missing, or a value that is no number (or NaN, infinite,
negative), makes the reading None: unknown, never zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

ENGINE_PREFIXES = (("vllm", b"vllm:"), ("sglang", b"sglang:"), ("llamacpp", b"llamacpp:"), ("tgi", b"tgi_"))


@dataclass(frozen=True, slots=True)
class Reading:
    """An engine's load as it reported it; None: the engine does not say."""

    waiting: float
    running: float | None
    kv: float | None


def recognise(page: bytes) -> str | None:
    """Which engine wrote this Prometheus page, by the names it exports; None: none we know."""
    for engine, prefix in ENGINE_PREFIXES:
        if b"\n" + prefix in page or page.startswith(prefix):
            return engine
    return None


def _values(page: bytes, name: bytes) -> list[tuple[bytes, float]] | None:
    """Each sample of the family `name` (no suffix): its labels' text and its value; None: no such line."""
    found: list[tuple[bytes, float]] = []
    start = 0
    needle = b"\n" + name
    if page.startswith(name):
        page = b"\n" + page
    while (at := page.find(needle, start)) >= 0:
        at += 1
        end = page.find(b"\n", at)
        line = page[at:] if end < 0 else page[at:end]
        start = at
        rest = line[len(name) :]
        if rest[:1] == b"{":
            close = rest.rfind(b"}")
            if close < 0:
                return None
            labels, value = rest[1:close], rest[close + 1 :]
        elif rest[:1] == b" ":
            labels, value = b"", rest
        else:
            # Another family whose name starts with this one's (num_requests_waiting_by_reason).
            continue
        fields = value.split()
        if not fields:
            return None
        try:
            number = float(fields[0])
        except ValueError:
            return None
        if not _plausible(number):
            return None
        found.append((labels, number))
    return found or None


def _plausible(number: float) -> bool:
    """A count or a share as an engine could mean it: not NaN, not infinite, not below zero. A page that
    says otherwise is broken (or hostile), and its reading unknown: an infinite queue would hold every
    request of the model in the router, a negative one draw them all to it."""
    return math.isfinite(number) and number >= 0


def _summed(page: bytes, name: bytes) -> float | None:
    samples = _values(page, name)
    return None if samples is None else sum(value for _, value in samples)


def _fullest(page: bytes, name: bytes) -> float | None:
    samples = _values(page, name)
    return None if samples is None else max(value for _, value in samples)


def from_metrics(engine: str, page: bytes) -> Reading | None:
    """The load in `engine`'s Prometheus page; None when a family it must have is missing or garbled."""
    kv: float | None
    if engine == "vllm":
        waiting = _summed(page, b"vllm:num_requests_waiting")
        running = _summed(page, b"vllm:num_requests_running")
        kv = _fullest(page, b"vllm:kv_cache_usage_perc")
        if kv is None:
            kv = _fullest(page, b"vllm:gpu_cache_usage_perc")
    elif engine == "sglang":
        waiting = _sglang_summed(page, b"sglang:num_queue_reqs")
        running = _sglang_summed(page, b"sglang:num_running_reqs")
        kv = _fullest(page, b"sglang:token_usage")
    elif engine == "llamacpp":
        waiting = _summed(page, b"llamacpp:requests_deferred")
        running = _summed(page, b"llamacpp:requests_processing")
        kv = None
    elif engine == "tgi":
        waiting = _summed(page, b"tgi_queue_size")
        running = _summed(page, b"tgi_batch_current_size")
        used = _summed(page, b"tgi_batch_current_max_tokens")
        total = _summed(page, b"tgi_batch_max_total_tokens")
        kv = used / total if used is not None and total else None
    else:
        return None
    if waiting is None or running is None:
        return None
    return Reading(waiting, running, kv if kv is None else min(max(kv, 0.0), 1.0))


def _sglang_summed(page: bytes, name: bytes) -> float | None:
    """A family SGLang may split by priority: its totals (priority="") where it does, else every line."""
    samples = _values(page, name)
    if samples is None:
        return None
    if any(b'priority="' in labels for labels, _ in samples):
        samples = [(labels, value) for labels, value in samples if b'priority=""' in labels]
    return sum(value for _, value in samples)


def from_sglang_loads(body: bytes) -> Reading | None:
    """SGLang's GET /v1/loads: a load per data-parallel rank, summed (its KV use, the fullest rank's)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    loads = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    waiting = running = 0.0
    kv = 0.0
    for load in loads:
        if not isinstance(load, dict):
            return None
        w, r, k = load.get("num_waiting_reqs"), load.get("num_running_reqs"), load.get("token_usage")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and _plausible(v) for v in (w, r, k)):
            return None
        waiting += float(w)  # type: ignore[arg-type]
        running += float(r)  # type: ignore[arg-type]
        kv = max(kv, float(k))  # type: ignore[arg-type]
    return Reading(waiting, running, min(max(kv, 0.0), 1.0))


def from_orca(value: bytes) -> Reading | None:
    """vLLM's `endpoint-load-metrics` answer header, TEXT form (the queue and the KV cache; no batch).

    `TEXT named_metrics.kv_cache_usage_perc=0.41, named_metrics.num_requests_waiting=0.0`; an engine
    of several cores repeats each name in its cores' order: the queues summed, the fullest KV cache.
    """
    if not value.startswith(b"TEXT "):
        return None
    waiting: float | None = None
    kv: float | None = None
    for item in value[5:].split(b","):
        name, _, number = item.strip().partition(b"=")
        try:
            figure = float(number)
        except ValueError:
            return None
        if not _plausible(figure):
            return None
        if name == b"named_metrics.num_requests_waiting":
            waiting = figure if waiting is None else waiting + figure
        elif name == b"named_metrics.kv_cache_usage_perc":
            kv = figure if kv is None else max(kv, figure)
    if waiting is None:
        return None
    return Reading(waiting, None, kv if kv is None else min(max(kv, 0.0), 1.0))
