"""Tensor types and layer mixes: whatever the GGUF format allows either runs, with the right
numbers, or is refused when the Engine is built, with a ValueError naming the file, the tensor
and its type; never SIGABRT / SIGSEGV at the first generate.

- Types: gguf_file.h's tensor_role rule. Norm weights, ssm_a, ssm_dt and ssm_conv1d stored as
  F16 / BF16 / Q8_0 are converted to F32 at load, so a model whose norms are F16 computes
  exactly what its F32 twin with F16-rounded norms computes. Matmul weights and embeddings of
  any type ggml's CPU can multiply run; integer types, F64, Q8_1 and unknown type ids are refused.
- Layer mixes: a Qwen3.5 target with no attention layer, with no GDN layer, or with a single
  block runs, its logits match HF transformers, and speculative decoding commits exactly the AR
  tokens; drafters whose layers all slide run too.

Every engine runs in a child process with a timeout (`isolated`): the failures these tests pin
were aborts and segfaults, which must fail a test, not end the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from dflash_native.convert import convert_hf_to_gguf
from fixtures import make_random_checkpoint, make_random_drafter_gguf
from reference.gguf_edit import rewrite_gguf

TESTS = Path(__file__).resolve().parent
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 12)]


def isolated(fn, *args, timeout: int = 300):
    """fn(*args) (a function of this module, JSON in and out) in a fresh interpreter. A crash or
    a hang fails the calling test with the child's stderr."""
    code = (f"import json, sys; sys.path.insert(0, {str(TESTS)!r}); import test_tensor_types as m; "
            f"print('RESULT:' + json.dumps(m.{fn.__name__}(*json.loads(sys.argv[1]))))")
    p = subprocess.run([sys.executable, "-c", code, json.dumps([str(a) if isinstance(a, Path) else a for a in args])],
                       capture_output=True, text=True, timeout=timeout, cwd=TESTS)
    assert p.returncode == 0, f"{fn.__name__}{args} died with {p.returncode}: {p.stderr[-3000:]}"
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT:")][-1][len("RESULT:"):])


# ---- what the child processes run --------------------------------------------------------

def _load(target: str, drafter: str | None) -> str:
    import dflash_native as dn

    try:
        dn.Engine(target, drafter=drafter, n_ctx=64, n_threads=2)
    except ValueError as e:
        return f"VALUEERROR: {e}"
    return "LOADED"


def _logits(target: str, tokens: list[int]) -> list:
    """Prompt logits, then 4 greedy decode steps' logits (the decode graph, not just the prompt's)."""
    import dflash_native as dn

    core = dn.Engine(target, n_ctx=64, kv_type="f32", n_threads=2)._core
    rows = [core.decode(tokens, all_logits=True)]
    for _ in range(4):
        rows.append(core.decode([int(np.argmax(rows[-1][-1]))]))
    return np.concatenate(rows).tolist()


def _draft_logits(target: str, drafter: str) -> list:
    from dflash_native import _core

    t = _core.Target(target, n_ctx=64, kv_type="f32", max_verify=8, n_threads=2)
    s = _core.Spec(t, drafter, block_size=8, ring_capacity=32, window=0)
    return _core.testing.draft_logits(s, s.prefill(PROMPT), 8, t).tolist()


def _spec_vs_ar(target: str, drafter: str, block_size: int) -> dict:
    """The Engine's AR and speculative tokens; and the greedy continuation `ref` (60 tokens, end of
    text or not) against the stream of rounds whose drafts are `ref` with injected errors (so
    acceptance lengths 1..B occur, each followed by a commit and the drafter's ring push)."""
    import dflash_native as dn
    from dflash_native import _core

    eng = dn.Engine(target, drafter=drafter, block_size=block_size, feature_ring_capacity=24, n_ctx=160,
                    kv_type="f32", n_threads=2)
    ar = eng.generate(PROMPT, max_tokens=60, speculative=False).tokens
    sp = eng.generate(PROMPT, max_tokens=60)

    t = _core.Target(target, n_ctx=160, kv_type="f32", max_verify=16, n_threads=2)
    ref = [int(np.argmax(t.decode(PROMPT)[-1]))]  # greedy, past any end-of-text token
    while len(ref) < 60 + block_size:
        ref.append(int(np.argmax(t.decode([ref[-1]])[-1])))
    t.reset()
    s = _core.Spec(t, drafter, block_size=block_size, ring_capacity=24, window=0)
    rng = np.random.default_rng(block_size)
    forced, lengths = [s.prefill(PROMPT)], []
    while len(forced) < 60:
        good = ref[len(forced): len(forced) + block_size - 1]
        drafts = [tok if rng.random() > 0.2 else (tok + 1) % 500 for tok in good]
        committed = _core.testing.round(s, forced[-1], block_size, drafts).committed
        lengths.append(len(committed))
        forced += committed
    return {"ar": ar, "spec": sp.tokens, "rounds": sp.stats.rounds, "ref": ref[:60], "forced": forced[:60],
            "lengths": lengths}


# ---- building files -----------------------------------------------------------------------

def stored_as(a: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """a (F32, in GGUFReader's array order) as the raw data of qtype, for rewrite_gguf."""
    plain = {Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
    if qtype in plain:
        return a.astype(plain[qtype]), qtype
    if qtype == Q.Q8_K:  # an activation format gguf-py cannot quantize to; the loader must refuse any bytes
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((*a.shape[:-1], a.shape[-1] // block * size), np.uint8), qtype
    return gguf.quants.quantize(a, qtype), qtype


def rounded(a: np.ndarray, qtype: Q) -> np.ndarray:
    """The F32 values a tensor stored as qtype holds."""
    if qtype == Q.F16:
        return a.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).astype(np.float32)


def dequantized(src: Path, dst: Path) -> Path:
    """src with every tensor as F32 holding the values it stores: the reference of a quantized file."""
    types = {t.name: t.tensor_type for t in GGUFReader(src).tensors}

    def fn(name, a):
        qt = types[name]
        return (gguf.quants.dequantize(a, qt).astype(np.float32), Q.F32) if qt != Q.F32 else a

    return rewrite_gguf(src, dst, tensor_fn=fn)


# Tensors the graph reads as F32 (tensor_role F32): norms and the GDN vectors / conv kernel.
F32_ROLE = ("norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight")


def is_f32_role(name: str) -> bool:
    return name.endswith(F32_ROLE)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """An F32 Qwen3.5 target (GDN, attention, GDN, attention) and a drafter tapping layers 0, 2."""
    d = tmp_path_factory.mktemp("types")
    ckpt = make_random_checkpoint(d / "t", "qwen3_5", seed=11)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f32", seed=12, block_size=8, target_gguf=tg,
                                  target_layer_ids=[0, 2])
    return {"dir": d, "target": tg, "drafter": dg}


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3")
    return convert_hf_to_gguf(make_random_checkpoint(d / "t", "qwen3", seed=15), d / "t.gguf", outtype="f32")


def target_of(arch: str, pair: dict, qwen3_target: Path) -> Path:
    return pair["target"] if arch == "qwen35" else qwen3_target


# ---- refused types --------------------------------------------------------------------------

BAD_TARGET_TYPES = [
    ("blk.0.attn_norm.weight", Q.I32),
    ("blk.0.ssm_a", Q.I32),
    ("blk.0.ssm_dt.bias", Q.I8),
    ("blk.0.ssm_conv1d.weight", Q.I16),
    ("blk.1.attn_q_norm.weight", Q.F64),
    ("output_norm.weight", Q.I64),
    ("blk.0.ffn_up.weight", Q.I16),
    ("blk.1.attn_q.weight", Q.F64),
    ("blk.0.ssm_beta.weight", Q.I64),
    ("output.weight", Q.I8),
    ("token_embd.weight", Q.I32),
]


def assert_refused(out: str, path: Path, name: str, qtype: Q) -> None:
    assert out.startswith("VALUEERROR:"), out
    assert f"'{path}'" in out and f"tensor '{name}' has type {qtype.name}".lower() in out.lower(), out


@pytest.mark.parametrize("name,qtype", BAD_TARGET_TYPES, ids=[f"{n}-{q.name}" for n, q in BAD_TARGET_TYPES])
def test_target_tensor_of_unusable_type_is_refused_at_load(pair, tmp_path, name, qtype):
    bad = rewrite_gguf(pair["target"], tmp_path / "bad.gguf",
                       tensor_fn=lambda n, a: stored_as(a, qtype) if n == name else a)
    assert_refused(isolated(_load, bad, None), bad, name, qtype)


@pytest.mark.parametrize("name,qtype", [("blk.1.ffn_norm.weight", Q.I32), ("blk.0.attn_k.weight", Q.I16)],
                         ids=["norm-I32", "matmul-I16"])
def test_qwen3_tensor_of_unusable_type_is_refused_at_load(qwen3_target, tmp_path, name, qtype):
    bad = rewrite_gguf(qwen3_target, tmp_path / "bad.gguf",
                       tensor_fn=lambda n, a: stored_as(a, qtype) if n == name else a)
    assert_refused(isolated(_load, bad, None), bad, name, qtype)


BAD_DRAFTER_TYPES = [
    ("fc.weight", Q.I32),
    ("enc.output_norm.weight", Q.F64),
    ("blk.0.attn_k_norm.weight", Q.I16),
    ("blk.0.attn_v.weight", Q.I8),
    ("blk.0.ffn_down.weight", Q.I32),
]


@pytest.mark.parametrize("name,qtype", BAD_DRAFTER_TYPES, ids=[f"{n}-{q.name}" for n, q in BAD_DRAFTER_TYPES])
def test_drafter_tensor_of_unusable_type_is_refused_at_load(pair, tmp_path, name, qtype):
    bad = rewrite_gguf(pair["drafter"], tmp_path / "bad.gguf",
                       tensor_fn=lambda n, a: stored_as(a, qtype) if n == name else a)
    assert_refused(isolated(_load, pair["target"], bad), bad, name, qtype)


def test_activation_only_type_is_refused_at_load(wide_target, tmp_path):
    """Q8_K (rows of 256) is what ggml quantizes activations to: no CPU dot product takes it as a
    weight. (Q8_1 likewise, but gguf-py's Q8_1 block size disagrees with ggml's: it cannot write one.)"""
    name = "blk.0.ffn_up.weight"
    bad = rewrite_gguf(wide_target, tmp_path / "bad.gguf",
                       tensor_fn=lambda n, a: stored_as(a, Q.Q8_K) if n == name else a)
    assert_refused(isolated(_load, bad, None), bad, name, Q.Q8_K)


@pytest.mark.parametrize("type_id", [4, 31, 43, 1000])
def test_removed_or_unknown_type_id_is_refused_at_load(pair, tmp_path, type_id):
    """Type ids ggml removed (4: Q4_2, 31: Q4_0_4_4) or never had, patched into the header."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(pair["target"].read_bytes())
    r = GGUFReader(bad, "r+")
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    t.field.parts[4][0] = type_id  # the tensor info's type field, in the file's memory map
    r.data.flush()
    del r
    out = isolated(_load, bad, None)
    assert out.startswith("VALUEERROR:") and str(bad) in out, out


# ---- F32-role tensors stored in other types ------------------------------------------------

def f32_role_rewrites(src: Path, d: Path, qtype: Q) -> tuple[Path, Path, int]:
    """src with its F32-role tensors stored as qtype (those whose rows fit qtype's blocks), and
    its reference: the same values, rounded through qtype, stored as F32. Returns both and how
    many tensors changed type."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    pick = lambda n, a: is_f32_role(n) and a.shape[-1] % block == 0  # noqa: E731
    n = sum(pick(t.name, t.data) for t in GGUFReader(src).tensors)
    typed = rewrite_gguf(src, d / f"{qtype.name}.gguf",
                         tensor_fn=lambda nm, a: stored_as(a, qtype) if pick(nm, a) else a)
    ref = rewrite_gguf(src, d / f"{qtype.name}-ref.gguf",
                       tensor_fn=lambda nm, a: rounded(a, qtype) if pick(nm, a) else a)
    return typed, ref, n


@pytest.mark.parametrize("arch,qtype", [("qwen35", Q.F16), ("qwen35", Q.BF16), ("qwen35", Q.Q8_0), ("qwen3", Q.F16)],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_target_f32_role_tensors_in_other_types_give_exact_logits(pair, qwen3_target, tmp_path, arch, qtype):
    """Norms, ssm_a, ssm_dt and ssm_conv1d stored as F16 / BF16 / Q8_0 (where the rows fit its
    blocks) are converted to F32 at load: logits equal, bit for bit, those of the F32 file that
    holds the same rounded values. The rounding itself changes the logits (the check has teeth)."""
    target = target_of(arch, pair, qwen3_target)
    typed, ref, n = f32_role_rewrites(target, tmp_path, qtype)
    assert n >= 4
    got, want = np.array(isolated(_logits, typed, PROMPT)), np.array(isolated(_logits, ref, PROMPT))
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, np.array(isolated(_logits, target, PROMPT)))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_drafter_f32_role_tensors_in_other_types_give_exact_draft_logits(pair, tmp_path, qtype):
    typed, ref, n = f32_role_rewrites(pair["drafter"], tmp_path, qtype)
    assert n >= 6
    got = np.array(isolated(_draft_logits, pair["target"], typed))
    np.testing.assert_array_equal(got, np.array(isolated(_draft_logits, pair["target"], ref)))


# ---- matmul weights and embeddings in every CPU type ---------------------------------------

def matmul_rewrite(src: Path, dst: Path, qtype: Q) -> Path:
    """Every weight that is not F32-role (matmul weights, embeddings, lm_head) stored as qtype."""
    return rewrite_gguf(src, dst, tensor_fn=lambda n, a: a if is_f32_role(n) else stored_as(a, qtype))


def llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    import llama_cpp

    ll = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                         type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        ll.eval(tokens)
        return np.asarray(ll.scores[: len(tokens)], dtype=np.float32).copy()
    finally:
        ll.close()


def check_against_dequantized(path: Path, d: Path) -> str:
    """Ours on a quantized file against ours on its dequantized F32 twin, with llama.cpp's error on
    the same file as the bar: ggml's quantized matmul quantizes the activations (to Q8_0 / Q8_K),
    ours keeps them F32 on its F32 path and quantizes them too on its integer path (Q4_0, Q8_0,
    Q4_K, Q5_K, Q6_K; matmul.h); ours must be about as close to llama.cpp as llama.cpp is to the
    dequantized model, and no further from that model than llama.cpp. (Tighter, per type:
    test_quantized.py.)"""
    ref = np.array(isolated(_logits, dequantized(path, d / "deq.gguf"), PROMPT))[: len(PROMPT)]
    ours = np.array(isolated(_logits, path, PROMPT))[: len(PROMPT)]
    llama = llama_cpp_logits(path, PROMPT)
    err_ours, err_llama, diff = (float(np.abs(x).max()) for x in (ours - ref, llama - ref, ours - llama))
    assert np.isfinite(ours).all()
    # 1.5: a mix of integer-path and F32-path types (an IQ4_XS file with a Q6_K output) lands a
    # little beyond llama.cpp's error of llama.cpp (test_quantized.py measures it per type)
    assert diff <= 1.5 * err_llama + 1e-3, (diff, err_llama)
    assert err_ours <= 1.5 * err_llama + 1e-3, (err_ours, err_llama)
    return (f"|ours - dequantized| {err_ours:.2e}, |llama.cpp - dequantized| {err_llama:.2e}, "
            f"|ours - llama.cpp| {diff:.2e}")


def test_f16_matmul_weights_are_exact(pair, tmp_path):
    """F16 matmul weights and embeddings run the package's own kernel (F16 -> F32 is exact): bit
    for bit the logits of the F32 file holding the F16-rounded values."""
    typed = matmul_rewrite(pair["target"], tmp_path / "f16.gguf", Q.F16)
    got = np.array(isolated(_logits, typed, PROMPT))
    np.testing.assert_array_equal(got, np.array(isolated(_logits, dequantized(typed, tmp_path / "deq.gguf"), PROMPT)))


@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4], ids=lambda q: q.name)
def test_matmul_weights_in_block_32_types(pair, tmp_path, qtype):
    typed = matmul_rewrite(pair["target"], tmp_path / "typed.gguf", qtype)
    print(qtype.name, check_against_dequantized(typed, tmp_path))


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory) -> Path:
    """Rows of 256 (hidden 256, FFN 512) for the K-, IQ- and TQ-quants' 256-element blocks."""
    d = tmp_path_factory.mktemp("wide")
    ckpt = make_random_checkpoint(d / "t", "qwen3_5", seed=13, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q2_K", "Q5_K_S", "IQ4_XS", "TQ2_0"])
def test_matmul_weights_quantized_by_llama_cpp(wide_target, tmp_path, ftype):
    """Files quantized by llama.cpp's own quantizer, the mixes real checkpoints ship as (rows that
    do not fit 256-blocks fall back to other types): Q2_K .. Q6_K, IQ4_XS / IQ4_NL, TQ2_0, Q4_0 .. Q5_1."""
    import ctypes

    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = 2
    out = tmp_path / f"{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(wide_target).encode(), str(out).encode(), ctypes.byref(p)) == 0
    types = {t.tensor_type.name for t in GGUFReader(out).tensors}
    assert len(types - {"F32", "F16", "Q5_0", "Q8_0"}) > 0, types  # the family asked for is in there
    print(ftype, sorted(types), check_against_dequantized(out, tmp_path))


# ---- layer mixes ------------------------------------------------------------------------------

LIN, FULL = "linear_attention", "full_attention"
LAYER_MIXES = {
    "all-gdn": [LIN, LIN, LIN],
    "all-attention": [FULL, FULL, FULL],
    "one-gdn-block": [LIN],
    "one-attention-block": [FULL],
}


@pytest.fixture(scope="module", params=sorted(LAYER_MIXES))
def mix(request, tmp_path_factory) -> dict:
    """A Qwen3.5 target of the layer mix and a drafter tapping layer 0 (and 1 where there is one).
    The converter refuses taps on a target's last layer (HF gives that one after the final norm),
    so the drafter is converted against a sibling target one block deeper with the same shapes;
    its GGUF target_layers (tap + 1) then fit the target itself."""
    types = LAYER_MIXES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    ckpt = make_random_checkpoint(d / "t", "qwen3_5", seed=21, num_hidden_layers=len(types), layer_types=types)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    deeper = types + types[-1:]
    sib = make_random_checkpoint(d / "s", "qwen3_5", seed=21, num_hidden_layers=len(deeper), layer_types=deeper)
    sg = convert_hf_to_gguf(sib, d / "s.gguf", outtype="f32")
    taps = [0, 1] if len(types) > 1 else [0]
    dg = make_random_drafter_gguf(d / "d.gguf", sib, outtype="f32", seed=22, block_size=8, target_gguf=sg,
                                  target_layer_ids=taps)
    return {"name": request.param, "ckpt": ckpt, "target": tg, "drafter": dg}


def test_layer_mix_logits_match_hf(mix):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ours = np.array(isolated(_logits, mix["target"], PROMPT))[: len(PROMPT)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(mix["ckpt"]), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        # no cache: transformers' hybrid cache needs an attention layer to count the sequence
        ref = hf(torch.tensor([PROMPT]), use_cache=False).logits[0].float().numpy()
    diff = float(np.abs(ours - ref).max())
    print(f"{mix['name']}: max |ours - HF| = {diff:.2e}")
    assert diff < 2e-3  # test_engine.TOL_HF_F32: HF and ggml sum in different orders


@pytest.mark.parametrize("block_size", [2, 8])
def test_layer_mix_speculative_equals_ar(mix, block_size):
    """F32 weights and the package's own kernels: speculative output is AR output token for
    token, and so is a stream of forced rounds that accept 1..B tokens."""
    r = isolated(_spec_vs_ar, mix["target"], mix["drafter"], block_size)
    assert r["rounds"] > 0
    assert r["spec"] == r["ar"]
    assert r["forced"] == r["ref"]
    assert block_size == 2 or len(set(r["lengths"])) > 2, r["lengths"]


def test_drafter_whose_layers_all_slide(pair, tmp_path):
    """A drafter with a sliding window on every layer reads no full-attention mask (and the
    scheduler gives that input no buffer): it drafts, and speculative output is AR output."""
    dg = make_random_drafter_gguf(tmp_path / "swa.gguf", pair["dir"] / "t", outtype="f32", seed=14, block_size=8,
                                  target_gguf=pair["target"], target_layer_ids=[0, 2], num_hidden_layers=2,
                                  use_sliding_window=True, sliding_window=5, layer_types=["sliding_attention"] * 2)
    r = isolated(_spec_vs_ar, pair["target"], dg, 8)
    assert r["spec"] == r["ar"] and r["forced"] == r["ref"]
