"""DSpark drafters with a DFlash (Qwen3) backbone: llama.cpp's dflash arch with markov_w1 /
markov_w2 (a low-rank Markov head chaining the block's drafts) and an optional confidence head
(conf_proj), anchor-first (`dflash.sample_from_anchor`, the default: the block is [last, MASK x
(B-2)] and every row drafts) or the 1+N bonus-anchor block of EAGLE-3-style exports.

- Tiny random DSparkDraftModel checkpoints (random_models, kind="dspark") converted by our
  convert_dflash and by llama.cpp's convert_hf_to_gguf.py: the same keys, tensors and bytes.
- Both engines load both files; on the same drafter file, target file and context features our
  drafted block is llama.cpp's Markov-chained block token for token, the biased logits and the
  confidences agree.
- Speculative decoding with them equals AR (greedy and seeded-sampled, chain and tree, with and
  without the controller, which reads the confidence head's probabilities).
- DeepSeek-V4 DSpark files and llama.cpp's d2t reduced vocabulary are refused by name.
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
                              spec_with_context)

BLOCK = 8
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]
# variant -> (anchor-first, confidence head)
VARIANTS = {"anchor_conf": (True, True), "bonus_noconf": (False, False)}


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter):
    d = tmp_path_factory.mktemp("dspark")
    ckpt = make_random_checkpoint(d / "target", "qwen3", seed=5, num_hidden_layers=3)
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    variants = {name: dict(sample_from_anchor=anchor, confidence_head=conf) for name, (anchor, conf) in VARIANTS.items()}
    return {"ckpt": ckpt, "target": tg,
            **both_converters(d, ckpt, tg, variants, llamacpp_converter, kind="dspark", block_size=BLOCK)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converters_write_the_same_file(files, variant):
    anchor, conf = VARIANTS[variant]
    kv_o, t_o = assert_same_files(files[variant, "ours"], files[variant, "llama.cpp"])
    assert kv_o["dflash.sample_from_anchor"] is anchor and kv_o["dflash.has_confidence_head"] is conf
    assert {"markov_w1.weight", "markov_w2.weight"} <= set(t_o)
    assert ("conf_proj.weight" in t_o) is conf and ("conf_proj.bias" in t_o) is conf


def _ours(files, key, n_ctx, seed):
    """Our Spec on the `key` drafter file, with n_ctx random context features in its ring."""
    return spec_with_context(files["target"], files[key], BLOCK, n_ctx, seed)


@pytest.mark.parametrize("which", ["ours", "llama.cpp"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafted_block_is_llama_cpps(files, llama_cpp, variant, which):
    """llama.cpp decodes the block common/speculative.cpp decodes for B - 1 drafts ([last, MASK x
    (B-2)] anchor-first, else [last, MASK x (B-1)]); its drafts are the argmaxes of its (Markov
    biased) logits from the first drafting row. Ours: the same tokens, the same biased logits and,
    with a confidence head, the same confidences (draft_top1's probabilities)."""
    anchor, conf = VARIANTS[variant]
    run = LlamaDrafter(llama_cpp, files["target"], files[variant, which])
    first = 0 if anchor else 1
    try:
        for n_ctx, seed, last in ((5, 0, 17), (12, 1, 250), (1, 2, 3), (20, 3, 99)):
            t, s, feats = _ours(files, (variant, which), n_ctx, seed)
            block = [last] + [s.mask_token_id] * (BLOCK - 1 - (1 - first))
            logits, nextn = run.run(block, feats)
            want = [int(i) for i in logits[first:].argmax(-1)]
            assert s.draft(last, BLOCK) == want, f"n_ctx={n_ctx}"
            ours_logits = _core.testing.draft_logits(s, last, BLOCK, t)
            np.testing.assert_allclose(ours_logits, logits[first:], atol=2e-3, rtol=0)
            drafts, p = _core.testing.draft_top1(s, last, BLOCK)
            assert drafts == want
            if conf:
                np.testing.assert_allclose(p, nextn[first:, 0], atol=1e-4, rtol=0)
                assert 0 < min(p) and max(p) < 1
    finally:
        run.close()


def test_markov_head_changes_the_drafts(files, tmp_path):
    """Zeroing markov_w2 (no bias) changes the drafted block: the head is in the graph."""
    from reference.gguf_edit import rewrite_gguf

    key = ("anchor_conf", "ours")
    plain = rewrite_gguf(files[key], tmp_path / "plain.gguf",
                         tensor_fn=lambda n, a: np.zeros_like(a) if n == "markov_w2.weight" else a)
    files2 = {**files, "plain": plain}
    differ = 0
    for n_ctx, seed, last in ((5, 0, 17), (12, 1, 250), (20, 3, 99)):
        _, s, _ = _ours(files, key, n_ctx, seed)
        _, s2, _ = _ours(files2, "plain", n_ctx, seed)
        differ += s.draft(last, BLOCK) != s2.draft(last, BLOCK)
    assert differ > 0


@pytest.mark.parametrize("verify", ["chain", "tree"])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lossless_greedy(files, variant, verify, gate):
    eng = dn.Engine(files["target"], drafter=files[variant, "ours"], gate=gate, block_size=BLOCK, n_ctx=256,
                    kv_type="f32", n_threads=2, verify=verify, **({"tree_budget": 12} if verify == "tree" else {}))
    ar = eng.generate(PROMPT, max_tokens=48, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=48)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens


@pytest.mark.parametrize("verify", ["chain", "tree"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lossless_sampled(files, variant, verify):
    eng = dn.Engine(files["target"], drafter=files[variant, "ours"], gate=False, block_size=BLOCK, n_ctx=256,
                    kv_type="f32", n_threads=2, verify=verify, **({"tree_budget": 12} if verify == "tree" else {}))
    for seed in (1, 7):
        kw = dict(max_tokens=40, temperature=0.7, top_p=0.95, seed=seed)
        ar = eng.generate(PROMPT, speculative=False, **kw)
        sp = eng.generate(PROMPT, **kw)
        assert sp.stats.rounds > 0 and sp.tokens == ar.tokens


def test_refusals(files, tmp_path):
    from reference.gguf_edit import rewrite_gguf

    t = _core.Target(str(files["target"]), n_ctx=64, kv_type="f32", max_verify=16, n_threads=1)
    src = files["anchor_conf", "ours"]
    dsv4 = rewrite_gguf(src, tmp_path / "dsv4.gguf", kv={"dflash.hyper_connection.count": 4})
    with pytest.raises(ValueError, match="DeepSeek-V4"):
        _core.Spec(t, str(dsv4), block_size=BLOCK)
    d2t = rewrite_gguf(src, tmp_path / "d2t.gguf", add_tensors={"d2t": np.arange(8, dtype=np.float32)})
    with pytest.raises(ValueError, match="d2t"):
        _core.Spec(t, str(d2t), block_size=BLOCK)
    nohead = rewrite_gguf(src, tmp_path / "nohead.gguf", tensor_fn=lambda n, a: None if n == "markov_w1.weight" else a)
    with pytest.raises(ValueError, match="markov_w1"):
        _core.Spec(t, str(nohead), block_size=BLOCK)

    hf = files["anchor_conf", "hf"]
    for edit, msg in (({"markov_head_type": "mlp"}, "markov_head_type"),
                      ({"draft_vocab_size": 100}, "draft_vocab_size"),
                      ({"transformer_layer_config": {}}, "EAGLE-3")):
        cfg = {**json.loads((hf / "config.json").read_text()), **edit}
        bad = tmp_path / f"bad-{msg}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        (bad / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=msg):
            convert_dflash_to_gguf(bad, bad / "x.gguf", target_gguf=files["target"])
