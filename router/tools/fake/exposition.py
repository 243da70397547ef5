"""A simulated engine's load under each engine's own names: /metrics, SGLang's /v1/loads, vLLM's ORCA header.

Each engine's names and shapes are its own, read from its source (docs/routing.md):

- vLLM (vllm/v1/metrics/loggers.py): gauges `vllm:num_requests_waiting`,
  `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (a fraction),
  labelled `{engine, model_name}`; `vllm:cache_config_info` (value 1, the cache
  config as labels); counters of the prefix cache; histograms make up most of
  the page (about 60 KB for one engine), and come after the gauges. With
  `endpoint-load-metrics-format: text|json` on a request, the answer of a
  non-streaming chat or completion carries `endpoint-load-metrics` (ORCA:
  vllm/entrypoints/serve/utils/orca_metrics.py).
- SGLang (sglang/srt/observability/metrics_collector.py, v1_loads.py):
  `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage` (a
  fraction, two decimals), and `GET /v1/loads` (JSON, fresher).
- llama.cpp (tools/server/server-task.cpp): `llamacpp:requests_processing`,
  `llamacpp:requests_deferred`; no KV gauge in current code.
- TGI (backends/v3): `tgi_queue_size`, `tgi_batch_current_size`,
  `tgi_batch_current_max_tokens`, `tgi_batch_max_total_tokens`.

Beside them, what vLLM's router (vllm-project/router, vllm-router on PyPI)
polls for its `power_of_two` policy: `GET /get_load`, of whose JSON it reads
the integer `load` alone (src/routers/http/router.rs, get_worker_load_static);
served by the simulated vLLM engine as its requests running plus waiting.
"""

from __future__ import annotations

import orjson

from router.tools.fake.engine import EngineReport

ENGINES = ("vllm", "sglang", "llamacpp", "tgi")

# vLLM's histograms, as many buckets as it has: what makes its page tens of kilobytes.
_VLLM_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", 30),
    ("vllm:inter_token_latency_seconds", 20),
    ("vllm:e2e_request_latency_seconds", 22),
    ("vllm:request_queue_time_seconds", 22),
    ("vllm:request_prefill_time_seconds", 22),
    ("vllm:request_decode_time_seconds", 22),
    ("vllm:request_prompt_tokens", 26),
    ("vllm:request_generation_tokens", 26),
    ("vllm:iteration_tokens_total", 18),
    ("vllm:request_max_num_generation_tokens", 26),
    ("vllm:request_params_n", 6),
    ("vllm:request_params_max_tokens", 26),
    ("vllm:request_inference_time_seconds", 22),
)


def metrics_page(kind: str, model: str, report: EngineReport) -> bytes:
    """The engine's /metrics page, in Prometheus text, as `kind` names it."""
    if kind == "vllm":
        return _vllm(model, report)
    if kind == "sglang":
        return _sglang(model, report)
    if kind == "llamacpp":
        return _llamacpp(report)
    return _tgi(report)


def _vllm(model: str, r: EngineReport) -> bytes:
    labels = f'engine="0",model_name="{model}"'
    lines = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 12345.0',
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(r.running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(r.waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {r.kv_usage}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{labels}}} {float(r.prefix_queries)}",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{labels}}} {float(r.prefix_hits)}",
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{labels}}} {float(r.preemptions)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{labels}}} {float(r.prompt_tokens)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {float(r.generation_tokens)}",
    ]
    for name, buckets in _VLLM_HISTOGRAMS:
        lines += [f"# HELP {name} Histogram of {name}.", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{{labels},le="{0.001 * 2**i:g}"}} 0.0' for i in range(buckets)]
        lines += [f'{name}_bucket{{{labels},le="+Inf"}} 0.0', f"{name}_count{{{labels}}} 0.0"]
        lines.append(f"{name}_sum{{{labels}}} 0.0")
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{r.block_tokens}",cache_dtype="auto",enable_prefix_caching="True",'
        f'engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="{r.kv_blocks}"}} 1.0',
    ]
    return ("\n".join(lines) + "\n").encode()


def _sglang(model: str, r: EngineReport) -> bytes:
    labels = f'engine_type="unified",model_name="{model}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    total = r.kv_blocks * r.block_tokens
    gauges = (
        ("sglang:num_running_reqs", "The number of running requests.", float(r.running)),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", float(r.waiting)),
        ("sglang:token_usage", "The token usage.", round(r.kv_usage, 2)),
        ("sglang:num_used_tokens", "The number of used tokens.", float(round(r.kv_usage * total))),
        ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", float(total)),
        ("sglang:cache_hit_rate", "The prefix cache hit rate.", _rate(r.prefix_hits, r.prefix_queries)),
    )
    lines = []
    for name, text, value in gauges:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    return ("\n".join(lines) + "\n").encode()


def _llamacpp(r: EngineReport) -> bytes:
    lines = [
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens.",
        "# TYPE llamacpp:prompt_tokens_total counter",
        f"llamacpp:prompt_tokens_total {r.prompt_tokens}",
        "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.",
        "# TYPE llamacpp:tokens_predicted_total counter",
        f"llamacpp:tokens_predicted_total {r.generation_tokens}",
        "# HELP llamacpp:requests_processing Number of requests processing.",
        "# TYPE llamacpp:requests_processing gauge",
        f"llamacpp:requests_processing {r.running}",
        "# HELP llamacpp:requests_deferred Number of requests deferred.",
        "# TYPE llamacpp:requests_deferred gauge",
        f"llamacpp:requests_deferred {r.waiting}",
    ]
    return ("\n".join(lines) + "\n").encode()


def _tgi(r: EngineReport) -> bytes:
    total = r.kv_blocks * r.block_tokens
    lines = [
        "# TYPE tgi_queue_size gauge",
        f"tgi_queue_size {r.waiting}",
        "# TYPE tgi_batch_current_size gauge",
        f"tgi_batch_current_size {r.running}",
        "# TYPE tgi_batch_current_max_tokens gauge",
        f"tgi_batch_current_max_tokens {round(r.kv_usage * total)}",
        "# TYPE tgi_batch_max_total_tokens gauge",
        f"tgi_batch_max_total_tokens {total}",
    ]
    return ("\n".join(lines) + "\n").encode()


def sglang_loads(r: EngineReport, timestamp: float) -> bytes:
    """SGLang's GET /v1/loads: one entry per data-parallel rank (here one)."""
    total = r.kv_blocks * r.block_tokens
    load = {
        "timestamp": timestamp,
        "dp_rank": 0,
        "num_running_reqs": r.running,
        "num_waiting_reqs": r.waiting,
        "num_used_tokens": round(r.kv_usage * total),
        "max_total_num_tokens": total,
        "token_usage": round(r.kv_usage, 4),
        "cache_hit_rate": round(_rate(r.prefix_hits, r.prefix_queries), 4),
    }
    return orjson.dumps({"timestamp": "", "version": "0.5.23", "loads": [load]})


def router_load(r: EngineReport) -> bytes:
    """vLLM's router's GET /get_load: {"load": N}, an integer (here the requests running and waiting)."""
    return orjson.dumps({"load": r.running + r.waiting})


def orca_header(form: str, r: EngineReport) -> str | None:
    """vLLM's `endpoint-load-metrics` value for a request that asked in `form` (text or json, any case)."""
    form = form.lower()
    metrics = {"kv_cache_usage_perc": r.kv_usage, "num_requests_waiting": float(r.waiting)}
    if form == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in metrics.items())
    if form == "json":
        return "JSON " + orjson.dumps({"named_metrics": metrics}).decode()
    return None


def _rate(hits: int, queries: int) -> float:
    return hits / queries if queries else 0.0
