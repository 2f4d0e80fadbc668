"""DFlash 2 drafters (z-lab DFlash2DraftModel; llama.cpp's dflash arch with dflash.conv_* /
selector_* keys, per-layer dynamic convolutions and a top-k pairwise path selector).

- A tiny random DFlash2DraftModel checkpoint (random_models, kind="dflash2") is converted by our
  convert_dflash and by llama.cpp's convert_hf_to_gguf.py (llamacpp_tools): the two files hold the
  same keys, tensors and bytes, but the differences listed.
- Both engines load both files. On the same drafter file, target file and context features (the
  same random features pushed into our ring and injected into llama.cpp's drafter cache), our
  drafted block is llama.cpp's: the selector lattice's candidates and scores agree, and our
  draft() is the path llama.cpp's common/speculative.cpp walks through llama.cpp's lattice.
- Speculative decoding with the drafter equals AR, greedy and seeded-sampled, chain and tree; the
  tree's nodes are the selector's candidates.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from dflash_native.convert_dflash import convert_dflash_to_gguf
from fixtures import make_random_checkpoint
from llamacpp_drafter import (LlamaDrafter, assert_same_files, both_converters, llama_cpp,  # noqa: F401
                              read_gguf, spec_with_context, walk)

BLOCK = 8
TOP_K = 4
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter):
    """A Qwen3 target (F32) and its DFlash 2 drafter, F32, by both converters."""
    d = tmp_path_factory.mktemp("dflash2")
    ckpt = make_random_checkpoint(d / "target", "qwen3", seed=5, num_hidden_layers=3)
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    out = both_converters(d, ckpt, tg, {"d": dict(dflash_config={"selector_top_k": TOP_K})}, llamacpp_converter,
                          kind="dflash2", block_size=BLOCK)
    return {"ckpt": ckpt, "target": tg, "ours": out["d", "ours"], "llama.cpp": out["d", "llama.cpp"],
            "drafter_ckpt": out["d", "hf"], "dir": d}


def test_checkpoint_is_a_dflash2_model(files):
    cfg = json.loads((files["drafter_ckpt"] / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["selector_top_k"] == TOP_K


def test_converters_write_the_same_file(files):
    """Same keys and values (but KEY_DIFFS), same tensor names, types, shapes and bytes; the
    DFlash 2 keys and tensors are there under llama.cpp's names, base kernels in F32."""
    kv, t = assert_same_files(files["ours"], files["llama.cpp"])
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        assert kv[f"dflash.{k}"] > 0
    for name in ("selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight",
                 "blk.0.attn_conv_base", "blk.1.ffn_conv_proj.weight"):
        assert name in t
    assert t["blk.0.attn_conv_base"].tensor_type.name == "F32"


def test_f16_conversion_keeps_base_kernels_f32(files, tmp_path):
    path = convert_dflash_to_gguf(files["drafter_ckpt"], tmp_path / "d16.gguf", outtype="f16",
                                  target_gguf=files["target"])
    _, t = read_gguf(path)
    assert t["blk.1.ffn_conv_base"].tensor_type.name == "F32"
    assert t["selector_successor.weight"].tensor_type.name == "F16"


# ---- llama.cpp's DFlash 2 graph on the same files and context --------------------------------

def _ours(files, which, n_ctx, seed):
    """Our Spec on the `which` drafter file, with n_ctx random context features in its ring."""
    return spec_with_context(files["target"], files[which], BLOCK, n_ctx, seed)


@pytest.mark.parametrize("which", ["ours", "llama.cpp"])
def test_drafted_block_is_llama_cpps(files, llama_cpp, which):
    """Both engines on each converter's file: the lattice's candidate sets and scores agree, and
    our drafted block is the path llama.cpp's walk takes through llama.cpp's lattice, token for
    token, for several contexts and anchors; it is not the per-position argmax (the selector
    matters here)."""
    run = LlamaDrafter(llama_cpp, files["target"], files[which])
    differs = 0
    try:
        assert run.k == TOP_K
        for n_ctx, seed, last in ((5, 0, 17), (12, 1, 250), (1, 2, 3), (20, 3, 99)):
            t, s, feats = _ours(files, which, n_ctx, seed)
            assert s.selector_top_k == TOP_K
            block = [last] + [s.mask_token_id] * (BLOCK - 1)
            want_lat = run.lattice(block, feats)
            ours_lat = _core.testing.draft_lattice(s, last, BLOCK)
            k = TOP_K
            # candidates: the same sets per row (ggml's top_k order may differ on near-equal logits)
            for r in range(BLOCK - 1):
                assert sorted(ours_lat[r, :k]) == sorted(want_lat[r, :k]), f"row {r} candidates"
                # scores keyed by (predecessor token, successor token)
                def table(lat):
                    c = lat[r, :k].astype(int)
                    prev = lat[r - 1, :k].astype(int) if r else None
                    sc = lat[r, k:].reshape(k, k)
                    return {(int(prev[p]) if r else last, int(c[j])): sc[p, j] for p in range(k) for j in range(k)}
                a, b = table(ours_lat), table(want_lat)
                assert a.keys() == b.keys()
                np.testing.assert_allclose([a[x] for x in a], [b[x] for x in a], atol=2e-3, rtol=0)
            want = walk(want_lat, k)
            assert s.draft(last, BLOCK) == want, f"n_ctx={n_ctx}"
            logits = _core.testing.draft_logits(s, last, BLOCK, t)
            differs += want != [int(i) for i in logits.argmax(-1)]
    finally:
        run.close()
    assert differs > 0


def test_parity_bar_catches_a_missing_convolution(files, llama_cpp, tmp_path):
    """The score tolerance above has teeth: llama.cpp's lattice for the same drafter with identity
    convolutions (tap 0 = 1, no dynamic part: what a graph without them computes) is far from
    ours on the real file."""
    from reference.gguf_edit import rewrite_gguf

    def identity(name, a):
        if name.endswith("conv_proj.weight"):
            return np.zeros_like(a)
        if name.endswith("conv_base"):  # numpy [2, K, n_embd]
            b = np.zeros_like(a)
            b[:, 0, :] = 1.0
            return b
        return a

    ident = rewrite_gguf(files["ours"], tmp_path / "identity-conv.gguf", tensor_fn=identity)
    run = LlamaDrafter(llama_cpp, files["target"], ident)
    try:
        _, s, feats = _ours(files, "ours", 5, 0)
        lat = run.lattice([17] + [s.mask_token_id] * (BLOCK - 1), feats)
        assert np.abs(_core.testing.draft_lattice(s, 17, BLOCK)[:, TOP_K:] - lat[:, TOP_K:]).max() > 0.2
    finally:
        run.close()


def test_selector_walk_matches_reference_walk(files):
    """Our walk of our own lattice is walk() above (same tie rule), and its top-1 form (the
    controller's and draft_cutoff's probabilities) keeps the same tokens."""
    t, s, _ = _ours(files, "ours", 6, 4)
    lat = _core.testing.draft_lattice(s, 42, BLOCK)
    assert s.draft(42, BLOCK) == walk(lat, TOP_K)


def test_sampled_drafts_walk_the_selector(files):
    """A sampled round's drafts are drawn along the selector (each row among its candidates, by
    their scores from the previous draw): near T = 0 they are the greedy walk."""
    _, s, _ = _ours(files, "ours", 6, 4)
    greedy = s.draft(42, BLOCK)
    r = s.round(42, BLOCK, sampling=_core.Sampling(temperature=1e-5, seed=3))
    assert r.draft == greedy


# ---- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("verify", ["chain", "tree"])
@pytest.mark.parametrize("gate", [False, True])
def test_lossless_greedy(files, verify, gate):
    eng = dn.Engine(files["target"], drafter=files["ours"], gate=gate, block_size=BLOCK, n_ctx=256, kv_type="f32",
                    n_threads=2, verify=verify, **({"tree_budget": 12} if verify == "tree" else {}))
    ar = eng.generate(PROMPT, max_tokens=48, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=48)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens


@pytest.mark.parametrize("verify", ["chain", "tree"])
@pytest.mark.parametrize("seed", [1, 7])
def test_lossless_sampled(files, verify, seed):
    eng = dn.Engine(files["target"], drafter=files["ours"], gate=False, block_size=BLOCK, n_ctx=256, kv_type="f32",
                    n_threads=2, verify=verify, **({"tree_budget": 12} if verify == "tree" else {}))
    kw = dict(max_tokens=40, temperature=0.7, top_p=0.95, seed=seed)
    ar = eng.generate(PROMPT, speculative=False, **kw)
    sp = eng.generate(PROMPT, **kw)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens


def _tree_on_lattice(r, lat) -> list[int]:
    """Checks that a tree round's nodes at depth d are candidates of lattice row d - 1; returns
    its first path (each node's first child)."""
    depth = [0] * (len(r.draft) + 1)
    for i in range(1, len(depth)):
        depth[i] = depth[r.parents[i]] + 1
        assert r.draft[i - 1] in set(lat[depth[i] - 1, :TOP_K].astype(int))
    chain, node = [], 0
    while True:
        kids = [i for i in range(1, len(depth)) if r.parents[i] == node]
        if not kids:
            return chain
        node = kids[0]
        chain.append(r.draft[node - 1])


def test_tree_nodes_are_selector_candidates(files):
    """A greedy tree round's nodes at depth d are candidates of lattice row d - 1; the first
    path (each node's first child) is the selector's walk."""
    t = _core.Target(str(files["target"]), n_ctx=256, kv_type="f32", max_verify=16, n_threads=2)
    s = _core.Spec(t, str(files["ours"]), block_size=BLOCK, ring_capacity=64, tree_budget=12, controller=False)
    last = s.prefill(PROMPT)
    lat = _core.testing.draft_lattice(s, last, BLOCK)
    s.prefill(PROMPT)
    chain = _tree_on_lattice(s.round_tree(last, BLOCK), lat)
    assert chain == walk(lat, TOP_K)[: len(chain)] and len(chain) >= 2


@pytest.mark.parametrize("seed", [1, 7])
def test_sampled_tree_nodes_are_selector_candidates(files, seed):
    """A sampled tree round's nodes are the selector's candidates too, and its first path is the
    sampled chain round's draft (the same draws along the selector, under the same noise)."""
    t = _core.Target(str(files["target"]), n_ctx=256, kv_type="f32", max_verify=16, n_threads=2)
    s = _core.Spec(t, str(files["ours"]), block_size=BLOCK, ring_capacity=64, tree_budget=12, controller=False)
    sampling = _core.Sampling(temperature=0.7, top_p=0.95, seed=seed)
    last = s.prefill(PROMPT)
    lat = _core.testing.draft_lattice(s, last, BLOCK)
    chain_draft = s.round(last, BLOCK, sampling=sampling).draft
    s.prefill(PROMPT)
    chain = _tree_on_lattice(s.round_tree(last, BLOCK, sampling=sampling), lat)
    assert len(chain) >= 2 and chain == chain_draft[: len(chain)]


# ---- bad input --------------------------------------------------------------------------------

def test_converter_needs_all_dflash2_keys(files, tmp_path):
    cfg = json.loads((files["drafter_ckpt"] / "config.json").read_text())
    del cfg["dflash_config"]["selector_rank"]
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes((files["drafter_ckpt"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="selector_rank"):
        convert_dflash_to_gguf(d, d / "x.gguf", target_gguf=files["target"])


def test_loader_refuses_bad_dflash2_files(files, tmp_path):
    from reference.gguf_edit import rewrite_gguf

    t = _core.Target(str(files["target"]), n_ctx=64, kv_type="f32", max_verify=16, n_threads=1)
    cases = [
        (dict(kv={"dflash.selector_top_k": 0}), "selector_top_k"),
        (dict(kv={"dflash.conv_group_size": 7}), "conv_group_size"),
        (dict(kv={"dflash.selector_top_k": 40}), "selector_top_k"),
    ]
    for i, (edit, msg) in enumerate(cases):
        bad = rewrite_gguf(files["ours"], tmp_path / f"bad{i}.gguf", **edit)
        with pytest.raises(ValueError, match=msg):
            _core.Spec(t, str(bad), block_size=BLOCK)
