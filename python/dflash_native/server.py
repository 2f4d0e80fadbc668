"""OpenAI-compatible HTTP server (`dflash-native serve`): Starlette on uvicorn, the [server] extra.

A pool of slots, each an Engine that runs one sequence at a time on its own worker thread; a
request's work before it has a slot (its JSON, the chat template, tokenization) runs on a small
thread pool: the event loop never computes, so a long prompt does not stall /health or the running
streams. A body over max_body_bytes (default 8 MiB) is a 413. Requests wait in a bounded queue
(503 when it is full). A request goes to a free slot whose held sequence its prompt continues (the
prompt cache: Engine.generate's cache_prompt), else to the free slot holding the least. A streamed request whose client goes away
is closed at the engine's next step, and its slot freed.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with stream: true as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus text). Every response carries a
`usage` block and, as an extension, `dflash`: the request's GenerationStats. Chat requests take
OpenAI's `tools` and `tool_choice` (tools.py: the checks, and the output's calls parsed); a forced call
("required", a named function) and `response_format` are grammar constraints (constraint.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # the optional extra
    raise ImportError(f"the server needs the [server] extra: pip install 'dflash-native[server]' ({e})") from None

from . import _core
from . import tools as _tools
from .constraint import JsonSchema
from .engine import Engine, GenerationResult

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any context's worth of text, well below what hurts
# the chat roles the server passes to the template (OpenAI's; "developer" is its newer name for "system")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ---- request fields ----------------------------------------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default=None, check=None, what: str = ""):
    """body[name] when present and not null, of one of `kinds` (bool never counts as a number) and
    passing `check`; else `default`. A wrong type or value is a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise ApiError(400, f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)}, got {v!r}", name)
    if check is not None and not check(v):
        raise ApiError(400, f"'{name}' must be {what}, got {v!r}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 4:
        if "" in v:
            raise ApiError(400, "'stop' strings must not be empty (an empty stop string would match at once)", "stop")
        for s in v:
            try:
                s.encode("utf-8")
            except UnicodeError:  # a lone surrogate ("\ud800" in the JSON): no text the model writes matches it
                raise ApiError(400, f"'stop' string {s!r} is not valid Unicode text", "stop") from None
        return v
    raise ApiError(400, f"'stop' must be a string or a list of at most 4 strings, got {v!r}"[:300], "stop")


_GENERATE_TAKES_LOGPROBS = "logprobs" in inspect.signature(Engine.generate).parameters


# fields that change the output and that this server does not implement: a value other than
# OpenAI's default is refused (400, code "not_supported") rather than silently ignored
_UNSUPPORTED = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "best_of": 1, "suffix": "",
                "functions": [], "function_call": "none"}
_I64 = 1 << 63


def _sampling_fields(body: dict, chat: bool) -> dict:
    """generate() keyword arguments from the request's sampling fields, every value checked here (a
    streamed response has sent its 200 before the engine would check them)."""
    if _field(body, "n", (int,), 1) != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    for name, default in _UNSUPPORTED.items():
        if body.get(name) is not None and body[name] != default:
            raise ApiError(400, f"'{name}' is not supported by this server (only its default, {default!r})", name,
                           "not_supported")
    constraint = _response_format(body.get("response_format"))
    num = (int, float)
    kw = dict(
        temperature=float(_field(body, "temperature", num, 0.0, lambda x: 0 <= x <= 2, "a number in [0, 2]")),
        top_p=float(_field(body, "top_p", num, 1.0, lambda x: 0 < x <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", (int,), 0, lambda x: 0 <= x < _I64, "an int in [0, 2**63)"),
        min_p=float(_field(body, "min_p", num, 0.0, lambda x: 0 <= x < 1, "a number in [0, 1)")),
        seed=_field(body, "seed", (int,), None, lambda x: 0 <= x < 1 << 64, "an int in [0, 2**64)"),
        stop=_stop(body),
    )
    if constraint is not None:
        kw["constraint"] = constraint
    spec = _field(body, "speculative", (bool,), None)  # extension: False runs AR on the same slot
    if spec is not None:
        kw["speculative"] = spec
    # logprobs: completions take an int (the alternatives per token), chat a bool plus top_logprobs
    n_max = _core.MAX_LOGPROBS
    top = ((int,), None, lambda x: 0 <= x <= n_max, f"an int in [0, {n_max}]")
    if chat:
        lp = _field(body, "top_logprobs", *top)
        if not _field(body, "logprobs", (bool,), False):
            if lp is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        elif lp is None:
            lp = 0
    else:
        lp = _field(body, "logprobs", *top)
    if lp is not None:
        if not _GENERATE_TAKES_LOGPROBS:
            raise ApiError(400, "logprobs are not supported by this engine", "logprobs", "not_supported")
        kw["logprobs"] = lp
    return kw


def _response_format(fmt) -> JsonSchema | None:
    """OpenAI's response_format as a constraint: {"type": "text"} (or none): None; {"type":
    "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"name": ..., "schema":
    {...}, "strict": ...}}: that schema (no "schema": any JSON object). Anything else is a 400."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema()
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError(400, "'response_format' of type 'json_schema' needs a 'json_schema' object", "response_format")
        schema = js.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise ApiError(400, f"'response_format.json_schema.schema' must be a JSON schema object, got "
                                f"{type(schema).__name__}", "response_format")
        return JsonSchema(schema)
    raise ApiError(400, f"'response_format' must be {{'type': 'text' | 'json_object' | 'json_schema'}}, got "
                        f"{fmt!r}"[:300], "response_format")


# ---- slots -------------------------------------------------------------------------------------

class _Slot:
    """One engine and the single thread that runs all its calls (Engine's thread model: one owner)."""

    def __init__(self, index: int, engine: Engine):
        self.index, self.engine = index, engine
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slot{index}")
        self.last_used = 0.0

    def held(self) -> list[int]:
        held = self.engine._held  # the prompt cache's sequence (None: nothing reusable)
        return held[0] if held is not None else []


class SlotPool:
    """Free slots and a bounded FIFO of waiting requests (event-loop side only)."""

    def __init__(self, engines: list[Engine], max_queue: int):
        self.slots = [_Slot(i, e) for i, e in enumerate(engines)]
        self.free = list(self.slots)
        self.waiting: list[asyncio.Future] = []
        self.max_queue = max_queue

    def _pick(self, prompt: list[int]) -> _Slot:
        def reuse(s: _Slot) -> int:
            h = s.held()
            return len(h) if 0 < len(h) < len(prompt) and prompt[:len(h)] == h else 0

        # the longest reuse; else the slot holding least (the cheapest cache to lose), least recently used
        best = max(self.free, key=lambda s: (reuse(s), -len(s.held()), -s.last_used))
        self.free.remove(best)
        return best

    async def acquire(self, prompt: list[int]) -> _Slot:
        if self.free and not self.waiting:
            return self._pick(prompt)
        if len(self.waiting) >= self.max_queue:
            raise ApiError(503, f"server busy: {len(self.slots)} slots busy and {len(self.waiting)} requests queued",
                           code="queue_full", kind="server_error")
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut in self.waiting:
                self.waiting.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed a slot just as the client left
            raise

    def release(self, slot: _Slot) -> None:
        slot.last_used = time.monotonic()
        while self.waiting:
            fut = self.waiting.pop(0)
            if not fut.done():
                fut.set_result(slot)
                return
        self.free.append(slot)


# ---- metrics -----------------------------------------------------------------------------------

class Metrics:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.cached_tokens = self.generated = 0
        self.prefill_s = self.decode_s = self.draft_s = self.verify_s = self.rollback_s = 0.0
        self.acceptance: dict[int, int] = {}  # committed tokens per round -> rounds
        self.cancelled = 0

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def add(self, r: GenerationResult) -> None:
        s = r.stats
        self.prompt_tokens += s.n_prompt_tokens
        self.cached_tokens += s.n_cached_tokens
        self.generated += s.n_generated
        self.prefill_s += s.prefill_s
        self.decode_s += s.decode_s
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.rollback_s += s.rollback_s
        for k, n in enumerate(s.acceptance_histogram):
            if n:
                self.acceptance[k] = self.acceptance.get(k, 0) + n

    def text(self, pool: SlotPool) -> str:
        p = "dflash_"
        out = [f"# TYPE {p}requests_total counter"]
        for (ep, st), n in sorted(self.requests.items()):
            out.append(f'{p}requests_total{{endpoint="{ep}",status="{st}"}} {n}')
        for name, v, kind in [
            ("requests_cancelled_total", self.cancelled, "counter"),
            ("prompt_tokens_total", self.prompt_tokens, "counter"),
            ("prompt_tokens_cached_total", self.cached_tokens, "counter"),
            ("generated_tokens_total", self.generated, "counter"),
            ("prefill_seconds_total", self.prefill_s, "counter"),
            ("decode_seconds_total", self.decode_s, "counter"),
            ("draft_seconds_total", self.draft_s, "counter"),
            ("verify_seconds_total", self.verify_s, "counter"),
            ("rollback_seconds_total", self.rollback_s, "counter"),
            ("decode_tokens_per_second", self.generated / self.decode_s if self.decode_s > 0 else 0.0, "gauge"),
            ("slots", len(pool.slots), "gauge"),
            ("slots_busy", len(pool.slots) - len(pool.free), "gauge"),
            ("queue_length", len(pool.waiting), "gauge"),
        ]:
            out += [f"# TYPE {p}{name} {kind}", f"{p}{name} {v}"]
        # acceptance length (committed tokens per speculative round) as a cumulative histogram
        out.append(f"# TYPE {p}acceptance_length histogram")
        cum = total = 0
        for k in sorted(self.acceptance):
            cum += self.acceptance[k]
            total += k * self.acceptance[k]
            out.append(f'{p}acceptance_length_bucket{{le="{k}"}} {cum}')
        out += [f'{p}acceptance_length_bucket{{le="+Inf"}} {cum}', f"{p}acceptance_length_sum {total}",
                f"{p}acceptance_length_count {cum}"]
        return "\n".join(out) + "\n"


# ---- the app -----------------------------------------------------------------------------------

class _Job:
    """A request running on a slot's worker: pieces go to the event loop through `queue`; setting
    `cancel` closes the engine's stream before its next step. `on_end(job)` runs on the event loop
    once the engine is done, before the response ends (it frees the slot: a client's next request
    finds it free, and its prompt cache)."""

    def __init__(self, slot: _Slot, prompt: list[int], kw: dict, loop: asyncio.AbstractEventLoop, on_end):
        self.slot, self.prompt, self.kw, self.loop, self.on_end = slot, prompt, kw, loop, on_end
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.result: GenerationResult | None = None
        self.ended = False  # set on the worker before "end" is queued

    def run(self) -> None:  # on the slot's worker thread
        put = lambda item: self.loop.call_soon_threadsafe(self.queue.put_nowait, item)  # noqa: E731
        gen = None
        try:
            gen = self.slot.engine.generate(self.prompt, stream=True, cache_prompt=True, **self.kw)
            for piece in gen:
                if piece.result is not None:
                    self.result = piece.result
                put(("piece", piece))
                if self.cancel.is_set():
                    break
        except Exception as e:  # noqa: BLE001 - reported to the client
            put(("error", e))
        finally:
            if gen is not None:
                gen.close()  # a cancelled stream ends here: the engine is free for the next request
            self.ended = True
            self.loop.call_soon_threadsafe(self.on_end, self)  # runs before "end" reaches the queue
            put(("end", None))


def create_app(engines: list[Engine], *, model_name: str, max_queue: int = 64,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI app over `engines` (one slot each; all load the same model). A request body over
    `max_body_bytes` is a 413."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"[serve] max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    pool = SlotPool(engines, max_queue)
    # a request's model work before it has a slot (JSON, the chat template, tokenization) runs here,
    # never on the event loop: a long prompt must not stall /health or the running streams
    prep = ThreadPoolExecutor(max_workers=len(engines) + 1, thread_name_prefix="prep")
    metrics = Metrics()
    eng0 = engines[0]
    n_ctx = eng0.n_ctx
    created = int(time.time())
    running: set[_Job] = set()  # the jobs on the slots' workers (cancelled at shutdown)

    def job_ended(job: _Job) -> None:
        running.discard(job)
        pool.release(job.slot)

    def tokens_of(body: dict, chat: bool, tools: list[dict] | None = None) -> list[int]:
        if eng0.tokenizer is None and (chat or isinstance(body.get("prompt"), str)):
            raise ApiError(400, "this model has no tokenizer: send token ids", "prompt")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' must be a non-empty list", "messages")
            for i, m in enumerate(msgs):
                _role(i, m)
            try:
                msgs = _tools.template_messages([{**m, "role": _ROLES[m["role"]]} for m in msgs], _content)
                text = eng0.tokenizer.apply_chat_template(msgs, tools=tools)
            except _tools.ToolRequestError as e:
                raise ApiError(400, str(e), e.param, e.code) from None
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
            return tokenize(text, "messages")
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' is empty", "prompt")
            return tokenize(p, "prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if len(p) >= n_ctx:  # known without looking at the ids
                raise ApiError(400, f"the prompt has {len(p)} tokens; this server's context is {n_ctx} tokens",
                               "prompt", "context_length_exceeded")
            if not all(0 <= t < eng0.n_vocab for t in p):
                raise ApiError(400, f"'prompt' has token ids outside [0, {eng0.n_vocab})", "prompt")
            return list(p)
        raise ApiError(400, "'prompt' must be a non-empty string or list of token ids (one prompt: n = 1)", "prompt")

    def tokenize(text: str, param: str) -> list[int]:
        try:
            return eng0.tokenize(text)
        except UnicodeError as e:  # a lone surrogate ("\\ud800" in the JSON) has no UTF-8 form
            raise ApiError(400, f"'{param}' is not valid Unicode text: {e}", param) from None

    async def read_body(request: Request) -> bytes:
        """The request body, or a 413 as soon as it is known to be over max_body_bytes (from its
        Content-Length, else while it streams in)."""
        def too_large(n: str) -> ApiError:
            return ApiError(413, f"the request body has {n} bytes; this server takes at most {max_body_bytes} "
                            f"(--max-body-bytes)", code="request_too_large")

        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise too_large(length)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise too_large(f"more than {max_body_bytes}")
                chunks.append(chunk)
        except ClientDisconnect:  # it went away while sending the body: nobody reads the answer
            raise ApiError(499, "the client went away before sending the whole request") from None
        return b"".join(chunks)

    async def parse(request: Request, chat: bool) -> tuple[list[int], dict, bool, bool, str | None, Any]:
        data = await read_body(request)
        return await asyncio.get_running_loop().run_in_executor(prep, parse_body, data, chat)

    def tool_request(body: dict) -> tuple[list[dict] | None, Any, JsonSchema | None]:
        """(the tools the template renders, a factory of the output's ToolParser or None, the
        constraint that forces a call or None) of a chat request's tools and tool_choice. "none": no
        tools rendered and no calls read (the model is not told of them); "required" (any of the
        tools) or a named function (that one): one call in the template's format, its JSON held to
        tools.forced_call_schema between the format's call markers by the grammar engine."""
        try:
            tools = _tools.check_tools(body["tools"]) if body.get("tools") is not None else None
            choice = _tools.check_tool_choice(body.get("tool_choice"), tools)
        except _tools.ToolRequestError as e:
            raise ApiError(400, str(e), e.param, e.code) from None
        parallel = _field(body, "parallel_tool_calls", (bool,), True)
        if choice == "none":
            return None, None, None
        fmt = _tools.parser_for(eng0.tokenizer.chat_template if eng0.tokenizer is not None else None)
        if fmt is None:
            raise ApiError(400, "'tools' are not supported by this model: its chat template renders no tools in a "
                           f"tool-call format this server reads ({', '.join(_tools.PARSERS)})", "tools",
                           "not_supported")
        parser = _tools.PARSERS[fmt]
        forced = None
        if choice != "auto":
            if parser.ARGS_KEY is None:
                raise ApiError(400, f"'tool_choice' {json.dumps(choice)} forces a call, and this model's tool-call "
                               f"format ({fmt}) is not JSON: this server forces calls in the JSON formats only "
                               "(use \"auto\")", "tool_choice", "not_supported")
            forced = JsonSchema(_tools.forced_call_schema(tools, choice, parser.ARGS_KEY), begin=parser.CALL_OPEN,
                                end=parser.CALL_CLOSE)
        return tools, lambda: parser(tools, parallel=parallel), forced

    def check_constraint(c: JsonSchema, param: str) -> None:
        """Compiles a constraint as the engine will, so that one it cannot take is a 400 here."""
        if eng0.tokenizer is None:
            raise ApiError(400, f"'{param}' needs a tokenizer; this model has none", param)
        try:
            eng0.check_constraint(c)
        except ImportError as e:
            raise ApiError(400, str(e), param, "not_supported") from None
        except ValueError as e:
            raise ApiError(400, str(e), param, "invalid_schema") from None

    def parse_body(data: bytes, chat: bool) -> tuple[list[int], dict, bool, bool, str | None, Any]:  # on `prep`
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        except RecursionError:  # thousands of nested arrays
            raise ApiError(400, "the request body is not valid JSON here: nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"the model '{model}' does not exist (this server serves '{model_name}')", "model",
                           "model_not_found")
        stream = _field(body, "stream", (bool,), False)
        include_usage = bool(stream and isinstance(body.get("stream_options"), dict)
                             and body["stream_options"].get("include_usage"))
        kw = _sampling_fields(body, chat)
        if kw.get("speculative") and eng0.block_size == 0:
            raise ApiError(400, "'speculative': true needs a drafter; this server runs without one", "speculative")
        if kw["stop"] and eng0.tokenizer is None:
            raise ApiError(400, "'stop' needs a tokenizer; this model has none", "stop")
        if "constraint" in kw:
            check_constraint(kw["constraint"], "response_format")
        if not chat:
            for name in ("tools", "tool_choice"):
                if body.get(name) is not None:
                    raise ApiError(400, f"'{name}' is for /v1/chat/completions", name)
        tools, tool_parser, forced = tool_request(body) if chat else (None, None, None)
        if forced is not None:
            if "constraint" in kw:
                raise ApiError(400, f"'tool_choice' {json.dumps(body['tool_choice'])} forces a call, which cannot also "
                               "follow 'response_format'", "tool_choice", "not_supported")
            check_constraint(forced, "tool_choice")
            kw["constraint"] = forced
        prompt = tokens_of(body, chat, tools)
        if len(prompt) >= n_ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server's context is {n_ctx} tokens",
                           "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        kw["max_tokens"] = _field(body, name, (int,), 16 if not chat else n_ctx - len(prompt),
                                  lambda x: 0 <= x < _I64, "an int in [0, 2**63)")
        echo = None  # completions: the prompt's text goes before the completion's
        if not chat and _field(body, "echo", (bool,), False):
            if "logprobs" in kw:
                raise ApiError(400, "'echo' with 'logprobs' is not supported (no prompt logprobs)", "echo",
                               "not_supported")
            p = body["prompt"][0] if isinstance(body["prompt"], list) and len(body["prompt"]) == 1 else body["prompt"]
            echo = p if isinstance(p, str) else eng0.detokenize(prompt) if eng0.tokenizer is not None else ""
        return prompt, kw, stream, include_usage, echo, tool_parser

    def usage(r: GenerationResult) -> dict:
        s = r.stats
        return {"prompt_tokens": s.n_prompt_tokens, "completion_tokens": s.n_generated,
                "total_tokens": s.n_prompt_tokens + s.n_generated,
                "prompt_tokens_details": {"cached_tokens": s.n_cached_tokens}}

    def extras(r: GenerationResult) -> dict:
        return {"dflash": r.stats.as_dict()}

    def token_bytes(t: int) -> bytes:  # b"" for ids past the tokenizer's vocabulary (padding rows)
        tok = eng0.tokenizer
        return tok.token_bytes(t) if tok is not None and 0 <= t < tok.n_vocab else b""

    def logprobs(r: GenerationResult, chat: bool) -> dict | None:
        """r.logprobs in OpenAI's shape: chat {"content": [{token, logprob, bytes, top_logprobs}]},
        completions {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}."""
        lps = getattr(r, "logprobs", None)
        if lps is None:
            return None
        if chat:
            def entry(t: int, v: float) -> dict:
                b = token_bytes(t)
                return {"token": b.decode("utf-8", "replace"), "logprob": _finite(v), "bytes": list(b)}

            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in lps], "refusal": None}
        text = lambda t: token_bytes(t).decode("utf-8", "replace")  # noqa: E731
        offsets = [0]
        for lp in lps[:-1]:
            offsets.append(offsets[-1] + len(text(lp.token)))
        return {"tokens": [text(lp.token) for lp in lps], "token_logprobs": [_finite(lp.logprob) for lp in lps],
                "top_logprobs": [{text(t): _finite(v) for t, v in lp.top} for lp in lps],
                "text_offset": offsets[:len(lps)]}

    def shutting_down(endpoint: str) -> Response:
        metrics.count(endpoint, 503)
        return ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error").response()

    async def handle(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            prompt, kw, stream, include_usage, echo, tool_parser = await parse(request, chat)
        except ApiError as e:
            metrics.count(endpoint, e.status)
            return e.response()
        except asyncio.CancelledError:  # the server is shutting down past its grace period
            return shutting_down(endpoint)
        # the body is read: the next ASGI message is http.disconnect, whenever the client goes away
        gone = asyncio.ensure_future(_disconnected(request))
        acq = asyncio.ensure_future(pool.acquire(prompt))
        try:
            await asyncio.wait({gone, acq}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is shutting down past its grace period: leave the queue
            acq.cancel()
            gone.cancel()
            await asyncio.gather(acq, return_exceptions=True)
            return shutting_down(endpoint)
        if not acq.done():  # the client left while queued: its place in the queue goes
            acq.cancel()
            await asyncio.gather(acq, return_exceptions=True)
            metrics.cancelled += 1
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        try:
            slot = acq.result()
        except ApiError as e:
            gone.cancel()
            metrics.count(endpoint, e.status)
            return e.response()
        loop = asyncio.get_running_loop()
        job = _Job(slot, prompt, kw, loop, job_ended)
        running.add(job)
        loop.run_in_executor(slot.worker, job.run)

        def cancel_job() -> None:  # the client went away: the engine stops before its next step
            if not job.ended and not job.cancel.is_set():
                job.cancel.set()
                metrics.cancelled += 1

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        t_created = int(time.time())  # every chunk of a stream carries the same
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool, r: GenerationResult | None = None,
                   calls: list | None = None) -> dict:
            lp = logprobs(r, chat) if r is not None else None  # streamed: all in the last chunk
            if not chat:
                return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            msg = {"content": text} if delta else {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": lp, "finish_reason": finish}

        def finish_reason(r: GenerationResult, called: bool) -> str:
            return "tool_calls" if called else _FINISH.get(r.stats.stop_reason, "stop")

        if not stream:
            gone.add_done_callback(lambda t: None if t.cancelled() else cancel_job())
            text, err = [], None
            try:
                while True:
                    kind, item = await job.queue.get()
                    if kind == "piece":
                        text.append(item)
                    elif kind == "error":
                        err = item
                    else:
                        break
            except asyncio.CancelledError:  # the server is shutting down past its grace period
                cancel_job()
                return shutting_down(endpoint)
            finally:
                gone.cancel()
            if job.cancel.is_set():  # nobody is listening any more
                metrics.count(endpoint, 499)
                return Response(status_code=499)
            if err is not None or job.result is None:
                status = 400 if isinstance(err, ValueError) else 500
                metrics.count(endpoint, status)
                return ApiError(status, str(err), kind="invalid_request_error" if status == 400
                                else "server_error").response()
            r = job.result
            metrics.add(r)
            metrics.count(endpoint, 200)
            content, calls = (echo or "") + "".join(text), []
            if tool_parser is not None:
                content, calls = tool_parser().parse(content)
            return JSONResponse({"id": rid, "object": obj, "created": t_created, "model": model_name,
                                 "choices": [choice(content, finish_reason(r, bool(calls)), False, r,
                                                    [c.openai() for c in calls])],
                                 "usage": usage(r), **extras(r)})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(choices: list, **more) -> str:
            if include_usage:  # OpenAI: null in every chunk but the extra last one
                more = {"usage": None, **more}
            return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": t_created,
                                          "model": model_name, "choices": choices, **more}) + "\n\n"

        parser = tool_parser() if tool_parser is not None else None
        n_calls = 0

        def deltas(events: list) -> list[str]:
            """Chunks of a tool parser's events: content; a call's id, type and name, then its arguments."""
            nonlocal n_calls
            out = []
            for e in events:
                if isinstance(e, str):
                    out.append(sse([choice(e, None, True)]))
                    continue
                head = {"index": n_calls, "id": e.id, "type": "function",
                        "function": {"name": e.name, "arguments": ""}}
                args = {"index": n_calls, "function": {"arguments": e.arguments}}
                out += [sse([choice(None, None, True, calls=[head])]), sse([choice(None, None, True, calls=[args])])]
                n_calls += 1
            return out

        async def events():
            if chat:
                yield sse([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])
            elif echo:
                yield sse([choice(echo, None, True)])
            while True:
                kind, item = await job.queue.get()
                if kind == "end":
                    break
                if kind == "error":
                    etype = "invalid_request_error" if isinstance(item, ValueError) else "server_error"
                    yield "data: " + json.dumps({"error": {"message": str(item), "type": etype}}) + "\n\n"
                    continue
                if parser is not None:
                    for c in deltas(parser.feed(str(item)) + (parser.finish() if item.result is not None else [])):
                        yield c
                elif item:
                    yield sse([choice(str(item), None, True)])
                if item.result is not None:
                    r = item.result
                    metrics.add(r)
                    yield sse([choice(None if n_calls else "", finish_reason(r, n_calls > 0), True, r)], **extras(r))
                    if include_usage:
                        yield sse([], usage=usage(r))
            yield "data: [DONE]\n\n"

        def closed() -> None:
            cancel_job()

        gone.cancel()  # from here StreamingResponse watches the client (closed() runs when it goes)
        metrics.count(endpoint, 200)
        return _EventStream(events(), closed)

    async def completions(request: Request):
        return await handle(request, chat=False)

    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "dflash-native"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request: Request):
        if request.path_params["model"] != model_name:
            return ApiError(404, f"the model '{request.path_params['model']}' does not exist (this server serves "
                            f"'{model_name}')", "model", "model_not_found").response()
        return JSONResponse(model_card)

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_name, "slots": len(pool.slots),
                             "slots_busy": len(pool.slots) - len(pool.free), "queued": len(pool.waiting)})

    async def metrics_text(request: Request):
        return PlainTextResponse(metrics.text(pool), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # at shutdown, after uvicorn's grace period: requests still running stop at their engine's
        # next step, then the engines go; waited for off the event loop, which the requests'
        # cancelled handlers still need
        for job in running:
            job.cancel.set()

        def close() -> None:
            prep.shutdown(wait=True, cancel_futures=True)
            for s in pool.slots:
                s.worker.shutdown(wait=True, cancel_futures=True)
                s.engine.close()

        await asyncio.to_thread(close)

    async def http_error(request: Request, exc: HTTPException):  # 404 unknown path, 405 wrong method
        return JSONResponse({"error": {"message": f"{exc.detail}: {request.method} {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": None}},
                            status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception):  # a bug: no traceback to the client
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").response()

    app = Starlette(exception_handlers={HTTPException: http_error, Exception: server_error}, routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.pool = pool
    return app


def _role(i: int, m) -> str:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
    if m["role"] not in _ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}, got {m['role']!r}"[:300],
                       "messages")
    return m["role"]


def _content(i: int, m: dict) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}),
    joined by newlines."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in c):
        return "\n".join(p["text"] for p in c)
    raise ApiError(400, f"messages[{i}].content must be a string or a non-empty list of text parts "
                   f"({{'type': 'text', 'text': ...}}), got {c!r}"[:300], "messages")


def _finite(v: float) -> float:
    """A logprob as JSON can carry it (-inf, which JSON has no word for, as OpenAI's -9999.0)."""
    return v if v > -9999.0 else -9999.0


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (after the request body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (a client that went away too)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            pass  # the server is shutting down past its grace period: the stream just ends
        finally:
            self._on_close()


def serve(target, *, drafter=None, host: str = "127.0.0.1", port: int = 8000, slots: int = 1, queue: int = 64,
          model_name: str | None = None, n_threads: int | None = None, log_level: str = "warning",
          shutdown_timeout: float = 5.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, quiet: bool = False,
          **engine_kwargs: Any) -> None:
    """Load `slots` engines and serve them until interrupted (`dflash-native serve`). At Ctrl-C or
    SIGTERM running requests get `shutdown_timeout` seconds to finish; then they are cancelled (the
    engines stop at their next step) and the server exits. A request body over `max_body_bytes`
    is refused (413). target / drafter may be hf:// names (dflash_native.hub), resolved once for
    every slot (quiet: without progress output); the model id is then the name's repository
    (and :TYPE) unless `model_name` is given."""
    import os
    from pathlib import Path

    import uvicorn

    from .hub import is_hub_name, parse as parse_hub_name, resolve_pair

    if slots < 1 or queue < 0 or not shutdown_timeout >= 0:
        raise ValueError(f"[serve] slots must be >= 1, queue >= 0 and shutdown_timeout >= 0, got {slots}, {queue} "
                         f"and {shutdown_timeout}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"[serve] max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if n_threads is None:
        n_threads = max(1, (os.cpu_count() or 1) // slots)
    if is_hub_name(target):
        hn = parse_hub_name(target)
        model_name = model_name or hn.repo + (f":{hn.type}" if hn.type else "")
    target, drafter = resolve_pair(target, drafter, quiet=quiet)
    engines = [Engine(target, drafter=drafter, n_threads=n_threads, **engine_kwargs) for _ in range(slots)]
    app = create_app(engines, model_name=model_name or Path(target).stem, max_queue=queue,
                     max_body_bytes=max_body_bytes)
    print(f"[dflash-native serve] {slots} slot(s) of {Path(target).name}"
          f"{' + ' + Path(drafter).name if drafter else ''}, {n_threads} thread(s) each, "
          f"on http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)
