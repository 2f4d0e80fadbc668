"""The OpenAI protocol of the server: what a request may say and what a response looks like.

- request fields and their checks (`RequestReader`: a body's JSON, sampling fields, tools,
  response_format and prompt into a `ParsedRequest`; anything wrong is an `ApiError` 400 naming
  the field, raised before the request takes a slot),
- response shapes (`Reply`: one request's body, or its server-sent-event chunks, tool-call deltas
  and logprobs in OpenAI's format),
- OpenAI's error body (`ApiError.response`).

No routing and no threads here (app.py); `RequestReader.read` runs on the app's prep pool.
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from starlette.responses import JSONResponse

from .. import _core
from .. import tools as _tools
from ..constraint import JsonSchema
from ..engine import Engine, GenerationResult

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


def _json_object(data: bytes) -> dict:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:  # thousands of nested arrays
        raise ApiError(400, "the request body is not valid JSON here: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ---- a request, read -----------------------------------------------------------------------------

@dataclass
class ParsedRequest:
    """A request checked whole: what the engine runs and how the reply is shaped."""

    chat: bool
    prompt: list[int]
    kw: dict  # Engine.generate's keyword arguments
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: str | None  # completions' echo: the prompt's text, which goes before the completion's
    tool_parser: Callable[[], Any] | None  # a factory of the output's tools.ToolParser


class RequestReader:
    """Reads request bodies against one engine (all slots load the same model): its tokenizer, chat
    template, context and constraint compiler. Thread-safe as the engine's tokenizer is: `read`
    runs on the app's prep pool, never on the event loop."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.n_ctx = engine.n_ctx

    def read(self, data: bytes, chat: bool) -> ParsedRequest:
        body = _json_object(data)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist (this server serves '{self.model_name}')",
                           "model", "model_not_found")
        stream = _field(body, "stream", (bool,), False)
        include_usage = bool(stream and isinstance(body.get("stream_options"), dict)
                             and body["stream_options"].get("include_usage"))
        kw, tools, tool_parser = self._generate_kw(body, chat)
        prompt = self._tokens(body, chat, tools)
        if len(prompt) >= self.n_ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server's context is {self.n_ctx} tokens",
                           "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        kw["max_tokens"] = _field(body, name, (int,), 16 if not chat else self.n_ctx - len(prompt),
                                  lambda x: 0 <= x < _I64, "an int in [0, 2**63)")
        echo = self._echo(body, prompt, kw) if not chat else None
        return ParsedRequest(chat, prompt, kw, stream, include_usage, echo, tool_parser)

    def _generate_kw(self, body: dict, chat: bool) -> tuple[dict, list[dict] | None, Callable[[], Any] | None]:
        """(generate()'s arguments but max_tokens, the tools the template renders, the tool parser
        factory) of the sampling fields, response_format, tools and tool_choice."""
        eng = self.engine
        kw = _sampling_fields(body, chat)
        if kw.get("speculative") and eng.block_size == 0:
            raise ApiError(400, "'speculative': true needs a drafter; this server runs without one", "speculative")
        if kw["stop"] and eng.tokenizer is None:
            raise ApiError(400, "'stop' needs a tokenizer; this model has none", "stop")
        if "constraint" in kw:
            self._check_constraint(kw["constraint"], "response_format")
        if not chat:
            for name in ("tools", "tool_choice"):
                if body.get(name) is not None:
                    raise ApiError(400, f"'{name}' is for /v1/chat/completions", name)
        tools, tool_parser, forced = self._tool_request(body) if chat else (None, None, None)
        if forced is not None:
            if "constraint" in kw:
                raise ApiError(400, f"'tool_choice' {json.dumps(body['tool_choice'])} forces a call, which cannot also "
                               "follow 'response_format'", "tool_choice", "not_supported")
            self._check_constraint(forced, "tool_choice")
            kw["constraint"] = forced
        return kw, tools, tool_parser

    def _echo(self, body: dict, prompt: list[int], kw: dict) -> str | None:
        """Completions' echo: the prompt's text, to go before the completion's (None: no echo)."""
        if not _field(body, "echo", (bool,), False):
            return None
        if "logprobs" in kw:
            raise ApiError(400, "'echo' with 'logprobs' is not supported (no prompt logprobs)", "echo",
                           "not_supported")
        p = body["prompt"][0] if isinstance(body["prompt"], list) and len(body["prompt"]) == 1 else body["prompt"]
        eng = self.engine
        return p if isinstance(p, str) else eng.detokenize(prompt) if eng.tokenizer is not None else ""

    def _tokens(self, body: dict, chat: bool, tools: list[dict] | None = None) -> list[int]:
        eng = self.engine
        if eng.tokenizer is None and (chat or isinstance(body.get("prompt"), str)):
            raise ApiError(400, "this model has no tokenizer: send token ids", "prompt")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' must be a non-empty list", "messages")
            for i, m in enumerate(msgs):
                _role(i, m)
            try:
                msgs = _tools.template_messages([{**m, "role": _ROLES[m["role"]]} for m in msgs], _content)
                text = eng.tokenizer.apply_chat_template(msgs, tools=tools)
            except _tools.ToolRequestError as e:
                raise ApiError(400, str(e), e.param, e.code) from None
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
            return self._tokenize(text, "messages")
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' is empty", "prompt")
            return self._tokenize(p, "prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if len(p) >= self.n_ctx:  # known without looking at the ids
                raise ApiError(400, f"the prompt has {len(p)} tokens; this server's context is {self.n_ctx} tokens",
                               "prompt", "context_length_exceeded")
            if not all(0 <= t < eng.n_vocab for t in p):
                raise ApiError(400, f"'prompt' has token ids outside [0, {eng.n_vocab})", "prompt")
            return list(p)
        raise ApiError(400, "'prompt' must be a non-empty string or list of token ids (one prompt: n = 1)", "prompt")

    def _tokenize(self, text: str, param: str) -> list[int]:
        try:
            return self.engine.tokenize(text)
        except UnicodeError as e:  # a lone surrogate ("\\ud800" in the JSON) has no UTF-8 form
            raise ApiError(400, f"'{param}' is not valid Unicode text: {e}", param) from None

    def _tool_request(self, body: dict) -> tuple[list[dict] | None, Any, JsonSchema | None]:
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
        tok = self.engine.tokenizer
        fmt = _tools.parser_for(tok.chat_template if tok is not None else None)
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

    def _check_constraint(self, c: JsonSchema, param: str) -> None:
        """Compiles a constraint as the engine will, so that one it cannot take is a 400 here."""
        if self.engine.tokenizer is None:
            raise ApiError(400, f"'{param}' needs a tokenizer; this model has none", param)
        try:
            self.engine.check_constraint(c)
        except ImportError as e:
            raise ApiError(400, str(e), param, "not_supported") from None
        except ValueError as e:
            raise ApiError(400, str(e), param, "invalid_schema") from None


# ---- response shapes -----------------------------------------------------------------------------

def usage(r: GenerationResult) -> dict:
    s = r.stats
    return {"prompt_tokens": s.n_prompt_tokens, "completion_tokens": s.n_generated,
            "total_tokens": s.n_prompt_tokens + s.n_generated,
            "prompt_tokens_details": {"cached_tokens": s.n_cached_tokens}}


def extras(r: GenerationResult) -> dict:
    return {"dflash": r.stats.as_dict()}


def _finite(v: float) -> float:
    """A logprob as JSON can carry it (-inf, which JSON has no word for, as OpenAI's -9999.0)."""
    return v if v > -9999.0 else -9999.0


def logprobs(r: GenerationResult, chat: bool, tokenizer) -> dict | None:
    """r.logprobs in OpenAI's shape: chat {"content": [{token, logprob, bytes, top_logprobs}]},
    completions {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}."""
    lps = getattr(r, "logprobs", None)
    if lps is None:
        return None

    def token_bytes(t: int) -> bytes:  # b"" for ids past the tokenizer's vocabulary (padding rows)
        return tokenizer.token_bytes(t) if tokenizer is not None and 0 <= t < tokenizer.n_vocab else b""

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


class Reply:
    """One request's response in OpenAI's shapes: `body` whole, or a stream's server-sent events
    (`opening`, `pieces` per StreamPiece, `closing`, `DONE`). Streamed, a tool parser reads the text
    as it comes; every chunk carries the same id and creation time."""

    DONE = "data: [DONE]\n\n"

    def __init__(self, req: ParsedRequest, model_name: str, tokenizer):
        self.chat, self.include_usage, self.echo = req.chat, req.include_usage, req.echo
        self.tool_parser, self.model_name, self.tokenizer = req.tool_parser, model_name, tokenizer
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.parser = req.tool_parser() if req.stream and req.tool_parser is not None else None
        self.n_calls = 0  # tool calls streamed so far

    def choice(self, text: str | None, finish: str | None, delta: bool, r: GenerationResult | None = None,
               calls: list | None = None) -> dict:
        lp = logprobs(r, self.chat, self.tokenizer) if r is not None else None  # streamed: all in the last chunk
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        msg = {"content": text} if delta else {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": lp, "finish_reason": finish}

    @staticmethod
    def finish_reason(r: GenerationResult, called: bool) -> str:
        return "tool_calls" if called else _FINISH.get(r.stats.stop_reason, "stop")

    def body(self, text: str, r: GenerationResult) -> dict:
        """The whole response of a request that is not streamed: `text` is the generated text."""
        content, calls = (self.echo or "") + text, []
        if self.tool_parser is not None:
            content, calls = self.tool_parser().parse(content)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name,
                "choices": [self.choice(content, self.finish_reason(r, bool(calls)), False, r,
                                        [c.openai() for c in calls])],
                "usage": usage(r), **extras(r)}

    def chunk(self, choices: list, **more) -> str:
        """One server-sent event of the stream."""
        if self.include_usage:  # OpenAI: null in every chunk but the extra last one
            more = {"usage": None, **more}
        return "data: " + json.dumps({"id": self.id, "object": "chat.completion.chunk" if self.chat
                                      else "text_completion", "created": self.created, "model": self.model_name,
                                      "choices": choices, **more}) + "\n\n"

    def opening(self) -> list[str]:
        """Chat: the assistant's role; completions with echo: the prompt's text."""
        if self.chat:
            return [self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}])]
        return [self.chunk([self.choice(self.echo, None, True)])] if self.echo else []

    def pieces(self, piece) -> list[str]:
        """The chunks of one StreamPiece's text (through the tool parser when there is one)."""
        if self.parser is not None:
            return self._deltas(self.parser.feed(str(piece)) + (self.parser.finish() if piece.result is not None
                                                                 else []))
        return [self.chunk([self.choice(str(piece), None, True)])] if piece else []

    def _deltas(self, events: list) -> list[str]:
        """Chunks of a tool parser's events: content; a call's id, type and name, then its arguments."""
        out = []
        for e in events:
            if isinstance(e, str):
                out.append(self.chunk([self.choice(e, None, True)]))
                continue
            head = {"index": self.n_calls, "id": e.id, "type": "function",
                    "function": {"name": e.name, "arguments": ""}}
            args = {"index": self.n_calls, "function": {"arguments": e.arguments}}
            out += [self.chunk([self.choice(None, None, True, calls=[head])]),
                    self.chunk([self.choice(None, None, True, calls=[args])])]
            self.n_calls += 1
        return out

    def closing(self, r: GenerationResult) -> list[str]:
        """The chunk with the finish_reason (and logprobs, and the stats), then the usage if asked."""
        called = self.n_calls > 0
        out = [self.chunk([self.choice(None if called else "", self.finish_reason(r, called), True, r)], **extras(r))]
        if self.include_usage:
            out.append(self.chunk([], usage=usage(r)))
        return out

    @staticmethod
    def error_event(err: Exception) -> str:
        """An engine error after the stream's 200: an event with OpenAI's error object."""
        etype = "invalid_request_error" if isinstance(err, ValueError) else "server_error"
        return "data: " + json.dumps({"error": {"message": str(err), "type": etype}}) + "\n\n"
