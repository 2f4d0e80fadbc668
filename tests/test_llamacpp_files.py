"""GGUFs written by llama.cpp's own tools: its convert_hf_to_gguf.py (from the llama-cpp-python
sdist pip fetches, tests/llamacpp_tools.py) on tiny random HF checkpoints of every target arch,
and its quantizer (llama_model_quantize, through dflash_native.quantize and `dflash-native
quantize`):

- metadata: llama.cpp's file and our converter's file of the same checkpoint hold the same keys,
  values, tensor names, types and shapes, but for the differences listed in EXPECTED_KEY_DIFFS
  (docs/architecture.md, "Files from llama.cpp's converter");
- the same logits: F32 and F16 files of the two converters store the same bytes (but Qwen3.5's
  `ssm_a = -exp(A_log)`, within 1 ulp: torch's F32 exp against ours rounded from float64), so our
  Engine's logits on them are bitwise equal, or within F32 rounding where ssm_a differs;
- Qwen3.5 checkpoints carry an MTP head, which llama.cpp's converter appends as a last block
  (`nextn_predict_layers`): the Engine must not run it;
- quantized by llama.cpp to Q4_0, Q8_0, Q4_K_M, Q5_K_M, Q6_K: our logits and llama.cpp's on the
  same file are within 5x the measured worst case (LLAMA_MEASURED; the helper of
  test_quantized.py), and greedy speculative decoding with llama.cpp's DFlash drafter (its
  converter's DFlashDraftModel, quantized to Q8_0) equals AR bit for bit;
- that drafter is our convert_dflash's, byte for byte;
- `--fuse-qkv` files (one attn_qkv per attention layer) give the unfused file's logits, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

import dflash_native as dn
from dflash_native import _core
from dflash_native.cli import main as cli_main
from dflash_native.convert import convert_hf_to_gguf
from fixtures import TINY_VARIANTS, check_cycled_rounds, cycling_drafts, make_random_checkpoint, make_random_drafter_gguf
from llamacpp_tools import convert_with_llamacpp
from reference.gguf_edit import rewrite_gguf
from test_quantized import check_llama_parity

# fixture arch -> (GGUF arch, checkpoint layout): the Qwen3.5 archs with the MTP head their hub
# checkpoints carry
ARCHS = {"llama": ("llama", "causal_lm"), "qwen3": ("qwen3", "causal_lm"), "qwen3_moe": ("qwen3moe", "causal_lm"),
         "qwen3_5": ("qwen35", "mtp"), "qwen3_5_moe": ("qwen35moe", "mtp")}
# Quantized targets: every matmul row 256 wide or a multiple, so the K-quants really apply.
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
QUANT_MODELS = {
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, **HEADS),
    "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, **HEADS),
}
FUSED_QKV_ARCHS = ["llama", "qwen3", "qwen3_5"]
QUANT_TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}
BLOCK = 8
PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 12)]

# Keys where llama.cpp's file and ours differ, and why (nextn_* / block_count / recurrent_layers:
# only files with an MTP head, checked apart).
EXPECTED_KEY_DIFFS = {
    "general.name": "llama.cpp title-cases the directory name (gguf.Metadata heuristics); ours keeps it",
    "tokenizer.ggml.mask_token_id": "ours: the mask token a DFlash drafter of this target needs (llama.cpp: drafters)",
    "qwen3moe.expert_weights_norm": "ours: HF norm_topk_prob; llama.cpp's qwen3moe graph always renormalises",
}
EXPECTED_DRAFTER_KEY_DIFFS = {
    "general.name": EXPECTED_KEY_DIFFS["general.name"],
    "dflash.attention.causal": "ours states the default (false: no sliding layers) that llama.cpp leaves out",
}


def _fields(path) -> tuple[dict, dict]:
    r = GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter) -> dict:
    """The checkpoints and both converters' files: files[(arch, who, outtype)] for who in
    ("ours", "llama.cpp"), the tiny TINY_VARIANTS shapes; files[(arch, "quant-src")]: llama.cpp's
    F16 file of QUANT_MODELS[arch]; files[(arch, "fused-qkv")]: F32 with --fuse-qkv."""
    d = tmp_path_factory.mktemp("lcfiles")
    out, jobs, ckpts = {}, [], {}
    for arch, (_, layout) in ARCHS.items():
        ckpts[arch] = make_random_checkpoint(d / f"hf-{arch}", arch, seed=0, layout=layout,
                                             **TINY_VARIANTS[arch]["default"])
    for arch, shape in QUANT_MODELS.items():
        ckpts[arch, "q"] = make_random_checkpoint(d / f"hf-{arch}-q", arch, seed=21, layout=ARCHS[arch][1], **shape)
    for arch in ARCHS:
        for outtype in ("f32", "f16"):
            ours = out[arch, "ours", outtype] = convert_hf_to_gguf(ckpts[arch], d / f"ours-{arch}-{outtype}.gguf",
                                                                   outtype=outtype)
            # our converter's name for the fixture tokenizer, which llama.cpp's hash lookup cannot know
            pre = _fields(ours)[0]["tokenizer.ggml.pre"]
            out[arch, "llama.cpp", outtype] = d / f"lc-{arch}-{outtype}.gguf"
            jobs.append(dict(model=ckpts[arch], outfile=out[arch, "llama.cpp", outtype], outtype=outtype,
                             tokenizer_pre=pre))
    for arch in QUANT_MODELS:
        pre = _fields(out[arch, "ours", "f32"])[0]["tokenizer.ggml.pre"]
        out[arch, "quant-src"] = d / f"lc-{arch}-q-f16.gguf"
        jobs.append(dict(model=ckpts[arch, "q"], outfile=out[arch, "quant-src"], outtype="f16", tokenizer_pre=pre))
        # its DFlash drafter, by our convert_dflash and by llama.cpp's converter (DFlashDraftModel)
        out[arch, "drafter", "ours"] = make_random_drafter_gguf(
            d / f"ours-{arch}-drafter.gguf", ckpts[arch, "q"], outtype="f16", seed=22, block_size=BLOCK,
            ckpt_dir=d / f"hf-{arch}-drafter", target_layer_ids=[0], num_hidden_layers=1, intermediate_size=512,
            **HEADS)
        out[arch, "drafter", "llama.cpp"] = d / f"lc-{arch}-drafter.gguf"
        jobs.append(dict(model=d / f"hf-{arch}-drafter", outfile=out[arch, "drafter", "llama.cpp"], outtype="f16",
                         tokenizer_pre=pre, args=["--target-model-dir", str(ckpts[arch, "q"])]))
    for arch in FUSED_QKV_ARCHS:  # the F32 job of arch, with --fuse-qkv
        out[arch, "fused-qkv"] = d / f"lc-{arch}-fused-qkv.gguf"
        jobs.append(dict(jobs[list(ARCHS).index(arch) * 2], outfile=out[arch, "fused-qkv"], args=["--fuse-qkv"]))
    convert_with_llamacpp(llamacpp_converter, jobs)
    out["dir"] = d
    return out


# ---- the two converters ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_metadata_matches_our_converter(files, arch):
    """F16 files: the same keys and values, tensor names, types and shapes, but the listed
    differences; llama.cpp's MTP block is the only extra one."""
    (kv_o, t_o), (kv_l, t_l) = _fields(files[arch, "ours", "f16"]), _fields(files[arch, "llama.cpp", "f16"])
    g = ARCHS[arch][0]
    n_nextn = kv_l.pop(f"{g}.nextn_predict_layers", 0)
    assert n_nextn == (1 if ARCHS[arch][1] == "mtp" else 0)
    assert kv_l[f"{g}.block_count"] == kv_o[f"{g}.block_count"] + n_nextn
    kv_l[f"{g}.block_count"] -= n_nextn
    if f"{g}.attention.recurrent_layers" in kv_l:  # the MTP block is an attention layer
        assert kv_l[f"{g}.attention.recurrent_layers"] == kv_o[f"{g}.attention.recurrent_layers"] + [False] * n_nextn
        kv_l[f"{g}.attention.recurrent_layers"] = kv_o[f"{g}.attention.recurrent_layers"]
    diffs = {k for k in kv_o.keys() | kv_l.keys() if kv_o.get(k, "<absent>") != kv_l.get(k, "<absent>")}
    if n_nextn:  # llama.cpp's size label counts the MTP block's parameters too
        diffs.discard("general.size_label")
    unexpected = {k: (kv_o.get(k, "<absent>"), kv_l.get(k, "<absent>")) for k in diffs - EXPECTED_KEY_DIFFS.keys()}
    assert not unexpected, f"keys that differ (ours, llama.cpp's): {unexpected}"
    assert "general.name" in diffs and "tokenizer.ggml.mask_token_id" in diffs  # the listed reasons still hold

    mtp = {n for n in t_l if n.startswith(f"blk.{kv_o[f'{g}.block_count']}.")}
    nextn = {f"blk.{kv_o[f'{g}.block_count']}.nextn.{n}.weight"
             for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    assert (mtp >= nextn) if n_nextn else not mtp, sorted(mtp)
    assert t_l.keys() - mtp == t_o.keys(), (sorted(t_l.keys() - mtp - t_o.keys()), sorted(t_o.keys() - t_l.keys()))
    for name, t in t_o.items():
        assert (t.tensor_type, list(t.shape)) == (t_l[name].tensor_type, list(t_l[name].shape)), name


@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_same_logits_as_our_converter(files, arch, outtype):
    """The same bytes in every tensor but Qwen3.5's ssm_a (1 ulp at most: torch's F32 exp in
    llama.cpp's converter, float64 rounded once in ours), hence bitwise equal logits, or equal to
    F32 rounding where ssm_a differs. The Engine ignores llama.cpp's MTP block."""
    ours, lc = files[arch, "ours", outtype], files[arch, "llama.cpp", outtype]
    t_o, t_l = _fields(ours)[1], _fields(lc)[1]
    differ = []
    for name, t in t_o.items():
        a, b = np.asarray(t.data), np.asarray(t_l[name].data)
        if a.tobytes() != b.tobytes():
            assert name.endswith("ssm_a") and a.dtype == np.float32, name
            ulp = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))
            assert ulp.max() <= 1, (name, a, b)
            differ.append(name)
    toks = list(range(5, 37))
    got = dn.Engine(lc, n_ctx=64, kv_type="f32", n_threads=2).eval(toks)
    want = dn.Engine(ours, n_ctx=64, kv_type="f32", n_threads=2).eval(toks)
    if not differ:
        np.testing.assert_array_equal(got, want)
    else:
        assert ARCHS[arch][0].startswith("qwen35")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    t = _core.Target(str(lc), n_ctx=64)
    assert t.n_layer == len(t.layer_types) == _fields(ours)[0][f"{ARCHS[arch][0]}.block_count"]


@pytest.mark.parametrize("arch", sorted(QUANT_MODELS))
def test_drafter_matches_our_converter(files, arch):
    """llama.cpp's DFlash converter (DFlashDraftModel, --target-model-dir) and our convert_dflash
    write the same tensors, bytes for bytes, and the same keys but the name and one explicit
    default; the two drafters draft the same tokens."""
    (kv_o, t_o), (kv_l, t_l) = _fields(files[arch, "drafter", "ours"]), _fields(files[arch, "drafter", "llama.cpp"])
    diffs = {k for k in kv_o.keys() | kv_l.keys() if kv_o.get(k, "<absent>") != kv_l.get(k, "<absent>")}
    assert diffs == set(EXPECTED_DRAFTER_KEY_DIFFS), {k: (kv_o.get(k), kv_l.get(k)) for k in diffs}
    assert t_o.keys() == t_l.keys()
    for name, t in t_o.items():
        assert t.tensor_type == t_l[name].tensor_type and list(t.shape) == list(t_l[name].shape), name
        assert np.asarray(t.data).tobytes() == np.asarray(t_l[name].data).tobytes(), name
    target = files[arch, "quant-src"]
    drafts = []
    for who in ("ours", "llama.cpp"):
        t = _core.Target(str(target), n_ctx=64, kv_type="f32", max_verify=BLOCK, n_threads=2)
        s = _core.Spec(t, str(files[arch, "drafter", who]), block_size=BLOCK, ring_capacity=32, window=0)
        drafts.append(_core.testing.draft_logits(s, s.prefill(PROMPT), BLOCK, t))
    np.testing.assert_array_equal(drafts[0], drafts[1])


def test_nextn_layers_must_leave_a_layer(files, tmp_path):
    lc = files["qwen3_5", "llama.cpp", "f32"]
    bad = rewrite_gguf(lc, tmp_path / "bad.gguf", kv={"qwen35.nextn_predict_layers": 5})
    with pytest.raises(ValueError, match="nextn_predict_layers 5 must be less than block_count 5"):
        dn.Engine(bad, n_ctx=64)


@pytest.mark.parametrize("arch", FUSED_QKV_ARCHS)
def test_fused_qkv_gives_the_same_logits(files, arch):
    """`--fuse-qkv` stores one attn_qkv per attention layer: its rows are W_q's, W_k's and W_v's,
    each output the same dot product, so the logits are bitwise those of the unfused file."""
    fused, plain = files[arch, "fused-qkv"], files[arch, "llama.cpp", "f32"]
    t = _fields(fused)[1]
    attn_layer = 1 if arch == "qwen3_5" else 0  # Qwen3.5's layer 0 is a GDN layer (its own attn_qkv)
    assert f"blk.{attn_layer}.attn_qkv.weight" in t and f"blk.{attn_layer}.attn_q.weight" not in t
    toks = list(range(5, 37))
    got = dn.Engine(fused, n_ctx=64, kv_type="f32", n_threads=2).eval(toks)
    np.testing.assert_array_equal(got, dn.Engine(plain, n_ctx=64, kv_type="f32", n_threads=2).eval(toks))
    core = dn.Engine(fused, n_ctx=64, kv_type="f32", n_threads=2)._core  # the batch is the steps, bit for bit
    np.testing.assert_array_equal(np.stack([core.decode([x])[-1] for x in toks[:8]]), got[:8])


def test_fused_qkv_of_the_wrong_size_is_refused(files, tmp_path):
    def fn(name, a):
        return a[:-1] if name == "blk.0.attn_qkv.weight" else a

    bad = rewrite_gguf(files["qwen3", "fused-qkv"], tmp_path / "bad.gguf", tensor_fn=fn)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_qkv\.weight"):
        dn.Engine(bad, n_ctx=64)


# ---- quantized by llama.cpp --------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized(files) -> dict:
    """quantized[(arch, type)]: llama.cpp's F16 file of QUANT_MODELS[arch] through llama.cpp's
    quantizer; quantized[(arch, "drafter")]: llama.cpp's F16 DFlash drafter of it, quantized to Q8_0."""
    out = {}
    for arch in QUANT_MODELS:
        src = files[arch, "quant-src"]
        for t, ggml_type in QUANT_TYPES.items():
            path = dn.quantize(src, files["dir"] / f"{arch}-{t}.gguf", t, n_threads=2, progress=False)
            w = [x.tensor_type.name for x in GGUFReader(path).tensors if x.name.endswith("ffn_up.weight")]
            assert w and set(w) == {ggml_type}, (arch, t, w)
            out[arch, t] = path
        out[arch, "drafter"] = dn.quantize(files[arch, "drafter", "llama.cpp"],
                                           files["dir"] / f"{arch}-drafter-q8_0.gguf", "q8_0", n_threads=2,
                                           progress=False)
    return out


QUANT_CASES = [(a, t) for a in QUANT_MODELS for t in QUANT_TYPES]
# |ours - llama.cpp| on the same file, worst over test_quantized.PARITY_PROMPTS (2026-11-28, AVX-512 CPU, 2
# threads; logits up to ~9): every type here is on the integer path, so most prompts agree to F32 noise (1e-6..6e-6)
# and the worst is a flipped Q8 code (test_quantized.LLAMA_MEASURED); the bar is 5x it.
LLAMA_MEASURED = {
    ("qwen3", "q4_0"): 4.9e-2, ("qwen3", "q8_0"): 1.5e-2, ("qwen3", "q4_k_m"): 2.1e-2, ("qwen3", "q5_k_m"): 1.01e-1,
    ("qwen3", "q6_k"): 4.8e-6, ("qwen3_5", "q4_0"): 8.4e-2, ("qwen3_5", "q8_0"): 5.0e-2, ("qwen3_5", "q4_k_m"): 8.4e-2,
    ("qwen3_5", "q5_k_m"): 7.1e-2, ("qwen3_5", "q6_k"): 6.8e-2,
}


@pytest.mark.parametrize("arch,qtype", QUANT_CASES)
def test_quantized_logits_match_llama_cpp(quantized, arch, qtype, tmp_path, llama_logits):
    check_llama_parity(quantized[arch, qtype], LLAMA_MEASURED[arch, qtype], tmp_path, llama_logits, f"{arch} {qtype}")


# every type on the hybrid; two on Qwen3 (test_quantized.py sweeps the types on our converter's files)
SPEC_CASES = [("qwen3_5", t) for t in QUANT_TYPES] + [("qwen3", "q4_0"), ("qwen3", "q4_k_m")]


@pytest.mark.parametrize("arch,qtype", SPEC_CASES)
def test_quantized_speculative_equals_ar(quantized, arch, qtype):
    """llama.cpp's quantized target with llama.cpp's drafter at Q8_0: greedy speculative output is
    the AR output, with the random drafter's drafts (rarely accepted) and with drafts from the AR
    output whose first miss cycles over the block (every length 1..B committed)."""
    eng = dn.Engine(quantized[arch, qtype], drafter=quantized[arch, "drafter"], block_size=BLOCK,
                    feature_ring_capacity=24, n_ctx=128, kv_type="f32", n_threads=2, gate=False)
    n = 1 + BLOCK * (BLOCK + 1) // 2  # the prefill's token and B rounds of lengths 1..B
    ar = eng.generate(PROMPT, max_tokens=n, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=24)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens[:24]
    eng._draft_override = cycling_drafts(ar.tokens + [0] * BLOCK, every=3)
    forced = eng.generate(PROMPT, max_tokens=n)
    eng._draft_override = None
    assert forced.tokens == ar.tokens
    check_cycled_rounds(forced.stats, BLOCK, 3, complete=len(ar.tokens) == n)


def test_quantize_cli_on_llamacpp_file(files, quantized, tmp_path, capsys):
    """`dflash-native quantize` on llama.cpp's file: the progress bar, and the very file the
    quantizer writes through the API (the same tensors, bytes for bytes)."""
    src, out = files["qwen3_5", "quant-src"], tmp_path / "q.gguf"
    assert cli_main(["quantize", str(src), str(out), "--type", "q4_k_m"]) == 0
    n = len(GGUFReader(src).tensors)
    assert f"[{'#' * 30}] {n}/{n}" in capsys.readouterr().err
    got, want = _fields(out)[1], _fields(quantized["qwen3_5", "q4_k_m"])[1]
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert t.tensor_type == got[name].tensor_type and np.asarray(t.data).tobytes() == np.asarray(
            got[name].data).tobytes(), name
