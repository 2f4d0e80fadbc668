"""OpenAI-compatible HTTP server (`dflash-native serve`): Starlette on uvicorn, the [server] extra.

One Engine with `--parallel N` sequence slots (Engine(n_seq=N)): up to N requests run at once, each
calling generate on a worker thread of its own, and the core's scheduler batches them into shared
target passes (each request's output is its output run alone, bit for bit). A request's work
before it has a slot (its JSON, the chat template, tokenization) runs on a small thread pool: the
event loop never computes, so a long prompt does not stall /health or the running streams. A body
over max_body_bytes (default 8 MiB) is a 413. Requests wait in a bounded queue (503 when it is
full). The core puts a request in the free slot whose held sequence its prompt continues (the prompt
cache: Engine.generate's cache_prompt). A streamed request whose client goes away is closed at the
engine's next step, and its slot freed.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with stream: true as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus text). Every response carries a
`usage` block and, as an extension, `dflash`: the request's GenerationStats. Chat requests take
OpenAI's `tools` and `tool_choice` (tools.py: the checks, and the output's calls parsed); a forced call
("required", a named function) and `response_format` are grammar constraints (constraint.py).

The modules: protocol.py (request fields and their checks, response shapes, server-sent events,
OpenAI's error body), slots.py (the slot pool, jobs, metrics), app.py
(routes, lifespan, create_app, serve).
"""

try:
    import starlette  # noqa: F401
except ImportError as e:  # the optional extra
    raise ImportError(f"the server needs the [server] extra: pip install 'dflash-native[server]' ({e})") from None

from .app import DEFAULT_MAX_BODY_BYTES, create_app, serve
from .protocol import ApiError
from .slots import Metrics, SlotPool

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ApiError", "Metrics", "SlotPool", "create_app", "serve"]
