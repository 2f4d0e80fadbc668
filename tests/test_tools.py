"""Tool calls: the request's checks, the chat templates' rendering of tools and tool messages
against transformers' own apply_chat_template on the real templates' text (tests/fixtures/templates),
the output parsers whole and streamed, and a real `dflash-native serve` process whose model (trained
here on a tool-calling chat, tests/fixtures/tool_model.py) generates the calls, driven by the
official `openai` client, speculative and AR."""

from __future__ import annotations

import json

import pytest

from dflash_native import tools as T

from fixtures import tool_model as TM

TOOLS = TM.TOOLS
TEMPLATES = TM.TEMPLATES
ARGS = {"city": "Paris", "unit": "celsius"}


def hermes(name: str, args: dict | str) -> str:
    a = args if isinstance(args, str) else json.dumps(args)
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + a + "}\n</tool_call>"


def coder(name: str, args: dict) -> str:
    ps = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                 for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{ps}</function>\n</tool_call>"


def llama(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args})


# (format, model output, content, [(name, arguments dict)])
CASES = [
    ("hermes", hermes("get_weather", ARGS), None, [("get_weather", ARGS)]),
    ("hermes", "Let me look.\n\n" + hermes("get_weather", ARGS) + "\n" + hermes("add", {"a": 1, "b": 2}),
     "Let me look.", [("get_weather", ARGS), ("add", {"a": 1, "b": 2})]),
    ("hermes", "plain text, no call  ", "plain text, no call  ", []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),  # a tag's start that never completes
    # malformed: bad JSON, a function not in tools, arguments not an object, cut off: all content
    ("hermes", hermes("get_weather", '{"city": "Par'), hermes("get_weather", '{"city": "Par'), []),
    ("hermes", hermes("rm_rf", {}), hermes("rm_rf", {}), []),
    ("hermes", hermes("add", "[1, 2]"), hermes("add", "[1, 2]"), []),
    ("hermes", "ok " + hermes("add", {"a": 1, "b": 2})[:-8], "ok " + hermes("add", {"a": 1, "b": 2})[:-8], []),
    # arguments as a JSON string; an unclosed last call that parses (the model stopped at its EOS)
    ("hermes", hermes("add", json.dumps(json.dumps({"a": 1, "b": 2}))), None, [("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    # a good call, then a bad one, then text
    ("hermes", hermes("add", {"a": 1, "b": 2}) + "\n" + hermes("add", "{") + "\nbye",
     hermes("add", "{") + "\nbye", [("add", {"a": 1, "b": 2})]),
    ("qwen3_coder", coder("get_weather", ARGS), None, [("get_weather", ARGS)]),
    ("qwen3_coder", "Sure.\n\n" + coder("add", {"a": 75, "b": 41}) + "\n" + coder("get_weather", {"city": "42"}),
     "Sure.", [("add", {"a": 75, "b": 41}), ("get_weather", {"city": "42"})]),  # "42": the schema says string
    ("qwen3_coder", "<tool_call>\n<function=add>\nno parameters here\n</function>\n</tool_call>",
     "<tool_call>\n<function=add>\nno parameters here\n</function>\n</tool_call>", []),
    ("qwen3_coder", coder("nope", {"a": 1}), coder("nope", {"a": 1}), []),
    ("llama3_json", llama("get_weather", ARGS), None, [("get_weather", ARGS)]),
    ("llama3_json", "<|python_tag|>" + llama("add", {"a": 1, "b": 2}) + "; " + llama("get_weather", ARGS),
     None, [("add", {"a": 1, "b": 2}), ("get_weather", ARGS)]),
    ("llama3_json", '  {"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("llama3_json", "<b>bold</b>", "<b>bold</b>", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
    ("llama3_json", llama("add", {"a": 1, "b": 2}) + " and then", llama("add", {"a": 1, "b": 2}) + " and then", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
]


def _events(fmt: str, pieces: list[str], **kw) -> tuple[str | None, list]:
    p = T.PARSERS[fmt](TOOLS, **kw)
    ev = []
    for piece in pieces:
        ev += p.feed(piece)
    ev += p.finish()
    calls = [e for e in ev if isinstance(e, T.ToolCall)]
    content = "".join(e for e in ev if isinstance(e, str))
    return (None if calls and not content else content), [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_whole(fmt, text, content, calls):
    got_content, got = T.PARSERS[fmt](TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_streamed_at_every_split(fmt, text, content, calls):
    """Fed in two pieces split at every position, in three at every pair of positions (short
    texts), and one character at a time: the same content and calls as the whole text."""
    want = (content, calls)
    assert _events(fmt, list(text)) == want
    for i in range(len(text) + 1):
        assert _events(fmt, [text[:i], text[i:]]) == want, i
    if len(text) <= 90:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                assert _events(fmt, [text[:i], text[i:j], text[j:]]) == want, (i, j)


def test_streamed_content_is_not_held_back():
    """Content streams as it comes: only a possible tag start (and whitespace that may precede a
    call) waits."""
    p = T.HermesParser(TOOLS)
    assert p.feed("Hello wor") == ["Hello wor"]
    assert p.feed("ld <tool") == ["ld"]
    assert p.feed("box> x") == [" <toolbox> x"]
    q = T.Llama3JsonParser(TOOLS)
    assert q.feed("Sure") == ["Sure"] and q.feed(", 4") == [", 4"]


def test_parallel_tool_calls_false_keeps_the_first():
    text = hermes("add", {"a": 1, "b": 2}) + hermes("get_weather", ARGS)
    content, calls = T.HermesParser(TOOLS, parallel=False).parse(text)
    assert content is None and [c.name for c in calls] == ["add"]


def test_openai_shape():
    (call,) = T.HermesParser(TOOLS).parse(hermes("add", {"a": 1, "b": 2}))[1]
    d = call.openai()
    assert d["type"] == "function" and d["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert d["id"] == call.id and call.openai(3)["index"] == 3


# ---- request checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("tools,param", [
    ([], "tools"),
    ({"type": "function"}, "tools"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools[1].function.name"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tools"),
])
def test_bad_tools(tools, param):
    with pytest.raises(T.ToolRequestError) as e:
        T.check_tools(tools)
    assert e.value.param == param and str(e.value)


def test_tool_choice():
    assert T.check_tool_choice(None, TOOLS) == "auto" and T.check_tool_choice(None, None) == "none"
    for c in ("none", "auto", "required"):
        assert T.check_tool_choice(c, TOOLS) == c
    named = {"type": "function", "function": {"name": "add"}}
    assert T.check_tool_choice(named, TOOLS) == named
    for bad in ("any", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 3):
        with pytest.raises(T.ToolRequestError, match="tool_choice") as e:
            T.check_tool_choice(bad, TOOLS)
        assert e.value.param == "tool_choice"
    with pytest.raises(T.ToolRequestError, match="only allowed when 'tools'"):
        T.check_tool_choice("auto", None)


def _content(i, m):
    return m["content"]


def test_template_messages_checks():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    good = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out = T.template_messages(good, _content)
    assert out[1] == {"role": "assistant", "content": "",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert out[2] == {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    for msgs, param in [
        (good[:2] + [{"role": "tool", "content": "3"}], "messages[2].tool_call_id"),
        (good[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "3"}], "messages[2].tool_call_id"),
        (good[:2], "messages"),  # a call with no answer
        (good[:2] + [{"role": "user", "content": "y"}], "messages"),
        ([good[0], {"role": "tool", "tool_call_id": "call_1", "content": "3"}], "messages[1].tool_call_id"),
        ([good[0], {**good[1], "tool_calls": []}], "messages[1].tool_calls"),
        ([good[0], {**good[1], "tool_calls": [{**call, "id": 5}]}], "messages[1].tool_calls[0].id"),
        ([good[0], {**good[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": "{"}}]}],
         "messages[1].tool_calls[0].function.arguments"),
        ([good[0], {**good[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]}],
         "messages[1].tool_calls[0].function.arguments"),  # OpenAI's arguments are a string
        ([good[0], {**good[1], "tool_calls": [{**call, "function": {"arguments": "{}"}}]}],
         "messages[1].tool_calls[0].function.name"),
    ]:
        with pytest.raises(T.ToolRequestError) as e:
            T.template_messages(msgs, _content)
        assert e.value.param == param, (msgs, str(e.value))


def test_forced_call_schema():
    jsonschema = pytest.importorskip("jsonschema")
    s = T.forced_call_schema(TOOLS, {"type": "function", "function": {"name": "add"}})
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, s)
    for bad in ({"name": "get_weather", "arguments": {"city": "x"}}, {"name": "add", "arguments": {"a": 1}},
                {"name": "add", "arguments": {"a": "1", "b": 2}}, {"name": "add"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
    r = T.forced_call_schema(TOOLS, "required")
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, r)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, r)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"unit": "celsius"}}, r)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "nope", "arguments": {}}, r)
    assert T.forced_call_schema(TOOLS, "auto") is None and T.forced_call_schema(TOOLS, "none") is None
    # a call matching the schema with the format's key, framed as the format frames it, parses back
    for fmt in ("hermes", "llama3_json"):
        cls = T.PARSERS[fmt]
        obj = {"name": "add", cls.ARGS_KEY: {"a": 1, "b": 2}}
        jsonschema.validate(obj, T.forced_call_schema(TOOLS, "required", cls.ARGS_KEY))
        content, (call,) = cls(TOOLS).parse(cls.CALL_OPEN + json.dumps(obj) + cls.CALL_CLOSE)
        assert content is None and (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    assert T.Qwen3CoderParser.ARGS_KEY is None


def test_parser_for_real_templates():
    want = {"Qwen-Qwen3-0.6B.jinja": "hermes", "Qwen3.5-4B.jinja": "qwen3_coder",
            "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
            "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json"}
    for name, fmt in want.items():
        assert T.parser_for((TEMPLATES / name).read_text()) == fmt, name
    assert T.parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert T.parser_for(None) is None


# ---- the chat templates --------------------------------------------------------------------------

def _openai_history(history: list[dict]) -> list[dict]:
    return [TM.openai_message(m) for m in history]


def _hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HfTok
    from tokenizers.models import WordLevel

    return transformers.PreTrainedTokenizerFast(tokenizer_object=HfTok(WordLevel({"<s>": 0, "</s>": 1},
                                                                                 unk_token="<s>")),
                                                bos_token="<s>", eos_token="</s>")


SYSTEM = {"role": "system", "content": "You are terse."}
SINGLE_CALLS = [m for m in TM.turns()[-1][0] if len(m.get("tool_calls", [])) < 2] + [TM.turns()[-1][1]]
SINGLE_CALLS = [m for m in SINGLE_CALLS if m["role"] != "tool" or m["tool_call_id"] in ("call_1", "call_4")]


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "meta-llama-Llama-3.2-3B-Instruct.jinja"])
def test_templates_render_as_transformers(name):
    """The real templates' text rendered by our renderer from the OpenAI-shaped request (arguments
    as JSON strings, through template_messages) equals transformers' apply_chat_template on the HF
    shape, with tools and without, for every prefix of a tool-calling chat."""
    from dflash_native._tokenizer import render_chat_template

    hf = _hf_tokenizer()
    tpl = (TEMPLATES / name).read_text(encoding="utf-8")
    llama = "llama" in name
    chat = [SYSTEM] + (SINGLE_CALLS if llama else TM.turns()[-1][0] + [TM.turns()[-1][1]])
    n_checked = 0
    for n in range(2, len(chat) + 1):
        msgs = chat[:n]
        if any(m.get("tool_calls") for m in msgs[-1:]) or (n < len(chat) and chat[n]["role"] == "tool"):
            continue  # a call must be answered before the next request
        ours_msgs = T.template_messages(_openai_history(msgs), _content)
        for tools in (TOOLS, None):
            for gen in (True, False):
                want = hf.apply_chat_template(msgs, tools=tools, chat_template=tpl, tokenize=False,
                                              add_generation_prompt=gen)
                got = render_chat_template(tpl, ours_msgs, tools=tools, add_generation_prompt=gen,
                                           bos_token="<s>", eos_token="</s>")
                assert got == want, (name, n, tools is None, gen)
                n_checked += 1
    assert n_checked >= 8
    if not llama:
        assert "<tool_call>" in got and "<tool_response>" in got


def test_template_errors_are_value_errors():
    """Llama 3.1's template refuses two calls in one message: a ValueError (a 400 in the server),
    as transformers raises."""
    from dflash_native._tokenizer import render_chat_template

    tpl = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text(encoding="utf-8")
    msgs = TM.turns()[3][0]
    with pytest.raises(ValueError, match="single tool-calls"):
        render_chat_template(tpl, T.template_messages(_openai_history(msgs), _content), tools=TOOLS)
    with pytest.raises(Exception, match="single tool-calls"):
        _hf_tokenizer().apply_chat_template(msgs, tools=TOOLS, chat_template=tpl, tokenize=False)


# ---- through a real server -------------------------------------------------------------------------

N_CTX = 2048


def _render(msgs: list[dict], tools) -> str:
    from dflash_native._tokenizer import render_chat_template

    tpl = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    return render_chat_template(tpl, msgs, tools=tools)


@pytest.fixture(scope="module")
def tool_pair(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return TM.build_tool_pair(tmp_path_factory.mktemp("toolpair"), _render)


@pytest.fixture(scope="module")
def tool_server(tool_pair):
    from test_server import _start_server, _stop_server

    proc, base = _start_server("--target", str(tool_pair[0]), "--drafter", str(tool_pair[1]), "--n-ctx", str(N_CTX),
                               "--model-name", "toolmodel")
    yield base
    _stop_server(proc)


@pytest.fixture(scope="module")
def offline(tool_pair):
    import dflash_native as dn
    from test_server import N_BATCH

    with dn.Engine(str(tool_pair[0]), drafter=str(tool_pair[1]), n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as eng:
        yield eng


def _client(base: str):
    from test_server import client

    return client(base)


def _want(offline, history: list[dict], **kw):
    """What the server must answer: the engine's greedy text on the rendered prompt, parsed."""
    r = offline.generate(_render(history, TOOLS), max_tokens=120, **kw)
    return r, T.HermesParser(TOOLS).parse(r.text)


def _calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(c, **kw) -> tuple[str | None, list[tuple[str, dict]], str, list]:
    """(content, calls, finish_reason, chunks) of a streamed request, assembled from the deltas."""
    chunks = list(c.chat.completions.create(stream=True, **kw))
    content, calls, finish = None, {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        if d.content:
            content = (content or "") + d.content
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None and tc.type == "function" and tc.function.name, tc
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert all(s["id"].startswith("call_") for s in calls.values())
    return content, [(s["name"], json.loads(s["arguments"])) for _, s in sorted(calls.items())], finish, chunks


def test_server_tool_call(tool_server, offline):
    """The first turn: the model generates a call; the server answers it as OpenAI's tool_calls,
    equal to the engine's own output parsed, streamed or not, speculative and AR."""
    c = _client(tool_server)
    history = TM.turns()[0][0]
    r, (content, calls) = _want(offline, history)
    want_calls = [(x.name, json.loads(x.arguments)) for x in calls]
    # the trained model really calls the tool its chat taught it
    assert want_calls == [("get_weather", {"city": "Paris"})] and content is None, r.text
    for spec in (True, False):
        kw = dict(model="toolmodel", messages=history, tools=TOOLS, max_tokens=120,
                  extra_body={"speculative": spec})
        resp = c.chat.completions.create(**kw)
        ch = resp.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert _calls_of(ch.message) == want_calls
        assert all(t.id.startswith("call_") and t.type == "function" for t in ch.message.tool_calls)
        assert resp.model_extra["dflash"]["speculative"] is spec
        assert resp.usage.completion_tokens == len(r.tokens)
        s_content, s_calls, s_finish, _ = _streamed(c, **kw)
        assert (s_content, s_calls, s_finish) == (None, want_calls, "tool_calls")


def test_stream_deltas_shape(tool_server):
    """OpenAI's stream: role first, then one delta with the call's index, id, type, name and empty
    arguments, then its arguments, then finish_reason tool_calls."""
    from test_server import _sse_chunks

    chunks = _sse_chunks(tool_server, "/v1/chat/completions", {"messages": TM.turns()[0][0], "tools": TOOLS,
                                                                 "stream": True, "max_tokens": 120})
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert deltas[0]["role"] == "assistant"
    tcs = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert len(tcs) == 2 and all(len(t) == 1 and t[0]["index"] == 0 for t in tcs)
    head, args = tcs[0][0], tcs[1][0]
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert "id" not in args and json.loads(args["function"]["arguments"]) == {"city": "Paris"}
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "tool_calls"


def test_five_turn_tool_chat(tool_server, offline):
    """Five turns through the server, each request the whole history as an OpenAI client sends it
    (the assistant's tool_calls as the server returned them, the tool results answering their
    ids): every turn equals the engine's output on the same history, speculative and AR, and
    the model answers its chat: calls, two calls at once, text after the results."""
    c = _client(tool_server)
    history: list[dict] = []  # as the client sends it
    matched = []
    for (user, answer, results), (hf_history, _) in zip(TM.CHAT, TM.turns()):
        if user is not None:
            history.append({"role": "user", "content": user})
        r, (content, calls) = _want(offline, hf_history)
        out = {}
        for spec in (True, False):
            resp = c.chat.completions.create(model="toolmodel", messages=history, tools=TOOLS, max_tokens=120,
                                             extra_body={"speculative": spec})
            out[spec] = resp.choices[0]
        assert out[True].message.content == out[False].message.content == content
        assert _calls_of(out[True].message) == _calls_of(out[False].message) == \
            [(x.name, json.loads(x.arguments)) for x in calls]
        msg = out[True].message
        matched.append(TM.answer_text(answer) == r.text)
        history.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for tc, res in zip(msg.tool_calls or [], results):
            history.append({"role": "tool", "tool_call_id": tc.id, "content": res})
        if results and len(msg.tool_calls or []) != len(results):
            break  # the model did not call what its chat did: the fixture's history no longer applies
    assert len(matched) == 5 and all(matched), matched


def test_tool_choice_none_and_refusals(tool_server, offline):
    """"none": the tools are not rendered and nothing is parsed (the prompt is the chat's without
    tools); a forced call with a response_format: 400 not_supported; bad tools, tool_choice and tool
    messages: 400 naming the field."""
    from test_server import post_raw

    c = _client(tool_server)
    history = TM.turns()[0][0]
    want = offline.generate(_render(history, None), max_tokens=40)
    resp = c.chat.completions.create(model="toolmodel", messages=history, tools=TOOLS, tool_choice="none",
                                     max_tokens=40)
    assert resp.choices[0].message.content == want.text and not resp.choices[0].message.tool_calls
    assert resp.usage.prompt_tokens == want.stats.n_prompt_tokens
    assert resp.choices[0].finish_reason != "tool_calls"
    url = tool_server + "/v1/chat/completions"
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    for body, status, param, code in [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice",
         "not_supported"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice", None),
        ({"tool_choice": "sometimes"}, 400, "tool_choice", None),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name", None),
        ({"tools": []}, 400, "tools", None),
        ({"tools": None, "tool_choice": "auto"}, 400, "tool_choice", None),
        ({"parallel_tool_calls": "yes"}, 400, "parallel_tool_calls", None),
        ({"messages": history + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                 {"role": "tool", "content": "3"}]}, 400, "messages[2].tool_call_id", None),
        ({"messages": history + [{"role": "assistant", "content": None, "tool_calls": [call]}]}, 400, "messages",
         None),
        ({"messages": history + [{"role": "assistant", "content": None,
                                  "tool_calls": [{**call, "function": {"name": "add", "arguments": "{oops"}}]},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "3"}]}, 400,
         "messages[1].tool_calls[0].function.arguments", None),
    ]:
        req = {"messages": history, "tools": TOOLS, "max_tokens": 4, **body}
        st, err = post_raw(url, json.dumps({k: v for k, v in req.items() if v is not None}).encode())
        assert (st, err["error"]["param"], err["error"]["code"]) == (status, param, code), (body, err)
        assert err["error"]["message"]
    st, err = post_raw(tool_server + "/v1/completions", json.dumps({"prompt": "x", "tools": TOOLS}).encode())
    assert st == 400 and err["error"]["param"] == "tools"
    # a tool message answering the call, content null beside the call: rendered, not refused
    ok = history + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    assert c.chat.completions.create(model="toolmodel", messages=ok, tools=TOOLS, max_tokens=4).choices


# ---- forced calls: tool_choice "required" / a named function as a grammar constraint --------------

def _forced(choice) -> "object":
    """The constraint the server puts on a forced call in this model's format (hermes)."""
    import dflash_native as dn

    return dn.JsonSchema(T.forced_call_schema(TOOLS, choice, T.HermesParser.ARGS_KEY), begin=T.HermesParser.CALL_OPEN,
                         end=T.HermesParser.CALL_CLOSE)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_choice(tool_server, offline, choice):
    """A forced call: the output is one call in the template's format (hermes), its JSON held to
    forced_call_schema by the grammar; the server answers it as tool_calls with finish_reason
    "tool_calls", speculative and AR both equal to the engine's constrained AR output, streamed or
    not. Named "add" on the weather question: the grammar, not the model, picks the function."""
    c = _client(tool_server)
    history = TM.turns()[0][0]
    r = offline.generate(_render(history, TOOLS), max_tokens=120, constraint=_forced(choice), speculative=False)
    content, calls = T.HermesParser(TOOLS).parse(r.text)
    want_calls = [(x.name, json.loads(x.arguments)) for x in calls]
    assert r.stats.stop_reason == "eos" and content is None and len(want_calls) == 1, r.text
    if isinstance(choice, dict):
        assert want_calls[0][0] == "add"
    for spec in (True, False):
        kw = dict(model="toolmodel", messages=history, tools=TOOLS, tool_choice=choice, max_tokens=120,
                  extra_body={"speculative": spec})
        resp = c.chat.completions.create(**kw)
        ch = resp.choices[0]
        assert (ch.finish_reason, ch.message.content, _calls_of(ch.message)) == ("tool_calls", None, want_calls)
        assert resp.model_extra["dflash"]["speculative"] is spec
        assert resp.usage.completion_tokens == len(r.tokens)
        s_content, s_calls, s_finish, _ = _streamed(c, **kw)
        assert (s_content, s_calls, s_finish) == (None, want_calls, "tool_calls")


# OpenAI's documented examples, as its guides write them (function calling; structured outputs)
DOC_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get current temperature for a given location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country e.g. Bogotá, Colombia"}},
        "required": ["location"], "additionalProperties": False},
    "strict": True}}]
DOC_TOOL_MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
DOC_MATH_FORMAT = {"type": "json_schema", "json_schema": {"name": "math_reasoning", "strict": True, "schema": {
    "type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "explanation": {"type": "string"}, "output": {"type": "string"}},
            "required": ["explanation", "output"], "additionalProperties": False}},
        "final_answer": {"type": "string"}},
    "required": ["steps", "final_answer"], "additionalProperties": False}}}
DOC_MATH_MESSAGES = [
    {"role": "system", "content": "You are a helpful math tutor. Guide the user through the solution step by step."},
    {"role": "user", "content": "how can I solve 8x + 7 = -23"}]


def test_openai_documented_examples(tool_server, offline):
    """The official openai client runs OpenAI's documented `tools` example (as written, and with
    tool_choice "required") and its `response_format` json_schema example against `serve`:
    speculative output == AR output, and both equal the engine's own AR output."""
    import dflash_native as dn

    c = _client(tool_server)
    prompt = _render(DOC_TOOL_MESSAGES, DOC_TOOLS)
    for choice in ("auto", "required"):
        forced = None if choice == "auto" else dn.JsonSchema(
            T.forced_call_schema(DOC_TOOLS, choice, "arguments"), begin=T.HermesParser.CALL_OPEN,
            end=T.HermesParser.CALL_CLOSE)
        r = offline.generate(prompt, max_tokens=60, constraint=forced, speculative=False)
        content, calls = T.HermesParser(DOC_TOOLS).parse(r.text)
        want = (content, [(x.name, json.loads(x.arguments)) for x in calls])
        for spec in (True, False):
            resp = c.chat.completions.create(model="toolmodel", messages=DOC_TOOL_MESSAGES, tools=DOC_TOOLS,
                                             tool_choice=choice, max_tokens=60, extra_body={"speculative": spec})
            msg = resp.choices[0].message
            assert (msg.content, _calls_of(msg)) == want, (choice, spec)
            assert resp.usage.completion_tokens == len(r.tokens)
        if choice == "required" and r.stats.stop_reason == "eos":
            assert want[1] and want[1][0][0] == "get_weather"
    schema = DOC_MATH_FORMAT["json_schema"]["schema"]
    r = offline.chat(DOC_MATH_MESSAGES, max_tokens=80, constraint=schema, speculative=False)
    for spec in (True, False):
        resp = c.chat.completions.create(model="toolmodel", messages=DOC_MATH_MESSAGES, response_format=DOC_MATH_FORMAT,
                                         max_tokens=80, extra_body={"speculative": spec})
        assert resp.choices[0].message.content == r.text and resp.usage.completion_tokens == len(r.tokens), spec
    if r.stats.stop_reason == "eos":
        import jsonschema

        jsonschema.validate(json.loads(r.text), schema)
