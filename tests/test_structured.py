"""Structured output (dflash_native.constraint, csrc/constraint.h): every token chosen from logits
masked by the grammar (xgrammar), so that constrained speculative output equals constrained AR
output bit for bit (greedy and seeded sampled, chain and tree), on the embedded default pair (a
trained drafter: drafts are accepted) and on random tiny pairs. Constrained AR itself is checked
against an independent replay: the target's logits (Engine.eval) masked by a fresh xgrammar
matcher, token by token."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")

import dflash_native as dn  # noqa: E402
from dflash_native.cli import default_pair  # noqa: E402
from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from fixtures import make_random_checkpoint, make_random_drafter_gguf, make_spec_pair  # noqa: E402
from reference.gguf_edit import rewrite_gguf  # noqa: E402

# bounded: the grammar completes (every field an enum or a boolean), then allows only EOS
BOUNDED = {"type": "object",
           "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                          "size": {"enum": ["S", "M", "L", "XL"]}},
           "required": ["color", "ok", "size"]}
# unbounded: a free string and an integer (a small model may never close them)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPTS = ["def parse(data):\n    return", "The answer as JSON:", "# config\n"]


@pytest.fixture(scope="module")
def pair():
    p = default_pair()
    if p is None:
        pytest.skip("no embedded default pair in this install")
    return p


@pytest.fixture(scope="module", params=["chain", "tree"])
def engine(request, pair):
    with dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2, verify=request.param) as eng:
        yield eng


def _valid(text: str, schema: dict) -> dict:
    """json.loads, then the schema's required keys, enums and types (what BOUNDED / PERSON use)."""
    obj = json.loads(text)
    assert isinstance(obj, dict)
    assert set(schema["required"]) <= set(obj), obj
    assert set(obj) <= set(schema["properties"]), obj
    for k, v in obj.items():
        s = schema["properties"][k]
        if "enum" in s:
            assert v in s["enum"], (k, v)
        elif s["type"] == "boolean":
            assert isinstance(v, bool)
        elif s["type"] == "integer":
            assert isinstance(v, int) and not isinstance(v, bool)
        elif s["type"] == "string":
            assert isinstance(v, str)
    return obj


def _replay_ar(eng: dn.Engine, prompt: str, tokens: list[int], constraint) -> None:
    """Greedy constrained AR, independently: the target's logits for prompt + tokens (one eval),
    each row masked by a fresh matcher that follows the tokens; each token must be the masked argmax."""
    from dflash_native.constraint import GrammarEngine

    g = GrammarEngine(eng.tokenizer, eng.n_vocab)
    m = xgr.GrammarMatcher(g.compile(constraint))
    p = eng.tokenize(prompt)
    logits = eng.eval(p + tokens)[len(p) - 1:]
    mask = np.zeros((1, (eng.n_vocab + 31) // 32), dtype=np.int32)
    allowed = np.zeros(eng.n_vocab, dtype=bool)
    for i, t in enumerate(tokens):
        m.fill_next_token_bitmask(mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: eng.n_vocab]
        allowed[:] = bits.astype(bool)
        row = np.where(allowed, logits[i], -np.inf)
        assert int(np.argmax(row)) == t, f"token {i}: {t} is not the masked argmax {int(np.argmax(row))}"
        assert m.accept_token(t)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_default_pair_constrained_spec_equals_constrained_ar(engine, sampled):
    """Bounded schema: spec == AR token for token, every finished output valid, drafts accepted."""
    n_rounds = n_committed = n_done = 0
    for i, prompt in enumerate(PROMPTS[:2]):
        kw = dict(max_tokens=48, constraint=dn.JsonSchema(BOUNDED))
        if sampled:
            kw.update(temperature=0.8, top_p=0.95, seed=11 + i)
        ar = engine.generate(prompt, speculative=False, **kw)
        sp = engine.generate(prompt, **kw)
        assert sp.tokens == ar.tokens, (engine.verify, prompt)
        assert sp.text == ar.text
        assert ar.stats.stop_reason == sp.stats.stop_reason
        if ar.stats.stop_reason == "eos":  # the grammar completed and allowed only EOS
            _valid(ar.text, BOUNDED)
            n_done += 1
        hist = sp.stats.acceptance_histogram
        n_rounds += sum(hist)
        n_committed += sum(k * c for k, c in enumerate(hist))
        assert sp.stats.n_masks > 0 and sp.stats.constraint_s > 0
    assert n_done == 2  # the bounded schema completes within 48 tokens on these prompts
    assert n_rounds > 0 and n_committed / n_rounds > 1.0, "no drafts accepted under the constraint"


def test_constrained_requests_share_the_drafter_pass(pair):
    """Constrained requests (greedy and seeded sampled) on Engine(n_seq=3), the requests'
    controllers on fixed costs (their choices depend on acceptance only) and the batch's controller
    off: their drafts come from one shared drafter pass, each slot masking its own rows, and each
    request's tokens and rounds equal its solo run's."""
    from dflash_native import _core

    T = _core.testing
    reqs = [dict(prompt=PROMPTS[0]), dict(prompt=PROMPTS[1], temperature=0.8, top_p=0.95, seed=5),
            dict(prompt=PROMPTS[2])]

    def fixed(spec):
        T.controller_fixed_costs(spec, ar_s=1.0, draft_s=0.2, verify0_s=0.9, verify1_s=0.05)

    with dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2, n_seq=3) as eng:
        sched = eng._sched
        T.batch_controller_params(sched, enabled=False)
        for k in range(3):
            fixed(sched.spec(k))
        streams = [eng.generate(**r, max_tokens=40, constraint=dn.JsonSchema(BOUNDED), stream=True) for r in reqs]
        got = [None] * 3
        while any(g is None for g in got):
            for i, st in enumerate(streams):
                if got[i] is None:
                    piece = next(st)
                    if getattr(piece, "result", None) is not None:
                        got[i] = piece.result
        shared = sched.pass_stats["shared_drafts"]
    for i, r in enumerate(reqs):
        with dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2) as solo:
            fixed(solo._spec)
            want = solo.generate(**r, max_tokens=40, constraint=dn.JsonSchema(BOUNDED))
        assert got[i].tokens == want.tokens, f"request {i}"
        assert got[i].stats.acceptance_histogram == want.stats.acceptance_histogram, f"request {i}"
    assert shared > 0


def test_default_pair_constrained_ar_is_masked_argmax(pair):
    """Constrained greedy AR is the argmax of the grammar-masked logits at every step, and the
    speculative output equals it (without the controller: every step a round)."""
    with dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2, gate=False) as eng:
        for schema in (BOUNDED, PERSON):
            r = eng.generate(PROMPTS[1], max_tokens=40, speculative=False, constraint=schema)  # a dict works too
            _replay_ar(eng, PROMPTS[1], r.tokens, dn.JsonSchema(schema))
            sp = eng.generate(PROMPTS[1], max_tokens=40, constraint=schema)
            assert sp.tokens == r.tokens
            assert sp.stats.rounds > 0 and sp.stats.ar_steps <= 1


def test_matcher_accept_takes_what_its_mask_allows(pair, capfd):
    """The core tests a greedy choice by Matcher.accept alone, without a mask (constraint.h: AR steps,
    tree pruning, tree verify rows): accept(t) must hold for exactly the tokens fill_mask allows, at
    every state along a constrained output, for every id (control tokens, ids past the vocabulary:
    False, without xgrammar's warning)."""
    with dn.Engine(pair[0], n_ctx=256, n_threads=1) as eng:
        r = eng.generate(PROMPTS[1], max_tokens=24, speculative=False, constraint=PERSON)
        m = eng._grammar_engine().matcher(dn.JsonSchema(PERSON))
        n = eng.n_vocab
        mask = np.zeros((n + 31) // 32, dtype=np.int32)
        ids = np.arange(n)
        n_states = 0
        for t in r.tokens[:12]:
            m.fill_mask(mask)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n].astype(bool)
            took = np.zeros(n, dtype=bool)
            for i in ids.tolist():
                if m.accept(i):
                    took[i] = True
                    m.rollback(1)
            assert (took == bits).all(), np.flatnonzero(took != bits)[:8]
            assert 0 < bits.sum() < n
            assert not m.accept(n) and not m.accept(-1)
            assert m.accept(t)
            n_states += 1
        assert n_states == 12
    assert "Warning" not in capfd.readouterr().err


def test_greedy_constrained_steps_mask_only_where_the_argmax_is_refused(pair):
    """Greedy without logprobs, the masked argmax is the row's argmax whenever the grammar accepts
    it: constrained AR makes a mask only at the steps where it does not (fewer masks than tokens on
    a schema with fixed keys), and its output is still the masked argmax at every step. With
    logprobs every step makes its mask (the logprobs are the masked row's)."""
    with dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2) as eng:
        r = eng.generate(PROMPTS[1], max_tokens=40, speculative=False, constraint=PERSON)
        _replay_ar(eng, PROMPTS[1], r.tokens, dn.JsonSchema(PERSON))
        assert 0 < r.stats.n_masks < r.stats.n_generated
        lp = eng.generate(PROMPTS[1], max_tokens=40, speculative=False, constraint=PERSON, logprobs=0)
        assert lp.tokens == r.tokens
        assert lp.stats.n_masks >= lp.stats.n_generated


def test_unbounded_schema_stops_at_max_tokens(engine):
    """A free string / integer the model never closes: stop_reason "length", no error, spec == AR;
    the text so far is a prefix the grammar accepts."""
    for sampled in (dict(), dict(temperature=1.0, seed=5)):
        ar = engine.generate(PROMPTS[0], max_tokens=24, speculative=False, constraint=PERSON, **sampled)
        sp = engine.generate(PROMPTS[0], max_tokens=24, constraint=PERSON, **sampled)
        assert sp.tokens == ar.tokens
        if ar.stats.stop_reason == "eos":
            _valid(ar.text, PERSON)
        else:
            assert ar.stats.stop_reason == "length" and len(ar.tokens) == 24
            assert ar.text.startswith('{"name":')


def test_json_object_regex_grammar(engine):
    """JsonSchema() (any JSON object), a regex and an EBNF grammar: spec == AR, outputs match."""
    cases = [(dn.JsonSchema(), None), (dn.Regex(r"[a-z]{2,6}-[0-9]{3}"), r"[a-z]{2,6}-[0-9]{3}"),
             (dn.Grammar('root ::= "yes" | "no" | "maybe"'), r"yes|no|maybe")]
    for c, pattern in cases:
        for sampled in (dict(), dict(temperature=0.9, seed=2)):
            ar = engine.generate(PROMPTS[2], max_tokens=32, speculative=False, constraint=c, **sampled)
            sp = engine.generate(PROMPTS[2], max_tokens=32, constraint=c, **sampled)
            assert sp.tokens == ar.tokens, (c, sampled)
            if pattern is not None:
                assert ar.stats.stop_reason == "eos"
                assert re.fullmatch(pattern, ar.text), ar.text
            elif ar.stats.stop_reason == "eos":
                assert isinstance(json.loads(ar.text), dict)
            else:
                assert ar.text.startswith("{")


def test_constraint_with_logprobs_and_stream(engine):
    """logprobs and streaming go through the same masked rows."""
    kw = dict(max_tokens=30, constraint=BOUNDED, logprobs=2)
    ar = engine.generate(PROMPTS[1], speculative=False, **kw)
    sp = engine.generate(PROMPTS[1], **kw)
    assert sp.tokens == ar.tokens
    assert [(a.token, a.logprob, a.top) for a in ar.logprobs] == [(b.token, b.logprob, b.top) for b in sp.logprobs]
    pieces = list(engine.generate(PROMPTS[1], stream=True, max_tokens=30, constraint=BOUNDED))
    assert "".join(pieces) == ar.text and pieces[-1].result.tokens == ar.tokens


def test_bad_constraints(pair):
    with dn.Engine(pair[0], n_ctx=256, n_threads=1) as eng:
        with pytest.raises(ValueError, match=r"\[constraint\] cannot compile the JSON schema: .*"):
            eng.generate("x", max_tokens=4, constraint={"type": 5})
        with pytest.raises(ValueError, match=r"cannot compile the JSON schema.*nope"):
            eng.generate("x", max_tokens=4, constraint={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
        with pytest.raises(ValueError, match=r"cannot compile the regex"):
            eng.generate("x", max_tokens=4, constraint=dn.Regex("(ab"))
        with pytest.raises(ValueError, match=r"cannot compile the grammar"):
            eng.generate("x", max_tokens=4, constraint=dn.Grammar("rule ::= 'a'"))
        with pytest.raises(ValueError, match=r"constraint must be"):
            eng.generate("x", max_tokens=4, constraint="a string")
        with pytest.raises(ValueError, match=r"\[constraint\] cannot compile"):
            eng.check_constraint(dn.JsonSchema("{not json"))
        eng.check_constraint(BOUNDED)  # compiles
        assert eng.generate("x", max_tokens=4).tokens  # the engine still works


def test_core_refuses_constraint_on_in_graph_argmax(pair):
    """The core's seam: the in-graph argmax paths refuse a constraint (they never see the rows)."""
    from dflash_native import _core

    with dn.Engine(pair[0], drafter=pair[1], n_ctx=256, n_threads=1) as eng:
        m = eng._grammar_engine().matcher(dn.JsonSchema(BOUNDED))
        with pytest.raises(ValueError, match=r"in-graph argmax prefill cannot run under a constraint"):
            eng._spec.prefill(eng.tokenize("x"), None, 0, m)
        eng._spec.prefill(eng.tokenize("x"), _core.Sampling(0.0), 0, m)
        before = np.zeros((eng._grammar_engine().n_vocab + 31) // 32, dtype=np.int32)
        m.fill_mask(before)
        with pytest.raises(ValueError, match=r"forced draft cannot run under a constraint"):
            _core.testing.round(eng._spec, 1, 4, [1, 2, 3], _core.Sampling(0.0), m)
        with pytest.raises(ValueError, match=r"forced draft cannot run under a constraint"):
            _core.testing.step(eng._spec, 1, 4, [1, 2, 3], _core.Sampling(0.0), m)
        for tree in (_core.testing.round_tree, _core.testing.step_tree):
            with pytest.raises(ValueError, match=r"forced draft cannot run under a constraint"):
                tree(eng._spec, 1, 4, [1, 2, 3], _core.Sampling(0.0), m)
        after = np.zeros_like(before)
        m.fill_mask(after)
        assert (after == before).all()  # refused before the drafts moved the grammar


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def random_pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"structured-{request.param}")
    _, tg, dg = make_spec_pair(d, request.param, seed=7)
    return tg, dg


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_random_pair_constrained_spec_equals_ar(random_pair, verify):
    """Random tiny pairs (the fixture tokenizer): spec == AR, greedy and sampled, with and without
    the controller. The grammar forces most tokens of a BOUNDED object, so masked drafts are
    accepted even from a random drafter."""
    tg, dg = random_pair
    out = _spec_equals_ar(tg, dg, "hello world", BOUNDED, verify=verify)
    _assert_accepted(out)


def _spec_equals_ar(tg, dg, prompt: str, constraint, *, verify: str, gates=(True, False), **engine_kw):
    """Constrained spec == constrained AR (greedy, seeded sampled, sampled with top_k) on the pair:
    the (AR, spec) results by gate."""
    out = {}
    for gate in gates:
        with dn.Engine(tg, drafter=dg, n_ctx=256, n_threads=2, kv_type="f32", verify=verify, gate=gate,
                       **engine_kw) as eng:
            if eng.tokenizer is None:
                pytest.skip("this fixture has no vocabulary")
            out[gate] = []
            for kw in (dict(), dict(temperature=1.0, seed=3), dict(temperature=0.7, top_k=20, seed=4)):
                c = dict(max_tokens=48, constraint=constraint, **kw)
                ar = eng.generate(prompt, speculative=False, **c)
                sp = eng.generate(prompt, **c)
                assert sp.tokens == ar.tokens, (verify, gate, kw)
                out[gate].append((ar, sp))
    return out


def _assert_accepted(out) -> None:
    """Rounds ran and committed more than one token each on average; the complete outputs are valid."""
    n_rounds = n_committed = 0
    for runs in out.values():
        for ar, sp in runs:
            if ar.stats.stop_reason == "eos":
                _valid(ar.text, BOUNDED)
            hist = sp.stats.acceptance_histogram
            n_rounds += sum(hist)
            n_committed += sum(k * c for k, c in enumerate(hist))
    assert n_rounds > 0 and n_committed / n_rounds > 1.0


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    """A Qwen3 target and a random DFlash 2 drafter (selector_top_k 4), as tests/test_dflash2.py
    builds them (our converter only)."""
    d = tmp_path_factory.mktemp("structured-dflash2")
    ckpt = make_random_checkpoint(d / "target", "qwen3", seed=5, num_hidden_layers=3)
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d2.gguf", ckpt, outtype="f32", seed=6, target_gguf=tg, ckpt_dir=d / "d2-hf",
                                  kind="dflash2", block_size=8, num_hidden_layers=2, target_layer_ids=[0, 1],
                                  dflash_config={"selector_top_k": 4})
    return tg, dg


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_dflash2_drafter_constrained_spec_equals_ar(dflash2_pair, verify):
    """A DFlash 2 drafter under a constraint drafts from its masked logits rows (not the selector's
    k candidates, which may hold nothing the grammar allows): spec == AR, chain and tree, greedy and
    sampled, with and without the controller; drafts are accepted."""
    tg, dg = dflash2_pair
    with dn.Engine(tg, drafter=dg, n_ctx=64, n_threads=1) as eng:
        assert eng._spec.selector_top_k == 4
    _assert_accepted(_spec_equals_ar(tg, dg, "hello world", BOUNDED, verify=verify))


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_failed_drafter_under_a_constraint_falls_back_to_constrained_ar(random_pair, tmp_path, verify):
    """A drafter whose logits are NaN (issue 38's fallback): the constrained rounds become
    constrained AR steps (the masked AR step), and the output is constrained AR's, greedy and
    sampled. The NaN is seen before the drafts move the grammar (spec_sampled.cpp:
    check_draft_rows)."""
    tg, dg = random_pair

    def nan_norm(name, a):
        return np.full_like(a, np.nan) if name == "output_norm.weight" else a

    bad = rewrite_gguf(dg, tmp_path / "dnan.gguf", tensor_fn=nan_norm)
    with pytest.warns(RuntimeWarning, match="drafter failed"):
        out = _spec_equals_ar(tg, bad, "hello world", BOUNDED, verify=verify)
    for ar, sp in out[True] + out[False]:
        assert re.search(r"\[draft\] the drafter failed .*non-finite logits", sp.stats.drafter_failure)
        assert sum(sp.stats.acceptance_histogram) == 0 and sp.stats.ar_steps >= 1
        if ar.stats.stop_reason == "eos":
            _valid(ar.text, BOUNDED)


# ---- the server: response_format through a real `dflash-native serve` and the openai client ----

@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai")
    from test_server import _start_server

    proc, base = _start_server("--slots", "1", "--n-ctx", "1024")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


def test_server_response_format(server, pair):
    import openai
    from test_server import N_BATCH, MODEL, client, post_raw

    c = client(server)
    msgs = [{"role": "user", "content": "Pick a color and a size."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": BOUNDED, "strict": True}}
    with dn.Engine(pair[0], drafter=pair[1], n_ctx=1024, n_batch=N_BATCH, n_threads=1) as offline:
        want = offline.chat(msgs, max_tokens=48, constraint=BOUNDED, speculative=False)
        for extra in ({}, {"speculative": False}):
            r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, response_format=fmt,
                                          extra_body=extra)
            assert r.choices[0].message.content == want.text, extra
        assert r.choices[0].finish_reason == "stop"
        _valid(r.choices[0].message.content, BOUNDED)
        # streamed, and json_object on /v1/completions with sampling at a seed
        chunks = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, response_format=fmt, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
        want = offline.generate("config = ", max_tokens=24, temperature=0.9, seed=5, constraint=dn.JsonSchema(),
                                speculative=False)
        r = c.completions.create(model=MODEL, prompt="config = ", max_tokens=24, temperature=0.9, seed=5,
                                 extra_body={"response_format": {"type": "json_object"}})
        assert r.choices[0].text == want.text and r.choices[0].text.startswith("{")
    # a schema the engine cannot compile: a 400 that names the problem
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties":
                                                                           {"a": {"$ref": "#/nope"}}}}}
    with pytest.raises(openai.BadRequestError, match="cannot compile the JSON schema.*nope"):
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, response_format=bad)
    for fmt, what in [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}, "cannot compile"),
                      ({"type": "json_schema"}, "needs a 'json_schema' object"), ({"type": "yaml"}, "must be")]:
        code, err = post_raw(server + "/v1/chat/completions",
                             json.dumps({"messages": msgs, "response_format": fmt, "stream": True}).encode())
        assert code == 400 and err["error"]["param"] == "response_format" and what in err["error"]["message"], err
