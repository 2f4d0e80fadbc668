"""Sampling with tree verify: each position's children are the drafter's K best tokens by the
perturbed score l / T + G(seed, position, token) over its filtered logits, and the path kept is the
target's draws, so a sampled tree request commits exactly the sampled AR tokens at its seed.

Random tiny dense (Qwen3) and hybrid (Qwen3.5) pairs written by the package's converters, F32, on
the package's batch-invariant kernels (the embedded default pair: test_sampling.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from fixtures import make_spec_pair
from reference import sampling_ref as ref

PAIRS = ("qwen3", "qwen35")
PROMPT = [int(x) for x in np.random.default_rng(5).integers(3, 500, 9)]

SETTINGS = [
    dict(temperature=0.3), dict(temperature=0.7), dict(temperature=1.0), dict(temperature=1.5),
    dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=3.0), dict(temperature=3.0, top_k=10, min_p=0.01),  # flat: drafts get accepted
]


@pytest.fixture(scope="module", params=PAIRS)
def pair(request, tmp_path_factory):
    _, tg, dg = make_spec_pair(tmp_path_factory.mktemp("tree-sampling-" + request.param), request.param, seed=13)
    return str(tg), str(dg)


def engine(pair, **kw):
    kw.setdefault("gate", False)
    return dn.Engine(pair[0], drafter=pair[1], n_ctx=256, kv_type="f32", n_threads=2, verify="tree", **kw)


@pytest.mark.parametrize("budget,capacity", [(1, 16), (6, 17), (20, 16), (63, 64)])
@pytest.mark.parametrize("si", range(len(SETTINGS)))
def test_sampled_tree_equals_sampled_ar(pair, budget, capacity, si):
    """Every setting and tree budget, rings smaller than the 48 generated tokens (but the last),
    two seeds each (one past 2^63): the tree's tokens are sampled AR's."""
    eng = engine(pair, block_size=16, feature_ring_capacity=capacity, tree_budget=budget)
    for seed in (500 + si, 2**63 + 7 * si):
        kw = dict(max_tokens=48, seed=seed, **SETTINGS[si])
        ar = eng.generate(PROMPT, speculative=False, **kw)
        sp = eng.generate(PROMPT, **kw)
        assert sp.stats.speculative and sp.stats.rounds > 0 and sp.stats.seed == seed
        assert sp.tokens == ar.tokens, (seed, SETTINGS[si])
        assert sp.stats.verified_tokens <= sp.stats.rounds * (budget + 1)


@pytest.mark.parametrize("ar_s", [1e-3, 1e3])
def test_sampled_tree_under_the_controller(pair, ar_s):
    """The controller (fixed costs: AR cheap, then dear) drives AR steps and tree rounds of a
    sampled request; the tokens are sampled AR's."""
    eng = engine(pair, block_size=16, feature_ring_capacity=16, tree_budget=12, gate=True)
    _core.testing.controller_fixed_costs(eng._spec, ar_s, 0.5, 1.0, 0.1)
    for s in (SETTINGS[1], SETTINGS[9]):
        kw = dict(max_tokens=60, seed=17, **s)
        ar = eng.generate(PROMPT, speculative=False, **kw).tokens
        sp = eng.generate(PROMPT, **kw)
        assert sp.tokens == ar and sp.stats.ar_steps >= 1
        if ar_s > 1:
            assert sp.stats.rounds > sp.stats.ar_steps


def test_sampled_trees_accept_drafts(pair):
    """At T = 3 the shared noise decides both draws often enough that tree rounds commit more
    than the bonus token: the accept path below the root runs with natural trees."""
    eng = engine(pair, block_size=16, tree_budget=24)
    hist = np.zeros(17, dtype=int)
    for seed in range(6):
        r = eng.generate(PROMPT, max_tokens=48, temperature=3.0, seed=seed)
        assert r.tokens == eng.generate(PROMPT, max_tokens=48, temperature=3.0, seed=seed, speculative=False).tokens
        hist += np.array(r.stats.acceptance_histogram)
    assert hist[2:].sum() > 0, hist


@pytest.mark.parametrize("si", [0, 4, 7, 9])
def test_children_are_the_perturbed_ranking(pair, si):
    """A sampled tree round's children of every node at depth d are, in index order, the top of
    the drafter's row d ranked by l / T + G(seed, n_past + 1 + d, token) over the tokens its
    filters keep (the NumPy reference's filters and noise, the drafter's logits from
    draft_logits); the first child is the coupled draw a sampled chain round proposes."""
    s = dict(SETTINGS[si], seed=99)
    sampling = _core.Sampling(**s)
    f = {k: s[k] for k in ("top_k", "top_p", "min_p") if k in s}
    t = _core.Target(pair[0], n_ctx=256, kv_type="f32", max_verify=64, n_threads=2)
    spec = _core.Spec(t, pair[1], block_size=16, ring_capacity=64, tree_budget=40)
    last = spec.prefill(PROMPT, sampling)
    n_past = t.n_past
    rows = _core.testing.draft_logits(spec, last, 16, t)  # [15, n_vocab]: the drafter's logits for this block
    ranking = []
    for d in range(15):
        kept = ref.filter_kept(rows[d], **f)
        score = rows[d][kept].astype(np.float64) / s["temperature"] + ref.gumbel(s["seed"], n_past + 1 + d, kept)
        ranking.append([kept[j] for j in sorted(range(len(kept)), key=lambda j: (-score[j], kept[j]))])
    r = spec.round_tree(last, 16, sampling)
    tokens = [last] + list(r.draft)
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[r.parents[i]] + 1
    n_children = 0
    for i in range(len(tokens)):
        kids = [tokens[j] for j in range(i + 1, len(tokens)) if r.parents[j] == i]
        assert kids == (ranking[depth[i]][: len(kids)] if depth[i] < 15 else []), i
        n_children += len(kids)
    assert n_children == len(tokens) - 1 > 0

    t2 = _core.Target(pair[0], n_ctx=256, kv_type="f32", max_verify=64, n_threads=2)
    spec2 = _core.Spec(t2, pair[1], block_size=16, ring_capacity=64)
    assert spec2.prefill(PROMPT, sampling) == last
    assert spec2.round(last, 16, sampling=sampling).draft[0] == ranking[0][0]  # the same block of 16


# the embedded default pair with sampled trees: test_sampling.py::test_default_pair_sampled_speculative_equals_sampled_ar
