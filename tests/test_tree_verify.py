"""Tree verify end to end (issue 14): each node computes its path's AR step bit for bit, and after
a tree commit every cache (K/V rows, GDN recurrent and conv state, feature ring) equals a fresh AR
computation of the accepted path, bitwise; tree-mode Engine output is the AR output. Random tiny
dense (Qwen3) and hybrid (Qwen3.5) pairs written by the package's converters, F32 weights."""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from fixtures import SPEC_PAIRS, cycling_drafts, make_spec_pair

PAIRS = SPEC_PAIRS
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    _, tg, dg = make_spec_pair(tmp_path_factory.mktemp("tree-" + request.param), request.param, seed=5)
    return {"name": request.param, "target": str(tg), "drafter": str(dg)}


def make(pair, capacity=64, budget=40):
    t = _core.Target(pair["target"], n_ctx=256, kv_type="f32", max_verify=64, n_threads=2)
    return t, _core.Spec(t, pair["drafter"], block_size=16, ring_capacity=capacity, tree_budget=budget)


def ar_tokens(t, n):
    t.reset()
    out = [int(np.argmax(t.decode(PROMPT)[-1]))]
    while len(out) < n:
        out.append(int(np.argmax(t.decode([out[-1]])[-1])))
    t.reset()
    return out


def random_tree_with_path(rng, last, path_tokens, n_other, vocab=500, avoid=()):
    """A tree rooted at `last` whose nodes, in a random topological order, include the chain
    path_tokens below the root (the AR continuation) among n_other random nodes, some of them
    children of path nodes (siblings of the true continuation); no random node is a token of
    path_tokens or `avoid` (AR's token after the path: the accepted path is the chain, exactly)."""
    parents, tokens, on_path = [-1], [last], [0]
    todo_path = list(path_tokens)
    while todo_path or n_other > 0:
        if todo_path and (n_other == 0 or rng.random() < 0.4):
            parents.append(on_path[-1])
            tokens.append(todo_path.pop(0))
            on_path.append(len(tokens) - 1)
        else:
            p = int(rng.integers(0, len(tokens)))
            bad = {tokens[i] for i in range(len(tokens)) if parents[i] == p}  # no twins
            tok = int(rng.integers(3, vocab))
            if tok in bad or tok in path_tokens or tok in avoid:  # the AR path stays the only accepted one
                continue
            parents.append(p)
            tokens.append(tok)
            n_other -= 1
    return parents, tokens, on_path


def caches(t):
    return [_core.testing.gdn_state(t, i) if ty == "gdn" else _core.testing.kv(t, i)
            for i, ty in enumerate(t.layer_types)]


@pytest.mark.parametrize("seed", range(4))
def test_tree_commit_equals_fresh_ar(pair, seed):
    """verify_tree over random trees holding the AR continuation to a chosen depth (every depth 0..15
    of the block once, in a random order, among random siblings): the committed tokens are AR's, and
    every cache and the ring equal AR steps over the same tokens, bitwise."""
    rng = np.random.default_rng(seed)
    t, s = make(pair, capacity=17)  # a ring smaller than the output: it wraps
    ref = ar_tokens(t, 160)
    got = [s.prefill(PROMPT)]
    lengths = []
    for depth in rng.permutation(16):
        depth = int(depth)
        n_other = int(rng.integers(0, 64 - 1 - depth))
        parents, tokens, on_path = random_tree_with_path(rng, got[-1], ref[len(got): len(got) + depth], n_other,
                                                         avoid=(ref[len(got) + depth],))
        r = _core.testing.verify_tree(s, parents, tokens)
        assert r.n_verified == len(tokens)
        assert r.path == on_path and len(r.committed) == depth + 1  # the chain, then AR's token after it
        lengths.append(len(r.committed))
        got += r.committed
    assert got == ref[: len(got)]
    # rounds committed more than one token: every length 1..16 of the block once (mean 8.5)
    assert set(range(1, 17)) <= set(lengths) and np.mean(lengths) > 1.5, lengths

    # fresh AR steps over exactly the committed tokens
    t2, s2 = make(pair, capacity=17)
    out = [s2.prefill(PROMPT)]
    for tok in got[1:]:
        assert s2.ar_step(out[-1]) == tok
        out.append(tok)
    assert t2.n_past == t.n_past
    for a, b in zip(caches(t), caches(t2)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert _core.testing.ring_slot_positions(s) == _core.testing.ring_slot_positions(s2)
    for il in range(s.drafter_n_layer):
        for x, y in zip(_core.testing.ring_kv(s, il), _core.testing.ring_kv(s2, il)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("budget", [1, 2, 7, 16, 33, 63])
def test_tree_engine_is_ar(pair, budget):
    """Engine(verify="tree") output == AR output, bit for bit (fixed settings and the controller),
    with a feature ring smaller than the output; verified_tokens counts nodes + root."""
    for gate in (False, True):
        eng = dn.Engine(pair["target"], drafter=pair["drafter"], block_size=16, feature_ring_capacity=16, n_ctx=256,
                        kv_type="f32", n_threads=2, verify="tree", tree_budget=budget, gate=gate)
        ar = eng.generate(PROMPT, max_tokens=50, speculative=False)
        sp = eng.generate(PROMPT, max_tokens=50)
        assert sp.tokens == ar.tokens
        st = sp.stats
        assert st.rounds > 0 or gate
        if st.rounds:
            # fixed settings verify nodes every round; the controller may verify the root alone
            # (no node worth its cost: a random drafter's are rarely accepted)
            assert (st.rounds <= st.verified_tokens if gate else st.rounds < st.verified_tokens)
            assert st.verified_tokens <= st.rounds * (budget + 1)
            assert 1.0 <= st.mean_acceptance_length <= 16


# the random pairs' AR output from this prompt runs 150 tokens without an end-of-generation token
FORCED_PROMPT = [int(x) for x in np.random.default_rng(1).integers(3, 500, 11)]


@pytest.mark.parametrize("budget", [1, 2, 7, 15, 63])
def test_tree_engine_is_ar_on_accepted_drafts(pair, budget):
    """Tree rounds that accept drafts: drafts from the AR output put first in the drafter's top-K (the
    tree holds them as its best path to depth min(budget, 15), the drafter's tokens as siblings), round
    r's first wrong one at depth 1 + k, k = (every r) mod (D + 1), D = min(budget, 15) + 1 (k >= D - 1:
    none in the tree). Under fixed settings round r commits min(k, D - 1) + 1 tokens or, where one of
    the drafter's siblings is AR's token, more: every length 1..D in D + 1 rounds (D twice), 16 at the
    larger budgets; the output is AR's, bit for bit. With budget 63 the controller (fixed
    costs, a verified node cheap) runs the same drafts: AR's output, rounds of more than one token."""
    B = 16
    D = min(budget, B - 1) + 1  # the longest round: the tree's deepest path and its bonus token
    every = 3 if (D + 1) % 3 else 2  # coprime to D + 1
    n = 1 + D * (D + 1) // 2 + D  # the prefill's token and one cycle of D + 1 rounds
    eng = dn.Engine(pair["target"], drafter=pair["drafter"], block_size=B, feature_ring_capacity=16, n_ctx=256,
                    kv_type="f32", n_threads=2, verify="tree", tree_budget=budget, gate=False)
    ar = eng.generate(FORCED_PROMPT, max_tokens=n, speculative=False)
    assert len(ar.tokens) == n
    full = ar.tokens + [0] * B
    rounds = [0]

    def override(prompt, out, Bc):  # cycling_drafts with the miss cycling over the tree's depths
        k = (rounds[0] * every) % (D + 1)
        rounds[0] += 1
        d = full[len(out): len(out) + Bc - 1]
        if k < D - 1:
            d[k] = (d[k] + 1) % 500
        return d

    for gate in (False, True) if budget == 63 else (False,):
        eng.gate = gate
        if gate:
            _core.testing.controller_fixed_costs(eng._spec, 1.0, 0.2, 1.0, 0.01)
        rounds[0] = 0
        eng._draft_override = override
        forced = eng.generate(FORCED_PROMPT, max_tokens=n)
        eng._draft_override = None
        assert forced.tokens == ar.tokens
        st, hist = forced.stats, forced.stats.acceptance_histogram
        assert st.mean_acceptance_length > 1.5, hist
        if gate:  # its first step is an AR step (it measures AR), which took round 0's drafts (k = 0)
            assert st.ar_steps == 1 and hist[1] == 0 and all(hist[2: D + 1]), hist
            continue
        want = [0] * (B + 1)
        for r in range(D + 1):
            want[min((r * every) % (D + 1), D - 1) + 1] += 1
        # exactly the schedule: none of the drafter's siblings was AR's token on these pairs (one would
        # lengthen its round, and this would fail)
        assert st.rounds == D + 1 and hist == want, (hist, want)


def test_tree_rounds_build_the_drafters_tree(pair):
    """round_tree verifies build_tree over the drafter's top-K rows (K = budget here): with
    K = 1 (budget 1) it is the chain's first draft; the tree respects the budget and parents < i."""
    t, s = make(pair, budget=12)
    last = s.prefill(PROMPT)
    r = s.round_tree(last, 16)
    assert 1 <= r.n_verified <= 13 and r.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(r.parents) if i)
    t2, s2 = make(pair, budget=1)
    last2 = s2.prefill(PROMPT)
    assert last2 == last
    chain_draft = s2.draft(last2, 16)
    r2 = s2.round_tree(last2, 16)
    assert r2.parents == [-1, 0] and r2.draft == chain_draft[:1]


def test_tree_bad_input(pair):
    with pytest.raises(ValueError, match="verify must be 'chain' or 'tree'"):
        dn.Engine(pair["target"], drafter=pair["drafter"], verify="graph")
    with pytest.raises(ValueError, match="needs a drafter"):
        dn.Engine(pair["target"], verify="tree")
    for b in (0, -1, 64):
        with pytest.raises(ValueError, match=r"tree_budget must be in \[1, 63\]"):
            dn.Engine(pair["target"], drafter=pair["drafter"], verify="tree", tree_budget=b)
    t, s = make(pair, budget=5)
    last = s.prefill(PROMPT)
    with pytest.raises(ValueError, match="tree_budget must be in"):
        s.tree_budget = 64
    with pytest.raises(ValueError, match=r"parents\[0\] must be -1"):
        _core.testing.verify_tree(s, [0, 0], [last, 3])
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        _core.testing.verify_tree(s, [-1, 1], [last, 3])
    # nothing was committed by the refused verifies: a tree round still runs
    assert s.round_tree(last, 16).n_verified >= 1


def test_cli_verify_tree(tmp_path):
    """dflash-native generate --verify tree --tree-budget N reaches the engine; a bad budget is a
    clean error naming tree_budget."""
    import subprocess
    import sys

    from fixtures import make_random_pair

    tg, dg = make_random_pair(tmp_path, seed=3, block_size=8, outtype="f32")
    base = [sys.executable, "-m", "dflash_native", "generate", "--target", str(tg), "--drafter", str(dg),
            "--prompt", "hi", "--max-tokens", "6", "--verify", "tree"]
    ok = subprocess.run(base + ["--tree-budget", "5"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "rounds" in ok.stderr + ok.stdout
    bad = subprocess.run(base + ["--tree-budget", "64"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "tree_budget must be in [1, 63]" in bad.stderr + bad.stdout
