"""Tool calls in the OpenAI-compatible server: the request's `tools`, `tool_choice` and the tool
messages of its history checked as OpenAI checks them; the messages made into what HF chat
templates read (arguments as dicts, as transformers' apply_chat_template takes them); and the
model's output parsed back into OpenAI's `tool_calls`, whole or streamed.

Formats, chosen from the chat template's text (`parser_for`):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more
  (Qwen2.5, Qwen3, Hermes templates);
- "qwen3_coder": `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n
  </tool_call>` (Qwen3.5, Qwen3-Coder), a value read as JSON unless its schema type is string;
- "llama3_json": the whole message one or more `{"name": ..., "parameters": {...}}` objects
  (separated by `;`), optionally after `<|python_tag|>` (Llama 3.1-3.3).

A call is given out once it is complete and parsed: a streamed call comes as one delta with its id,
type and name, then its arguments; a call that does not parse (bad JSON, a function not in
`tools`, cut off by max_tokens) is content, as if the model had written text. Whitespace that only
separates content from a call is dropped.

Forcing a call (`tool_choice` "required" or a named function): `forced_call_schema` is the JSON
schema the call must match; the server has the grammar engine hold the output to it between the
format's CALL_OPEN and CALL_CLOSE (the JSON formats: hermes, llama3_json; qwen3_coder is refused).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolRequestError(ValueError):
    """A request's tools, tool_choice or tool messages are malformed: `param` names the field."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# ---- the request -------------------------------------------------------------------------------

def check_tools(tools: Any) -> list[dict]:
    """The request's `tools`: a non-empty list of {"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}, names unique."""
    if not isinstance(tools, list) or not tools:
        raise ToolRequestError(f"'tools' must be a non-empty list of tools, got {tools!r}"[:300], "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    seen = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolRequestError(f"'{where}' must be an object with \"type\": \"function\", got {t!r}"[:300], where)
        f = t.get("function")
        if not isinstance(f, dict):
            raise ToolRequestError(f"'{where}.function' must be an object, got {f!r}"[:300], f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError(f"'{where}.function.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got "
                                   f"{name!r}"[:300], f"{where}.function.name")
        if name in seen:
            raise ToolRequestError(f"'{where}.function.name': the function {name!r} is defined twice",
                                   f"{where}.function.name")
        seen.add(name)
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object (a JSON schema)"),
                                ("strict", bool, "a boolean")):
            if f.get(key) is not None and not isinstance(f[key], kind):
                raise ToolRequestError(f"'{where}.function.{key}' must be {what}, got {f[key]!r}"[:300],
                                       f"{where}.function.{key}")
        params = f.get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise ToolRequestError(f"'{where}.function.parameters' must be a schema of \"type\": \"object\", got "
                                   f"{params.get('type')!r}"[:300], f"{where}.function.parameters")
    return tools


def check_tool_choice(choice: Any, tools: list[dict] | None) -> str | dict:
    """The request's `tool_choice`: "none", "auto", "required" or {"type": "function",
    "function": {"name": one of tools}}. Default: "auto" with tools, "none" without."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools:
        raise ToolRequestError("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise ToolRequestError(f"'tool_choice': the function {name!r} is not in 'tools' ({', '.join(names)})"[:300],
                                   "tool_choice")
        return choice
    raise ToolRequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {choice!r}"[:300], "tool_choice")


def template_messages(messages: Sequence[dict], content_of) -> list[dict]:
    """The chat's messages as HF chat templates read them: role, content (`content_of(i, m)`, or ""
    for an assistant's null content beside its tool_calls), an assistant's tool_calls with their
    arguments parsed into dicts, a tool message's tool_call_id (and name, when given). Checks, as
    OpenAI does, that every tool message answers a call of the assistant message before it and
    that every call is answered."""
    out: list[dict] = []
    pending: dict[str, int] = {}  # call ids of the last assistant message not yet answered -> its index
    for i, m in enumerate(messages):
        role = m["role"]
        if role != "tool" and pending:
            raise ToolRequestError(f"messages[{max(pending.values())}]: an assistant message with 'tool_calls' must "
                                   f"be followed by tool messages answering each call; no answer to "
                                   f"{', '.join(sorted(pending))}", "messages")
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = _calls(i, m["tool_calls"])
            pending = {c["id"]: i for c in calls}
            content = "" if m.get("content") is None else content_of(i, m)
            msg = {"role": "assistant", "content": content, "tool_calls": calls}
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ToolRequestError(f"messages[{i}]: a tool message needs a string 'tool_call_id'",
                                       f"messages[{i}].tool_call_id")
            if cid not in pending:
                raise ToolRequestError(f"messages[{i}]: a tool message must answer a call of the assistant message "
                                       f"before it; {cid!r} is none of them", f"messages[{i}].tool_call_id")
            del pending[cid]
            msg = {"role": "tool", "tool_call_id": cid, "content": content_of(i, m)}
        else:
            msg = {"role": role, "content": content_of(i, m)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    if pending:
        raise ToolRequestError(f"messages[{max(pending.values())}]: the calls {', '.join(sorted(pending))} have no "
                               f"tool message answering them", "messages")
    return out


def _calls(i: int, calls: Any) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise ToolRequestError(f"'{where}' must be a non-empty list, got {calls!r}"[:300], where)
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"),
                                                                                               dict):
            raise ToolRequestError(f"'{w}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                   f"\"arguments\"}}}}, got {c!r}"[:300], w)
        cid, f = c.get("id"), c["function"]
        if not isinstance(cid, str) or not cid:
            raise ToolRequestError(f"'{w}.id' must be a non-empty string, got {cid!r}"[:300], f"{w}.id")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolRequestError(f"'{w}.function.name' must be a non-empty string", f"{w}.function.name")
        args = f.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ToolRequestError(f"'{w}.function.arguments' must be a string holding a JSON object, got "
                                   f"{args!r}"[:300], f"{w}.function.arguments")
        out.append({"id": cid, "type": "function", "function": {"name": f["name"], "arguments": parsed}})
    return out


def forced_call_schema(tools: list[dict], tool_choice: str | dict, args_key: str = "arguments") -> dict | None:
    """The JSON schema one call must match when `tool_choice` forces a call ("required": any of
    the tools; a named function: that one), as the JSON formats carry it: {"name": const,
    args_key: the function's parameters} (a parser's ARGS_KEY; the call text is then its
    CALL_OPEN + this JSON + CALL_CLOSE). None when nothing is forced ("auto", "none")."""
    if tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]

    def one(f: dict) -> dict:
        params = f.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": f["name"]}, args_key: params},
                "required": ["name", args_key], "additionalProperties": False}

    alts = [one(t["function"]) for t in tools]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


# ---- the output --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """Reads a model's output, whole (`parse`) or in pieces (`feed`, then `finish`): each returns
    the new events, a str (content) or a ToolCall, in order. parallel=False keeps the first call
    only (OpenAI's parallel_tool_calls: false). A JSON format's forced call is CALL_OPEN +
    (JSON matching forced_call_schema(..., ARGS_KEY)) + CALL_CLOSE; ARGS_KEY None: the format is
    not JSON (forcing it needs a grammar of its own)."""

    CALL_OPEN = CALL_CLOSE = ""
    ARGS_KEY: str | None = None

    def __init__(self, tools: list[dict], *, parallel: bool = True):
        self.functions = {t["function"]["name"]: t["function"] for t in tools}
        self.parallel, self.n_calls = parallel, 0

    def feed(self, text: str) -> list:
        return self._keep(self._feed(text))

    def finish(self) -> list:
        return self._keep(self._finish())

    def _keep(self, events: list) -> list:
        out = []
        for e in events:
            if isinstance(e, ToolCall):
                self.n_calls += 1
                if self.n_calls > 1 and not self.parallel:
                    continue
            out.append(e)
        return out

    def _feed(self, text: str) -> list:
        raise NotImplementedError

    def _finish(self) -> list:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None when there is none beside calls, calls)."""
        events = self.feed(text) + self.finish()
        calls = [e for e in events if isinstance(e, ToolCall)]
        content = "".join(e for e in events if isinstance(e, str))
        return (None if calls and not content else content), calls

    def _call(self, name: Any, args: Any) -> ToolCall | None:
        """A ToolCall of a parsed name and arguments dict, None unless it is one of the tools'."""
        if not isinstance(name, str) or name not in self.functions or not isinstance(args, dict):
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id())


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (kept back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _TaggedParser(ToolParser):
    """Calls between <tool_call> and </tool_call>, anywhere in the output."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict], **kw):
        super().__init__(tools, **kw)
        self.buf = ""         # text not yet given out
        self.in_call = False  # buf is a call's body (after OPEN)
        self.ws = ""          # whitespace after content, given out only if content follows
        self.after_call = False

    def _content(self, text: str, final: bool = False) -> list:
        """Content `text`, whitespace next to calls dropped: trailing whitespace is held back until
        more content follows (or the output ends)."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return []
            self.after_call = False
        body = text if final else text.rstrip()
        out = self.ws + body if body else ""
        self.ws = "" if body else self.ws
        self.ws += text[len(body):]
        return [out] if out else []

    def _feed(self, text: str) -> list:
        self.buf += text
        events: list = []
        while True:
            if not self.in_call:
                k = self.buf.find(self.OPEN)
                if k < 0:
                    n = _held_prefix(self.buf, self.OPEN)
                    events += self._content(self.buf[:len(self.buf) - n])
                    self.buf = self.buf[len(self.buf) - n:]
                    return events
                events += self._content(self.buf[:k])
                self.buf, self.in_call = self.buf[k + len(self.OPEN):], True
            k = self.buf.find(self.CLOSE)
            if k < 0:
                return events
            body, self.buf, self.in_call = self.buf[:k], self.buf[k + len(self.CLOSE):], False
            events += self._block(body, self.OPEN + body + self.CLOSE)

    def _block(self, body: str, raw: str) -> list:
        call = self._read(body)
        if call is None:  # not a call after all: the text as the model wrote it
            self.after_call = False
            return self._content(raw)
        self.ws, self.after_call = "", True
        return [call]

    def _finish(self) -> list:
        buf, self.buf = self.buf, ""
        if self.in_call:  # the output ended inside a call (max_tokens, or no closing tag)
            self.in_call = False
            return self._block(buf, self.OPEN + buf)
        return self._content(buf, final=True) + ([self.ws] if self.ws and not self.after_call else [])

    def _read(self, body: str) -> ToolCall | None:
        raise NotImplementedError


class HermesParser(_TaggedParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5/Qwen3/Hermes)."""

    CALL_OPEN, CALL_CLOSE, ARGS_KEY = "<tool_call>\n", "\n</tool_call>", "arguments"

    def _read(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return self._call(obj.get("name"), args)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


class Qwen3CoderParser(_TaggedParser):
    """<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>
    (Qwen3.5, Qwen3-Coder): a value is text when its schema type is string, else JSON (text
    when it is not JSON)."""

    def _read(self, body: str) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        props = ((self.functions.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args, pos = {}, 0
        for p in _PARAMETER.finditer(inner):
            if inner[pos:p.start()].strip():
                return None
            pos = p.end()
            key, value = p.group(1).strip(), p.group(2)
            args[key] = value if (props.get(key) or {}).get("type") == "string" else _json_or_text(value)
        if inner[pos:].strip():
            return None
        return self._call(name, args)


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


class Llama3JsonParser(ToolParser):
    """The whole output one or more {"name": ..., "parameters": {...}} objects separated by ';',
    optionally after <|python_tag|> (Llama 3.x JSON tool calling). Anything else is content, which
    streams as it comes once the output does not start like a call."""

    TAG = "<|python_tag|>"
    ARGS_KEY = "parameters"

    def __init__(self, tools: list[dict], **kw):
        super().__init__(tools, **kw)
        self.buf = ""
        self.mode = None  # None: undecided; "call": the output may be calls (kept until the end); "text"

    def _feed(self, text: str) -> list:
        if self.mode == "text":
            return [text] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if not head or self.TAG.startswith(head):
            return []  # undecided yet
        if head.startswith("{") or head.startswith(self.TAG):
            self.mode = "call"
            return []
        self.mode, buf, self.buf = "text", self.buf, ""
        return [buf]

    def _finish(self) -> list:
        buf, self.buf = self.buf, ""
        if self.mode != "call":
            return [buf] if buf else []
        head = buf.lstrip()
        head = head[len(self.TAG):] if head.startswith(self.TAG) else head
        calls = self._read_all(head)
        return calls if calls is not None else [buf]

    def _read_all(self, text: str) -> list | None:
        dec, calls, pos = json.JSONDecoder(), [], 0
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                break
            if calls:
                if text[pos] != ";":
                    break
                pos += 1
                while pos < len(text) and text[pos].isspace():
                    pos += 1
            try:
                obj, pos = dec.raw_decode(text, pos)
            except ValueError:
                break
            call = self._call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) \
                if isinstance(obj, dict) else None
            if call is None:
                break
            calls.append(call)
        return calls if calls and pos == len(text) else None


PARSERS = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser, "llama3_json": Llama3JsonParser}


def parser_for(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, from the template's text: None when
    the template renders no tools or its format is none of PARSERS."""
    t = chat_template or ""
    if "tools" not in t:
        return None
    if "<tool_call>" in t:
        return "qwen3_coder" if "<function=" in t else "hermes"
    if "<|start_header_id|>" in t and ("<|python_tag|>" in t or '"parameters"' in t):
        return "llama3_json"
    return None
