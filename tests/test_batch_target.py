"""The batched target (session.h: decode_batch): several sequence slots' work in one target pass.

Every sequence's logits and caches after each step must equal, bit for bit, those of a one-sequence
Target running the same work alone (prompt chunks, AR steps, chain verifies with their commits), and
a slot's state after a commit must equal a fresh computation of its committed tokens.
docs/architecture.md, "Batched target".
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from dflash_native import _core
from fixtures import make_random_gguf

T = _core.testing

# every architecture: attention only (llama, qwen3, qwen3moe) and the GDN hybrids (qwen35 with and
# without routed experts, qwen3next)
ARCHS = ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
N_CTX = 160
MAX_VERIFY = 8


@pytest.fixture(scope="module", params=ARCHS)
def gguf(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return make_random_gguf(d / "m.gguf", request.param, outtype="f16", seed=11)


def solo(path, **kw):
    return _core.Target(str(path), n_ctx=N_CTX, n_threads=2, max_verify=MAX_VERIFY, **kw)


def caches(t, slot=None):
    """Every layer's K/V (attention) or (ssm, conv) state (GDN), of `slot` in a batch target."""
    out = []
    for il, kind in enumerate(t.layer_types):
        f = T.gdn_state if kind == "gdn" else T.kv
        out.append(f(t, il) if slot is None else f(t, il, slot))
    return out


def assert_caches_equal(a, b, what):
    for il, (x, y) in enumerate(zip(a, b)):
        for u, v in zip(x, y):
            assert u.shape == v.shape, f"{what}: layer {il} shapes {u.shape} != {v.shape}"
            assert np.array_equal(u, v), f"{what}: layer {il} differs by {np.abs(u - v).max()}"


def run_schedule(path, seed, n_seq, inspect_every_step, chunk=12, trees=False):
    """A random mix of prompt chunks, AR steps and verify blocks over n_seq slots, each step one
    decode_batch, against one solo Target per slot; returns how many items of each kind ran."""
    rng = np.random.default_rng(seed)
    bt = T.batch_target(str(path), n_seq, n_ctx=N_CTX, n_threads=2, max_verify=MAX_VERIFY, n_batch=256)
    ref = [solo(path) for _ in range(n_seq)]
    fresh = _core.Target(str(path), n_ctx=N_CTX, n_threads=2, n_batch=32)
    vocab = bt.n_vocab
    prompts = [list(map(int, rng.integers(3, vocab, int(rng.integers(2, 3 * chunk))))) for _ in range(n_seq)]
    fed = [0] * n_seq          # prompt tokens fed so far
    history = [[] for _ in range(n_seq)]  # committed tokens per slot
    counts = {"prefill": 0, "decode": 0, "verify": 0, "tree": 0, "commit": 0, "fresh": 0, "wide": 0}
    for step in range(14):
        slots = [s for s in range(n_seq) if rng.random() < 0.75 and T.slot_n_past(bt, s) + MAX_VERIFY + 12 < N_CTX]
        if not slots:
            continue
        rng.shuffle(slots)  # the batch's order is not the slots' order
        work = []
        for s in slots:
            left = len(prompts[s]) - fed[s]
            if left > 0:
                n = int(rng.integers(1, min(left, chunk) + 1))
                toks = prompts[s][fed[s]:fed[s] + n]
                work.append((s, toks, "prefill" if n < left else "decode"))
            elif rng.random() < 0.4:
                work.append((s, [int(rng.integers(3, vocab))], "decode"))
            elif trees and rng.random() < 0.5:  # a tree verify: node i's parent any earlier node
                n = int(rng.integers(1, MAX_VERIFY + 1))
                parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
                work.append((s, list(map(int, rng.integers(3, vocab, n))), "tree", parents))
            else:
                n = int(rng.integers(1, MAX_VERIFY + 1))
                work.append((s, list(map(int, rng.integers(3, vocab, n))), "verify"))
        out = T.decode_batch(bt, work)
        assert len(out) == len(work)
        counts["wide"] += sum(len(w[1]) for w in work) > 64  # past the kernel's old column limit
        for (s, toks, kind, *parents), logits in zip(work, out):
            counts[kind] += 1
            if kind == "tree":
                want = T.target_verify_tree(ref[s], toks, parents[0], logits=True)
                assert logits.shape == (len(toks), vocab)
            elif kind == "verify":
                want = ref[s].verify(toks)
                assert logits.shape == (len(toks), vocab)
            else:
                want = ref[s].decode(toks)[-1:]
                if kind == "prefill":
                    fed[s] += len(toks)
                    assert logits.shape == (0, vocab)
                    want = want[:0]
                else:
                    fed[s] = min(len(prompts[s]), fed[s] + len(toks))  # the last chunk, or an AR step
                    assert logits.shape == (1, vocab)
            assert np.array_equal(logits, want), f"step {step} slot {s} {kind}: logits differ"
        for s, toks, kind, *parents in work:
            if kind == "tree":  # a random root-to-node path kept
                node, path = int(rng.integers(0, len(toks))), []
                while node >= 0:
                    path.insert(0, node)
                    node = parents[0][node]
                T.commit_tree(bt, path, slot=s)
                T.commit_tree(ref[s], path)
                history[s] += [toks[i] for i in path]
                counts["commit"] += 1
            elif kind == "verify":
                keep = int(rng.integers(1, len(toks) + 1))
                T.commit_slot(bt, s, keep)
                ref[s].commit(keep)
                history[s] += toks[:keep]
                counts["commit"] += 1
            else:
                history[s] += toks
            assert T.slot_n_past(bt, s) == ref[s].n_past == len(history[s])
        # inspecting a cache does the replay a commit left to the next pass: done on both sides or neither
        if inspect_every_step or step % 5 == 4:
            for s in slots:
                assert_caches_equal(caches(bt, s), caches(ref[s]), f"step {step} slot {s}")
            for s, toks, kind, *_ in work:
                if kind in ("verify", "tree"):
                    # after a commit: the state of the committed tokens computed afresh
                    fresh.reset()
                    fresh.decode(history[s])
                    assert_caches_equal(caches(bt, s), caches(fresh), f"step {step} slot {s} after commit vs fresh")
                    counts["fresh"] += 1
    for s in range(n_seq):
        assert_caches_equal(caches(bt, s), caches(ref[s]), f"end slot {s}")
    return counts


@pytest.mark.parametrize("seed,n_seq,inspect", [(0, 3, True), (1, 4, False), (2, 12, False)])
def test_batch_equals_solo(gguf, seed, n_seq, inspect):
    counts = run_schedule(gguf, seed, n_seq, inspect, chunk=24 if n_seq == 12 else 12, trees=seed == 1)
    print(counts)
    if n_seq == 12:  # passes wider than 64 columns (build_context::any_width) equal solo too
        assert counts["wide"], counts
    if seed == 1:  # tree verifies beside the other work (their masks, positions and GDN tree ops per segment)
        assert counts["tree"], counts
    # the schedule exercised every kind of work (else this test checks less than it says)
    assert counts["prefill"] and counts["decode"] and counts["verify"] and counts["commit"]
    if inspect:
        assert counts["fresh"]


def test_a_graph_of_another_structure_is_planned_again(gguf):
    """Batched passes share a plan across shapes, planned again for each graph of another structure
    (graph_runner.h: run's plan_key). ggml's allocator reuses a plan for any graph of as many nodes
    whose tensors fit it:
    the same AR steps with the taps marked as outputs crashed in it after the same steps without
    taps, and two slots' step kinds swapped (a verify beside an AR step, then the other way round)
    had as many nodes in another order. Each pass equals the slots' solo passes."""
    bt = T.batch_target(str(gguf), 2, n_ctx=N_CTX, n_threads=2, max_verify=MAX_VERIFY)
    ref = [solo(gguf) for _ in range(2)]
    taps = [0, 1]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    T.decode_batch(bt, [(s, p, "prefill") for s, p in enumerate(prompts)])
    for s, p in enumerate(prompts):
        ref[s].decode(p)
    for k, with_taps in enumerate([False, True, False, True]):
        work = [(s, [20 + k + s], "decode") for s in range(2)]
        out = T.decode_batch(bt, work, taps if with_taps else [])
        for (s, toks, _), got in zip(work, out):
            want = ref[s].decode(toks, taps=taps) if with_taps else ref[s].decode(toks)
            if with_taps:
                assert np.array_equal(got[0], want[0][-1:]) and np.array_equal(got[1], want[1]), f"pass {k} slot {s}"
            else:
                assert np.array_equal(got, want[-1:]), f"pass {k} slot {s}"
    for k in range(4):  # a verify beside an AR step, the slots' kinds swapped each pass
        v = k % 2
        work = [(s, [30 + k, 31 + k, 32 + k] if s == v else [40 + k], "verify" if s == v else "decode") for s in range(2)]
        out = T.decode_batch(bt, work)
        for (s, toks, kind), got in zip(work, out):
            want = ref[s].verify(toks) if kind == "verify" else ref[s].decode(toks)[-1:]
            assert np.array_equal(got, want), f"pass {k} slot {s} {kind}"
        T.commit_slot(bt, v, 2)
        ref[v].commit(2)
    for s in range(2):
        assert_caches_equal(caches(bt, s), caches(ref[s]), f"slot {s}")


def test_one_item_is_the_solo_pass(gguf):
    """A batch of one slot's work is that slot's solo pass (the default path's shapes)."""
    toks = list(range(5, 22))
    bt = T.batch_target(str(gguf), 2, n_ctx=N_CTX, n_threads=2, max_verify=MAX_VERIFY)
    ref = solo(gguf)
    assert np.array_equal(T.decode_batch(bt, [(1, toks, "decode")])[0], ref.decode(toks))
    assert_caches_equal(caches(bt, 1), caches(ref), "slot 1")
    assert T.slot_n_past(bt, 0) == 0  # slot 0 untouched
    logits, taps = T.decode_batch(bt, [(1, [7, 8, 9], "verify")], taps=[0])[0]
    want_logits, want_taps = ref.verify([7, 8, 9], taps=[0])
    assert np.array_equal(logits, want_logits) and np.array_equal(taps, want_taps)


def test_bad_batches_are_clear_errors(tmp_path):
    path = make_random_gguf(tmp_path / "m.gguf", "qwen3_5", outtype="f16", seed=3)
    bt = T.batch_target(str(path), 2, n_ctx=64, n_threads=2, max_verify=4, n_batch=16)
    assert T.n_seq(bt) == 2
    with pytest.raises(ValueError, match="twice"):
        T.decode_batch(bt, [(0, [5], "decode"), (0, [6], "decode")])
    with pytest.raises(ValueError, match="slot 2 outside"):
        T.decode_batch(bt, [(2, [5], "decode")])
    with pytest.raises(ValueError, match="n_batch"):
        T.decode_batch(bt, [(0, [5] * 10, "decode"), (1, [5] * 10, "decode")])
    with pytest.raises(ValueError, match="max_verify"):
        T.decode_batch(bt, [(0, [5] * 5, "verify")])
    with pytest.raises(ValueError, match="kind"):
        T.decode_batch(bt, [(0, [5], "bogus")])
    with pytest.raises(ValueError, match="parents"):
        T.decode_batch(bt, [(0, [5], "tree")])
    with pytest.raises(ValueError, match="parent"):  # node 1's parent must come before it
        T.decode_batch(bt, [(0, [5, 6], "tree", [-1, 1])])
    with pytest.raises(ValueError, match="one parent per node"):
        T.decode_batch(bt, [(0, [5, 6], "tree", [-1])])
    with pytest.raises(ValueError, match="no work"):
        T.decode_batch(bt, [])
    with pytest.raises(ValueError, match="vocabulary"):
        T.decode_batch(bt, [(1, [bt.n_vocab], "decode")])
    T.decode_batch(bt, [(1, [5, 6], "verify")])
    with pytest.raises(ValueError, match="pending"):
        T.decode_batch(bt, [(1, [5], "decode")])
    with pytest.raises(ValueError, match="no verify is pending"):
        T.commit_slot(bt, 0, 1)
    T.commit_slot(bt, 1, 2)
    assert T.slot_n_past(bt, 1) == 2 and T.slot_n_past(bt, 0) == 0
    T.reset_slot(bt, 1)
    assert T.slot_n_past(bt, 1) == 0
    with pytest.raises(ValueError, match="n_seq must be >= 1"):
        T.batch_target(str(path), 0, n_ctx=64)


def test_slots_that_do_not_fit_fail_at_creation(tmp_path):
    """An n_seq whose caches exceed the machine's memory is a MemoryError when the target is made,
    naming n_seq, before any slot past the first is allocated."""
    path = make_random_gguf(tmp_path / "m.gguf", "qwen3", outtype="f16", seed=3)
    n_ctx = 1 << 16
    one = _core.Target(str(path), n_ctx=n_ctx, n_threads=1)
    per_slot, kv = one.cache_bytes, one.memory_report()["kv_cache"]
    del one
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    n_seq = phys // per_slot + 2
    with pytest.raises(MemoryError, match=f"n_seq = {n_seq}"):
        T.batch_target(str(path), n_seq, n_ctx=n_ctx, n_threads=1)
    two = T.batch_target(str(path), 2, n_ctx=n_ctx, n_threads=1)
    assert two.memory_report()["kv_cache"] == 2 * kv  # every slot's caches counted


def test_eight_slots_of_a_deep_hybrid(tmp_path):
    """Eight sequences through a 24-layer Qwen3-Next (the most graph nodes per segment: its q/k
    repeat) in one pass: the graph fits the runner's arena (session.cpp sizes it by n_seq) and each
    slot's verify rows are its solo pass's."""
    path = make_random_gguf(tmp_path / "m.gguf", "qwen3_next", outtype="f16", seed=4, num_hidden_layers=24)
    bt = T.batch_target(str(path), 8, n_ctx=64, n_threads=2, max_verify=MAX_VERIFY)
    ref = _core.Target(str(path), n_ctx=64, n_threads=2, max_verify=MAX_VERIFY)
    rng = np.random.default_rng(2)
    work = [(s, list(map(int, rng.integers(3, bt.n_vocab, MAX_VERIFY))), "verify") for s in range(8)]
    out = T.decode_batch(bt, work)
    for (s, toks, _), logits in zip(work, out):
        ref.reset()
        assert np.array_equal(logits, ref.verify(toks)), f"slot {s}"
        ref.commit(1)
