"""The first batch engine (spec/batch_engine.h): greedy chain rounds for several requests at once,
one drafter pass and one target pass per step, requests joining and leaving between steps.

Each request's tokens must equal its greedy AR tokens from a one-sequence Target, and each of its
rounds (the drafts verified, the tokens committed) must equal a one-sequence Spec's rounds over the
same request: the batched drafter pass computes each block as the solo draft does, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_native import _core
from fixtures import make_spec_pair

T = _core.testing
N_CTX = 160
B = 4


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen35", "qwen3next"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch-" + request.param)
    _, tg, dg = make_spec_pair(d, request.param, seed=5)
    return {"target": str(tg), "drafter": str(dg)}


# drafter kinds beyond DFlash (docs/architecture.md, "Drafter kinds"): the target (a SPEC_PAIRS
# name) and make_random_drafter_gguf overrides
KINDS = {
    # per-layer dynamic convolutions (rows mix within a block) and the top-k path selector
    "dflash2": ("qwen35", dict(kind="dflash2", dflash_config={"selector_top_k": 3})),
    # anchor-first rows (a block of B-1 rows, every one drafting), Markov and confidence heads,
    # partial RoPE (on a target without M-RoPE sections) and the attention value scale;
    # dflash.attention.scale added to the file below
    "dspark": ("qwen3", dict(kind="dspark", sample_from_anchor=True, confidence_head=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "partial_rotary_factor": 0.5},
                             dflash_config={"attention_value_scale": 0.5})),
    # DFlash's rows (the anchor row drafts nothing) with the Markov head
    "dspark-bonus": ("qwen35", dict(kind="dspark", sample_from_anchor=False, confidence_head=False)),
}


@pytest.fixture(scope="module", params=list(KINDS))
def kind_pair(request, tmp_path_factory):
    """A target and a random drafter of the kind."""
    from dflash_native.convert import convert_hf_to_gguf
    from dflash_native.random_models import make_random_drafter_gguf
    from fixtures import SPEC_PAIRS, make_random_checkpoint
    from gguf import GGUFValueType
    from reference.gguf_edit import rewrite_gguf

    d = tmp_path_factory.mktemp("batch-kind-" + request.param)
    target, over = KINDS[request.param]
    arch, t_over, d_over = SPEC_PAIRS[target]
    ckpt = make_random_checkpoint(d / "target", arch, seed=5, **t_over)
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "drafter.gguf", ckpt, outtype="f32", seed=6, target_gguf=tg, block_size=B,
                                  **{**d_over, **over})
    if request.param == "dspark":
        dg = rewrite_gguf(dg, d / "drafter-scaled.gguf", kv={"dflash.attention.scale": (0.2, GGUFValueType.FLOAT32)})
    return {"target": str(tg), "drafter": str(dg)}


def solo_target(pair):
    return _core.Target(pair["target"], n_ctx=N_CTX, kv_type="f32", max_verify=B, n_threads=2)


def ar_tokens(t, prompt, n):
    t.reset()
    out = [t.decode_greedy(prompt)]
    while len(out) < n:
        out.append(t.decode_greedy([out[-1]]))
    return out


def solo_rounds(pair, prompt, n_rounds):
    t = solo_target(pair)
    s = _core.Spec(t, pair["drafter"], block_size=B, ring_capacity=N_CTX, controller=False)
    last = s.prefill(prompt)
    out = []
    for _ in range(n_rounds):
        r = s.round(last, B)
        out.append((list(r.draft), list(r.committed)))
        last = r.committed[-1]
    return out


@pytest.mark.parametrize("n_seq,seed", [(2, 0), (3, 1)])
def test_concurrent_requests_equal_solo(pair, n_seq, seed):
    check_concurrent_requests(pair, n_seq, seed)


@pytest.mark.parametrize("n_seq,seed", [(3, 2)])
def test_drafter_kinds_batched_equal_solo(kind_pair, n_seq, seed):
    """DFlash 2 and DSpark drafters in the batched drafter pass: the same tokens and rounds as solo."""
    check_concurrent_requests(kind_pair, n_seq, seed)


def check_concurrent_requests(pair, n_seq, seed):
    """n_seq + 2 random requests through a batch engine of n_seq slots, joining at random steps:
    each one's tokens are its AR tokens, its rounds a solo Spec's."""
    rng = np.random.default_rng(seed)
    bt = T.batch_target(pair["target"], n_seq, n_ctx=N_CTX, n_threads=2, kv_type="f32", max_verify=B)
    eng = T.BatchEngine(bt, pair["drafter"], block_size=B, prefill_chunk=int(rng.integers(3, 12)))
    vocab = bt.n_vocab
    # more requests than slots: they queue, join when a slot frees, at random steps
    reqs = [dict(prompt=list(map(int, rng.integers(3, vocab, int(rng.integers(2, 40))))),
                 max_tokens=int(rng.integers(3, 24)), join=int(rng.integers(0, 8))) for _ in range(n_seq + 2)]
    waiting, running, done = list(range(len(reqs))), {}, {}
    step = 0
    widths = []
    while waiting or running:
        for i in list(waiting):
            if reqs[i]["join"] <= step and len(running) < n_seq:
                running[eng.start(reqs[i]["prompt"], reqs[i]["max_tokens"])] = i
                waiting.remove(i)
        before = eng.n_step_tokens
        eng.step()
        widths.append(eng.n_step_tokens - before)
        for slot, i in list(running.items()):
            if eng.finished(slot):
                done[i] = (list(eng.output(slot)), eng.rounds(slot))
                eng.release(slot)
                del running[slot]
        step += 1
        assert step < 500
    assert max(widths) > B  # some steps ran several requests' work in one pass
    ref = solo_target(pair)
    for i, r in enumerate(reqs):
        out, rounds = done[i]
        assert len(out) == r["max_tokens"]
        assert out == ar_tokens(ref, r["prompt"], r["max_tokens"]), f"request {i}: tokens differ from AR"
        got = [(list(d), list(c)) for d, c in rounds]
        assert got == solo_rounds(pair, r["prompt"], len(rounds)), f"request {i}: rounds differ from a solo Spec"


def test_bad_requests(pair):
    bt = T.batch_target(pair["target"], 1, n_ctx=N_CTX, n_threads=2, kv_type="f32", max_verify=B)
    eng = T.BatchEngine(bt, pair["drafter"], block_size=B)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.start([], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.start([bt.n_vocab], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.start([5], 0)
    slot = eng.start([5, 6, 7], 2)
    with pytest.raises(ValueError, match="busy"):
        eng.start([5], 4)
    while eng.step():
        pass
    assert eng.finished(slot) and len(eng.output(slot)) == 2
    with pytest.raises(ValueError, match="block_size"):
        T.BatchEngine(bt, pair["drafter"], block_size=1)
    if "gdn" in bt.layer_types:  # a block longer than the GDN tape
        with pytest.raises(ValueError, match="max_verify"):
            T.BatchEngine(bt, pair["drafter"], block_size=B + 1)
