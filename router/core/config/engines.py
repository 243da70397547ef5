"""What the engines serve: the paths the router routes by model, and which engine serves each.

Taken from the engines' own route tables (docs/engines.md names the files):
vLLM's API server routers, SGLang's `http_server.py`, llama.cpp's
`tools/server/server.cpp`. A path some engine serves and another does not is
routed all the same: the replica of a model that lacks it answers its own 404.
"""

from __future__ import annotations

# The engines whose load the router reads, each under its own names (router.control.engines).
ENGINES = ("vllm", "sglang", "llamacpp", "tgi")

# The POST paths routed by the model their body names (config routed_paths).
ROUTED_PATHS = (
    # OpenAI's own: every engine.
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    # Anthropic's Messages API: vLLM, llama.cpp.
    "/v1/messages",
    "/v1/messages/count_tokens",
    # Pooling, scoring and tokenizers: vLLM (/classify, /tokenize and /detokenize
    # also SGLang's, /v1/rerank and /rerank also llama.cpp's).
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
    # vLLM: Cohere's embed API, SageMaker's one door (also SGLang's), the render endpoints.
    "/v2/embed",
    "/invocations",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/responses/render",
    # SGLang's OpenAI-style classify and tokenizers.
    "/v1/classify",
    "/v1/tokenize",
    "/v1/detokenize",
    # llama.cpp: its unprefixed and legacy paths, infill, templates, reranking, input-token counts.
    "/completion",
    "/completions",
    "/chat/completions",
    "/embedding",
    "/embeddings",
    "/responses",
    "/infill",
    "/apply-template",
    "/reranking",
    "/v1/reranking",
    "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens",
    "/responses/input_tokens",
    "/v1/responses/input_tokens",
    "/audio/transcriptions",
    # Audio and images: vLLM (transcriptions also llama.cpp's), and the engines that serve speech and images.
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
    "/v1/images/generations",
)

# The routed paths whose answers write tokens (text generated, bounded by max_tokens and the
# like): a rate limit's estimate adds the output only on these (router.core.limits.estimates).
# The others (embeddings, scores, tokenizers, token counts, renders) cost their input alone.
GENERATING_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/completion",
        "/completions",
        "/chat/completions",
        "/responses",
        "/infill",
    }
)

# The GET paths a WebSocket upgrade is routed on, by the query's `model`
# (config upgrade_paths): vLLM's realtime API.
UPGRADE_PATHS = ("/v1/realtime",)

# The paths whose errors are Anthropic-shaped, `{"type": "error", "error": {"type", "message"}}`:
# an Anthropic client reads no other shape.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
