"""Tree verify's host parts: accept_tree, the drafter's top-K rows and the best-first tree,
against the NumPy references in tests/reference/tree_ref.py (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dflash_native as dn
from dflash_native import _core
from reference.gdn_ref import accept_prefix as ref_accept_prefix
from reference import tree_ref


@st.composite
def trees(draw, max_nodes=24, vocab=3):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    target = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return parents, tokens, target


@given(trees())
def test_accept_tree_matches_reference(t):
    parents, tokens, target = t
    got = dn.accept_tree(parents, tokens, target)
    assert got == tree_ref.accept_tree(parents, tokens, target)
    # the accepted tokens are a root-to-node path of the tree
    cur = 0
    for tok in got[:-1]:
        kids = [i for i in range(len(parents)) if parents[i] == cur and tokens[i] == tok]
        assert kids
        cur = kids[0]


@given(st.integers(1, 17).flatmap(lambda b: st.tuples(
    st.lists(st.integers(0, 3), min_size=b, max_size=b), st.lists(st.integers(0, 3), min_size=b, max_size=b))))
def test_accept_tree_on_a_chain_is_accept_prefix(tt):
    tokens, target = tt
    parents = list(range(-1, len(tokens) - 1))
    assert dn.accept_tree(parents, tokens, target) == ref_accept_prefix(tokens[1:], target)
    assert dn.accept_tree(parents, tokens, target) == dn.accept_prefix(tokens[1:], target)


def test_accept_tree_bad_input():
    assert dn.accept_tree([-1], [5], [7]) == [7]
    with pytest.raises(ValueError, match=r"parents\[0\] must be -1"):
        dn.accept_tree([0, 0], [1, 2], [1, 2])
    with pytest.raises(ValueError, match=r"parents\[2\] = 2 must be in \[0, 2\)"):
        dn.accept_tree([-1, 0, 2], [1, 2, 3], [1, 2, 3])
    with pytest.raises(ValueError, match="one entry per node"):
        dn.accept_tree([-1, 0], [1, 2], [1])
    with pytest.raises(ValueError, match="root"):
        dn.accept_tree([], [], [])


@given(st.integers(1, 6), st.integers(1, 40), st.integers(1, 9), st.integers(0, 2**31 - 1), st.booleans())
def test_topk_matches_reference(n, V, K, seed, ties):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, V)).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)  # many exact ties
    idx, p = _core.testing.topk(logits, K)
    kk = min(K, V)
    ref_idx, ref_p = tree_ref.topk(logits, kk)
    np.testing.assert_array_equal(idx[:, :kk], ref_idx)
    np.testing.assert_allclose(p[:, :kk], ref_p, rtol=5e-5)
    assert (p[:, kk:] == 0).all()
    # the first pair is top1's exactly
    a1, p1 = _core.testing.top1(logits)
    np.testing.assert_array_equal(idx[:, 0], a1)
    np.testing.assert_array_equal(p[:, 0], p1)


def test_topk_flags_non_finite_rows():
    logits = np.zeros((2, 5), np.float32)
    logits[1, 3] = np.nan
    idx, _ = _core.testing.topk(logits, 3)
    assert idx[0, 0] == 0 and idx[1, 0] == -1


def random_rows(rng, n_pos, K, V, ties):
    tok = np.stack([rng.choice(V, size=K, replace=False) for _ in range(n_pos)])
    if ties:
        p = rng.choice([0.5, 0.25, 0.125, 0.0], size=(n_pos, K)).astype(np.float32)
    else:
        p = rng.dirichlet(np.ones(K + 1), size=n_pos)[:, :K].astype(np.float32)
    # rows as topk_op gives them: probability descending, ties by token ascending
    for r in range(n_pos):
        o = np.lexsort((tok[r], -p[r]))
        tok[r], p[r] = tok[r][o], p[r][o]
    return tok.astype(np.int32), p


@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 40), st.integers(0, 2**31 - 1), st.booleans(),
       st.sampled_from([0.0, 0.01, 0.2]))
def test_build_tree_matches_reference(n_pos, K, budget, seed, ties, cutoff):
    rng = np.random.default_rng(seed)
    tok, p = random_rows(rng, n_pos, K, 6, ties)
    parents, tokens, depths, scores = _core.testing.build_tree(99, tok, p, budget, cutoff)
    assert (parents, tokens, depths) == tree_ref.build_tree(99, tok, p, budget, cutoff)
    assert len(parents) <= budget + 1
    assert all(parents[i] < i for i in range(1, len(parents)))
    assert all(s >= cutoff for s in scores)


@given(st.integers(1, 16), st.integers(1, 20), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.05, 0.5]))
def test_build_tree_with_k1_is_the_top1_chain(n_pos, budget, seed, cutoff):
    rng = np.random.default_rng(seed)
    tok, p = random_rows(rng, n_pos, 1, 50, False)
    parents, tokens, depths, _ = _core.testing.build_tree(7, tok, p, budget, cutoff)
    # spec_session::cutoff_keep's rule: keep while the running product stays >= the cutoff
    keep, prod = 0, 1.0
    for i in range(n_pos):
        prod *= float(p[i, 0])
        if prod < cutoff or keep == budget:
            break
        keep += 1
    assert parents == list(range(-1, keep))
    assert tokens == [7] + tok[:keep, 0].tolist()
    assert depths == list(range(keep + 1))
