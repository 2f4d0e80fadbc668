"""The per-layer options of llama.cpp's dflash file format that the drafter implements beyond the
plain DFlash graph, each against llama.cpp on the same files (both converters' files, same
context features): partial RoPE (`rope.dimension_count`), the attention value scale
(`attention.value_scale`), the q.k scale (`attention.scale`), and the drafter's own embeddings
serving as its head (no output.weight: llama.cpp's TENSOR_DUPLICATED). What the loader refuses by
name instead: a GELU activation, M-RoPE sections beyond the temporal one, and the tensors it does
not implement (post-norms, output scales, attention sinks, rope_freqs, matmul scales)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from fixtures import make_random_checkpoint
from llamacpp_drafter import LlamaDrafter, assert_same_files, both_converters, llama_cpp  # noqa: F401

BLOCK = 8
CASES = {
    "partial_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "partial_rotary_factor": 0.5}),
    "value_scale": dict(dflash_config={"attention_value_scale": 0.5}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter):
    d = tmp_path_factory.mktemp("options")
    ckpt = make_random_checkpoint(d / "target", "qwen3", seed=5, num_hidden_layers=3)
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    return {"target": tg, "dir": d, **both_converters(d, ckpt, tg, CASES, llamacpp_converter, block_size=BLOCK)}


def _parity(llama_cpp, target, drafter, seeds=((5, 0, 17), (12, 1, 250))):
    """Our draft logits and drafts against llama.cpp's on the same random context features."""
    run = LlamaDrafter(llama_cpp, target, drafter)
    try:
        for n_ctx, seed, last in seeds:
            t = _core.Target(str(target), n_ctx=256, kv_type="f32", max_verify=16, n_threads=2)
            s = _core.Spec(t, str(drafter), block_size=BLOCK, ring_capacity=64)
            feats = np.random.default_rng(seed).standard_normal((n_ctx, len(s.tap_layers), t.n_embd)).astype(np.float32)
            t.decode(list(range(3, 3 + n_ctx)))
            _core.testing.push_features(s, feats, 0)
            logits, _ = run.run([last] + [s.mask_token_id] * (BLOCK - 1), feats.reshape(n_ctx, -1))
            ours = _core.testing.draft_logits(s, last, BLOCK, t)
            np.testing.assert_allclose(ours, logits[1:], atol=2e-3, rtol=0)
            assert s.draft(last, BLOCK) == [int(i) for i in logits[1:].argmax(-1)]
    finally:
        run.close()


@pytest.mark.parametrize("case", list(CASES))
def test_converters_agree(files, case):
    kv, _ = assert_same_files(files[case, "ours"], files[case, "llama.cpp"])
    assert {"partial_rope": "dflash.rope.dimension_count", "value_scale": "dflash.attention.value_scale"}[case] in kv


@pytest.mark.parametrize("which", ["ours", "llama.cpp"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_llama_cpp(files, llama_cpp, case, which):
    _parity(llama_cpp, files["target"], files[case, which])


def test_option_changes_the_logits(files):
    """Each option moves our logits (so the parity above would catch it being ignored): the same
    file with the key removed drafts other logits."""
    from reference.gguf_edit import rewrite_gguf

    for case, key in (("partial_rope", "dflash.rope.dimension_count"), ("value_scale", "dflash.attention.value_scale")):
        plain = rewrite_gguf(files[case, "ours"], files["dir"] / f"{case}-plain.gguf", drop_keys=(key,))
        out = []
        for path in (files[case, "ours"], plain):
            t = _core.Target(str(files["target"]), n_ctx=64, kv_type="f32", max_verify=16, n_threads=2)
            s = _core.Spec(t, str(path), block_size=BLOCK, ring_capacity=32)
            t.decode([3, 4, 5, 6])
            _core.testing.push_features(s, np.random.default_rng(0).standard_normal((4, len(s.tap_layers), t.n_embd))
                            .astype(np.float32), 0)
            out.append(_core.testing.draft_logits(s, 17, BLOCK, t))
        assert np.abs(out[0] - out[1]).max() > 0.05, case


def test_attention_scale_and_own_embeddings(files, llama_cpp, tmp_path):
    """dflash.attention.scale replaces 1/sqrt(head_dim); a drafter with its own token_embd and no
    output.weight uses token_embd as its head, as llama.cpp does: both against llama.cpp on the
    same edited file."""
    from reference.gguf_edit import rewrite_gguf

    base = files["value_scale", "ours"]
    scaled = rewrite_gguf(base, tmp_path / "scale.gguf", kv={"dflash.attention.scale": (0.05, _f32())})
    _parity(llama_cpp, files["target"], scaled, seeds=((6, 2, 40),))
    t = _core.Target(str(files["target"]), n_ctx=16, n_threads=1)
    t_emb = np.random.default_rng(9).standard_normal((t.n_vocab, t.n_embd)).astype(np.float32)
    own = rewrite_gguf(base, tmp_path / "own.gguf", add_tensors={"token_embd.weight": t_emb})
    _parity(llama_cpp, files["target"], own, seeds=((6, 2, 40),))


def _f32():
    from gguf import GGUFValueType

    return GGUFValueType.FLOAT32


def test_refused_by_name(files, tmp_path):
    from gguf import GGUFValueType

    from reference.gguf_edit import rewrite_gguf

    base = files["value_scale", "ours"]
    t = _core.Target(str(files["target"]), n_ctx=64, kv_type="f32", max_verify=16, n_threads=1)
    cases = [
        (dict(kv={"dflash.hidden_activation": ("gelu", GGUFValueType.STRING)}), "hidden_activation"),
        (dict(add_tensors={"blk.0.post_attention_norm.weight": np.ones(64, np.float32)}), "post_attention_norm"),
        (dict(add_tensors={"blk.1.attn_sinks.weight": np.zeros(4, np.float32)}), "attn_sinks"),
        (dict(add_tensors={"rope_freqs.weight": np.ones(8, np.float32)}), "rope_freqs"),
        (dict(add_tensors={"fc.scale": np.ones(1, np.float32)}), "fc.scale"),
    ]
    for i, (edit, msg) in enumerate(cases):
        bad = rewrite_gguf(base, tmp_path / f"bad{i}.gguf", **edit)
        with pytest.raises(ValueError, match=msg):
            _core.Spec(t, str(bad), block_size=BLOCK)
