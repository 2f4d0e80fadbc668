"""generate(..., logprobs=N): each generated token's log-probability and its N most probable
alternatives, computed in the core from the logits row the token was chosen from. They equal a
NumPy reference over Engine.eval() logits exactly, and are the same, bit for bit, with and without
the drafter (chain and tree verify, greedy and sampled, fixed rounds and the controller), because
a verify row's logits are the AR step's.

Random tiny dense (Qwen3) and hybrid (Qwen3.5) pairs written by the package's converters, F32,
on the package's batch-invariant kernels.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from fixtures import SPEC_PAIRS, make_spec_pair
from reference import sampling_ref as ref

PAIRS = ("qwen3", "qwen35")
PROMPT = [int(x) for x in np.random.default_rng(7).integers(3, 500, 10)]

SETTINGS = [
    dict(),  # greedy
    dict(temperature=0.7, seed=3),
    dict(temperature=1.0, top_k=5, seed=4),
    dict(temperature=1.5, top_p=0.9, min_p=0.05, seed=5),
    dict(temperature=3.0, seed=6),  # flat: coupled drafts get accepted
]


@pytest.fixture(scope="module", params=PAIRS)
def pair(request, tmp_path_factory):
    assert request.param in SPEC_PAIRS
    _, tg, dg = make_spec_pair(tmp_path_factory.mktemp("logprobs-" + request.param), request.param, seed=21)
    return str(tg), str(dg)


def engine(pair, **kw):
    kw.setdefault("gate", False)
    return dn.Engine(pair[0], drafter=pair[1], n_ctx=256, kv_type="f32", n_threads=2, **kw)


def ref_logprobs(eng, tokens, n, s):
    """The reference's (logprob, top) for every generated token, from eval() of the prefix."""
    rows = eng.eval(PROMPT + tokens[:-1])[len(PROMPT) - 1:]  # row j: the logits before tokens[j]
    f = {k: s[k] for k in ("top_k", "top_p", "min_p") if k in s}
    return [ref.logprobs(rows[j], temperature=s.get("temperature", 0.0), token=t, n=n, **f)
            for j, t in enumerate(tokens)]


@pytest.mark.parametrize("si", range(len(SETTINGS)))
def test_logprobs_equal_numpy_reference(pair, si):
    """AR generation with logprobs=4: the chosen token, its logprob and the top 4 equal the
    reference computed from eval()'s logits with the same filters, exactly; asking for logprobs
    changes no token."""
    s = SETTINGS[si]
    eng = engine(pair)
    r = eng.generate(PROMPT, max_tokens=24, speculative=False, logprobs=4, **s)
    assert r.tokens == eng.generate(PROMPT, max_tokens=24, speculative=False, **s).tokens
    assert len(r.logprobs) == len(r.tokens) > 0
    for lp, t, (want_lp, want_top) in zip(r.logprobs, r.tokens, ref_logprobs(eng, r.tokens, 4, s)):
        assert isinstance(lp, dn.TokenLogprobs) and lp.token == t
        assert lp.logprob == want_lp and lp.top == want_top
        filtered = any(k in s for k in ("top_k", "top_p", "min_p"))
        assert lp.logprob <= 0.0 and (len(lp.top) == 4 or filtered and 1 <= len(lp.top) < 4)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        if not s:  # greedy: the chosen token is the most probable one
            assert lp.top[0] == (t, lp.logprob)


def _runs(pair):
    """(name, engine kwargs) of every speculative mode."""
    yield "chain B=4 ring 8", dict(block_size=4, feature_ring_capacity=8)
    yield "chain B=16 gate", dict(block_size=16, feature_ring_capacity=16, gate=True)
    yield "tree 7 ring 16", dict(block_size=16, feature_ring_capacity=16, verify="tree", tree_budget=7)
    yield "tree 33 gate", dict(block_size=16, feature_ring_capacity=16, verify="tree", tree_budget=33, gate=True)


@pytest.mark.parametrize("si", range(len(SETTINGS)))
def test_speculative_logprobs_equal_ar(pair, si):
    """Chain and tree verify, fixed rounds and the controller, rings smaller than the output:
    tokens and logprobs (N = 3) are AR's, bit for bit."""
    s = SETTINGS[si]
    ar = engine(pair).generate(PROMPT, max_tokens=40, speculative=False, logprobs=3, **s)
    for name, kw in _runs(pair):
        sp = engine(pair, **kw).generate(PROMPT, max_tokens=40, logprobs=3, **s)
        assert sp.stats.speculative
        assert sp.tokens == ar.tokens, name
        assert sp.logprobs == ar.logprobs, name


@pytest.mark.parametrize("B", [3, 16])
def test_accepted_drafts_carry_the_verify_rows_logprobs(pair, B):
    """Drafts replaced by the AR continuation with errors injected, so rounds accept up to B-1
    drafts: the logprobs read from the verify's rows past the first are still AR's."""
    for s in (SETTINGS[0], SETTINGS[3]):
        eng = engine(pair, block_size=B)
        ar = eng.generate(PROMPT, max_tokens=70, speculative=False, logprobs=2, **s)
        ref_tokens = ar.tokens + [0] * 80
        rng = np.random.default_rng(B)

        def override(prompt, out, Bc):
            good = ref_tokens[len(out): len(out) + Bc - 1]
            return [t if rng.random() > 0.15 else (t + 1) % 500 for t in good]

        eng._draft_override = override
        sp = eng.generate(PROMPT, max_tokens=60, logprobs=2, **s)
        assert sp.tokens == ar.tokens[:60] and sp.logprobs == ar.logprobs[:60]
        assert max(k for k, c in enumerate(sp.stats.acceptance_histogram) if c) > min(B, 3) - 1


def test_given_trees_carry_the_path_rows_logprobs(pair):
    """verify_tree over trees that hold the AR continuation (greedy and sampled) among random
    siblings: the committed tokens' logprobs are the ones AR reports at those positions."""
    from test_tree_verify import random_tree_with_path

    rng = np.random.default_rng(1)
    for s in (SETTINGS[0], SETTINGS[2]):
        eng = engine(pair)
        ar = eng.generate(PROMPT, max_tokens=60, speculative=False, logprobs=5, **s)
        sampling = _core.Sampling(s.get("temperature", 0.0), top_k=s.get("top_k", 0), seed=s.get("seed", 0),
                                  logprobs=5)
        t = _core.Target(pair[0], n_ctx=256, kv_type="f32", max_verify=64, n_threads=2)
        spec = _core.Spec(t, pair[1], block_size=16, ring_capacity=16, tree_budget=40)
        first = spec.prefill_logprobs(PROMPT, sampling)
        got, lps = [first.token], [dn.TokenLogprobs._of(first)]
        depths = set()
        while len(got) < 40:
            depth = int(rng.integers(0, 9))
            parents, tokens, _ = random_tree_with_path(rng, got[-1], ar.tokens[len(got): len(got) + depth],
                                                       int(rng.integers(0, 40)))
            r = _core.testing.verify_tree(spec, parents, tokens, sampling)
            assert len(r.logprobs) == len(r.committed)
            got += r.committed
            lps += [dn.TokenLogprobs._of(x) for x in r.logprobs]
            depths.add(len(r.committed))
        assert got[:40] == ar.tokens[:40] and lps[:40] == ar.logprobs[:40]
        assert len(depths) > 2


def test_filters_keep_fewer_than_n(pair):
    """top_k = 3 with logprobs = 10: three alternatives, whose probabilities sum to 1 (the filtered
    distribution); logprobs = 0: the token's logprob and no alternatives."""
    eng = engine(pair)
    r = eng.generate(PROMPT, max_tokens=8, temperature=0.9, top_k=3, seed=2, logprobs=10)
    for lp in r.logprobs:
        assert len(lp.top) == 3 and lp.token in [t for t, _ in lp.top]
        assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-12)
    r0 = eng.generate(PROMPT, max_tokens=8, temperature=0.9, top_k=3, seed=2, logprobs=0)
    assert r0.tokens == r.tokens
    assert [(x.token, x.logprob) for x in r0.logprobs] == [(x.token, x.logprob) for x in r.logprobs]
    assert all(x.top == [] for x in r0.logprobs)
    assert eng.generate(PROMPT, max_tokens=8).logprobs is None


def test_greedy_logprobs_are_the_raw_log_softmax(pair):
    """Temperature 0 reports log_softmax(raw logits) whatever the filters say: the full
    distribution sums to one (checked with N = 20 on the first token against a float64 softmax)."""
    eng = engine(pair)
    r = eng.generate(PROMPT, max_tokens=1, logprobs=20, top_k=2, top_p=0.5)
    l = eng.eval(PROMPT)[-1].astype(np.float64)
    want = l - l.max() - np.log(np.exp(l - l.max()).sum())
    order = np.lexsort((np.arange(len(l)), -l))[:20]
    assert [t for t, _ in r.logprobs[0].top] == order.tolist()
    np.testing.assert_allclose([v for _, v in r.logprobs[0].top], want[order], rtol=0, atol=1e-12)
    assert r.stats.seed is None


def test_stream_and_chat_carry_logprobs(pair):
    eng = engine(pair, block_size=4)
    kw = dict(max_tokens=16, temperature=0.8, seed=9, logprobs=2)
    want = eng.generate(PROMPT, speculative=False, **kw)
    last = None
    for last in eng.generate(PROMPT, stream=True, **kw):
        pass
    assert last.result.logprobs == want.logprobs
    msgs = [{"role": "user", "content": "hello"}]
    a, b = eng.chat(msgs, speculative=False, **kw), eng.chat(msgs, **kw)
    assert a.logprobs == b.logprobs and len(b.logprobs) == len(b.tokens)


@pytest.mark.parametrize("bad", [-1, 21, 100, 2.0, True, "3", [3]])
def test_bad_logprobs(pair, bad):
    eng = engine(pair)
    with pytest.raises(ValueError, match=r"\[generate\] logprobs must be None or an int in \[0, 20\]"):
        eng.generate(PROMPT, max_tokens=4, logprobs=bad)
    with pytest.raises(ValueError, match=r"logprobs must be"):
        eng.generate(PROMPT, max_tokens=4, logprobs=bad, temperature=0.5, stream=True)
    with pytest.raises(ValueError, match=r"\[sampling\] logprobs must be in \[0, 20\]"):
        _core.Sampling(0.5, logprobs=21)


def test_cli_logprobs(pair):
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "dflash_native", "generate", "--target", pair[0],
                               "--prompt", "hello world", "--max-tokens", "6", "--threads", "2", *extra],
                              capture_output=True, text=True, timeout=300)

    p = run("--logprobs", "2", "--json", "--temperature", "0.8", "--seed", "3")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["logprobs"]) == len(out["tokens"])
    assert all(r["token"] == t and len(r["top"]) == 2 and r["logprob"] <= 0 for r, t in zip(out["logprobs"], out["tokens"]))
    q = run("--logprobs", "2", "--drafter", pair[1], "--json", "--temperature", "0.8", "--seed", "3")
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout.strip().splitlines()[-1])["logprobs"] == out["logprobs"]
    t = run("--logprobs", "1")
    n = int(re.search(r"(\d+) generated", t.stderr).group(1))
    assert t.returncode == 0 and n > 0 and t.stderr.count("[logprobs]") == n, t.stderr
    bad = run("--logprobs", "21")
    assert bad.returncode != 0 and "logprobs must be None or an int in [0, 20]" in bad.stderr
