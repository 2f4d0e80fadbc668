"""The prompt cache (Engine.generate(..., cache_prompt=True)): a prompt that continues the sequence
the engine holds from its previous request prefills only its new tokens, and the output is a cold
start's, bit for bit.

Pairs are random tiny models written by the package's converters (dense Qwen3 and hybrid Qwen3.5,
whose GDN recurrent and conv states must continue exactly). n_batch=64 keeps every prefill chunk on
the package's batch-invariant kernels (at most k_matmul_max_cols = 64 columns), so a cold prefill
computes each token as the cached path's steps and rounds did: bitwise. Wider prompt chunks run
ggml's matmul, where the near-tie rule applies (the last test).
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native.lossless import NEAR_TIE, first_divergence_gap
from fixtures import SPEC_PAIRS, make_spec_pair

PAIRS = ("qwen3", "qwen35")
RNG = np.random.default_rng(7)
P1 = [int(x) for x in RNG.integers(3, 500, 80)]  # two prefill chunks at n_batch=64
EXTRA = [int(x) for x in RNG.integers(3, 500, 23)]


@pytest.fixture(scope="module", params=PAIRS)
def pair(request, tmp_path_factory):
    assert request.param in SPEC_PAIRS
    _, tg, dg = make_spec_pair(tmp_path_factory.mktemp("pcache-" + request.param), request.param, seed=21)
    return tg, dg


def engine(pair, **kw):
    kw.setdefault("n_batch", 64)
    return dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2, **kw)


def held(eng) -> list[int]:
    """The sequence the engine's core holds (white box: the prompt cache's state)."""
    assert eng._held is not None
    return list(eng._held[0])


SAMPLED = dict(temperature=0.9, top_k=40, seed=1234)


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "spec"])
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_continuation_equals_cold_start(pair, speculative, sampling):
    """Three turns, each prompt the previous sequence plus new tokens: each turn prefills only its new
    tokens and its output equals a fresh engine's on the whole prompt, token for token."""
    eng, cold = engine(pair), engine(pair)
    kw = dict(max_tokens=20, speculative=speculative, **sampling)
    r = eng.generate(P1, cache_prompt=True, **kw)
    assert r.stats.n_cached_tokens == 0
    prompt = P1
    for turn in range(2):
        seq = held(eng)
        # the core ran the prompt and every committed token but the last; a round never commits
        # past max_tokens, so a request ended by it holds exactly its prompt and tokens
        assert r.stats.stop_reason == "length" and seq == prompt + r.tokens[:-1]
        prompt = seq + EXTRA[turn * 7:turn * 7 + 9]
        r = eng.generate(prompt, cache_prompt=True, **kw)
        c = cold.generate(prompt, **kw)
        assert r.stats.n_cached_tokens == len(seq) and r.stats.n_prompt_tokens == len(prompt) == c.stats.n_prompt_tokens
        assert c.stats.n_cached_tokens == 0
        assert r.tokens == c.tokens and r.text == c.text, turn
        if speculative:
            assert r.stats.speculative and r.stats.rounds + r.stats.ar_steps > 0


def test_cold_starts(pair):
    """Whatever the core holds cannot be reused as it is: a prompt diverging before its end, a prompt
    equal to it (no token would run), an AR request's sequence for a speculative one (the ring was
    not filled), after eval(), after a stream closed early, without cache_prompt. Each is a cold
    start with the cold output."""
    eng, cold = engine(pair), engine(pair)
    base = eng.generate(P1, max_tokens=12, cache_prompt=True)
    seq = held(eng)
    want = lambda p, **kw: cold.generate(p, max_tokens=12, **kw).tokens  # noqa: E731

    def check(p, n_cached, **kw):
        r = eng.generate(p, max_tokens=12, cache_prompt=True, **kw)
        assert r.stats.n_cached_tokens == n_cached and r.tokens == want(p, **kw)

    diverged = seq[:-1] + [(seq[-1] + 1) % 500] + EXTRA[:5]
    check(diverged, 0)
    eng.generate(P1, max_tokens=12, cache_prompt=True)
    check(list(held(eng)), 0)  # nothing new to run
    # an AR request leaves the ring behind: a speculative continuation starts cold, an AR one does not
    eng.generate(P1, max_tokens=12, speculative=False, cache_prompt=True)
    check(held(eng) + EXTRA[:5], 0)
    eng.generate(P1, max_tokens=12, speculative=False, cache_prompt=True)
    s = held(eng)
    check(s + EXTRA[:5], len(s), speculative=False)
    # eval() resets the core
    eng.generate(P1, max_tokens=12, cache_prompt=True)
    s = held(eng)
    eng.eval(P1[:5])
    check(s + EXTRA[:5], 0)
    # a stream closed after its first piece leaves nothing to reuse
    eng.generate(P1, max_tokens=12, cache_prompt=True)
    s = held(eng)
    stream = eng.generate(s + EXTRA[:3], max_tokens=12, stream=True, cache_prompt=True)
    next(stream)
    stream.close()
    check(s + EXTRA[:5], 0)
    # without cache_prompt the held sequence is not used, and is reusable afterwards
    eng.generate(P1, max_tokens=12, cache_prompt=True)
    s = held(eng)
    assert eng.generate(s + EXTRA[:5], max_tokens=12).stats.n_cached_tokens == 0
    assert base.stats.n_cached_tokens == 0


def test_continuation_after_a_stop_string(pair):
    """A request that ends on a stop string: the held sequence (every committed token but the last,
    rounds may commit past the stop) is continued exactly."""
    eng, cold = engine(pair), engine(pair)
    r0 = eng.generate(P1, max_tokens=24)
    text = r0.text
    stop = text[len(text) // 2:len(text) // 2 + 2] if len(text) >= 4 else None
    if not stop or not stop.strip():
        pytest.skip("this random model's text has no usable stop string")
    r = eng.generate(P1, max_tokens=24, stop=stop, cache_prompt=True)
    assert r.stats.stop_reason == "stop"
    seq = held(eng)
    # every committed token but the last was run: the returned ones (the stop string's end included)
    assert seq[:len(P1)] == P1 and len(seq) >= len(P1) + len(r.tokens) - 1
    p = seq + EXTRA[:6]
    c = eng.generate(p, max_tokens=16, cache_prompt=True)
    assert c.stats.n_cached_tokens == len(seq) and c.tokens == cold.generate(p, max_tokens=16).tokens


def test_wide_prefill_chunks_follow_the_near_tie_rule(pair):
    """At the default n_batch a cold prefill of a long prompt runs chunks of more than 64 tokens on
    ggml's matmul, which rounds differently from the steps and rounds that ran the cached tokens:
    the outputs are equal, or first differ where the top-2 logits are a near-tie."""
    eng, cold = engine(pair, n_batch=512), engine(pair, n_batch=512)
    eng.generate(P1, max_tokens=20, cache_prompt=True)
    p = held(eng) + EXTRA
    r = eng.generate(p, max_tokens=20, cache_prompt=True)
    c = cold.generate(p, max_tokens=20)
    assert r.stats.n_cached_tokens == len(p) - len(EXTRA)
    gap = first_divergence_gap(cold, p, c.tokens, r.tokens)
    assert gap is None or gap < NEAR_TIE
