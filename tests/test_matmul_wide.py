"""The wide Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K GEMM on AVX-512 VNNI or AVX2 (csrc/kernels/cpu/matmul/wide_gemm.h): matmuls of more than
64 columns (prompt chunks), and inside the batch-invariant kernel those from wide_min_cols columns (csrc/kernels/cpu/matmul/matmul.cpp:
12, 14, 16 or 22 on AVX-512 VNNI, 6 or 24 on AVX2; verify passes). test_matmul.test_q8_path_is_the_contract checks both
against an exact emulation of the contract.

- Against float64 over the dequantized weights and the activations quantized as ggml's reference
  quantize_row_q8_0 / q8_K does: exact integer sums, then per block (Q4_K / Q5_K: per superblock,
  scales and mins; Q6_K: per superblock) a scale product and an fma per output, so the error is within a few F32 roundings per
  block of the sum of |terms|; unquantized activations miss that bound.
- Every column is computed alone: its bits do not depend on N, on the other columns, or on how
  the rows are split; a prompt's chunk of at most 64 tokens takes the batch-invariant kernel,
  which gives the same bits.
- NaN / Inf in a column gives NaN in that column only.
- AVX-512 (groups of 16 columns) and AVX2 (groups of 8) compute the same bits.
- In the engine: prompts of more than 64 tokens take it (the graph's node names say so), their
  logits agree with ggml's kernels within the models' own spread and are the same bits under an
  AVX2 cap, and speculative output still equals AR output after such a prefill.
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from fixtures import make_random_checkpoint, make_random_drafter_gguf
from test_matmul import _qcase, _wide_isas, k_quant_mins, q8_activations

TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]

WIDE_ISAS = _wide_isas()
needs_wide = pytest.mark.skipif(not WIDE_ISAS, reason="no AVX2 here: prompt matmuls stay with ggml_mul_mat")


@needs_wide
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M,K,N", [(1, 256, 1), (8, 256, 16), (37, 768, 65), (70, 1024, 100)])
def test_wide_matches_float64(qtype, M, K, N):
    """Q4_0 / Q8_0: the activations as Q8_0, per block an exact sum and one fma (with the scale
    product: blocks + 2 roundings); Q4_K / Q5_K: as Q8_K, per superblock two fmas (scales and mins);
    Q6_K: as Q8_K, per superblock one fma (the codes' offset folded into the exact sum)."""
    raw, values, x = _qcase(qtype, M, K, N, seed=K + N)
    x[0, :32] = 0.0  # an all-zero block
    if N > 3:
        x[3, 5] = 1e4  # one dominant value
    if N > 5:
        # exact ties: a block / superblock whose scale is 1 (max |x| = 127), halves rounded away from
        # zero (Q8_0: roundf) or to even (Q8_K: nearest_int), as test_matmul's integer-path test
        x[5, :256] = np.resize(np.float32([-127, 2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 126.5]), 256)
    kind = "Q8_K" if qtype.endswith("_K") else "Q8_0"
    xq = q8_activations(x, kind)
    ref = xq @ values.astype(np.float64).T
    mag = np.abs(xq) @ (np.abs(values.astype(np.float64)) + 2 * k_quant_mins(raw, qtype)).T
    chain = {"Q4_K": 2 * (K // 256), "Q5_K": 2 * (K // 256), "Q6_K": K // 256}.get(qtype, K // 32)
    bound = (chain + 3) * 2.0**-24 * mag + 1e-30
    for isa in WIDE_ISAS:
        y = _core.testing.matmul_wide(raw, x, qtype, isa)
        assert y.shape == (N, M) and y.dtype == np.float32
        assert (np.abs(y - ref) <= bound).all(), (isa, float((np.abs(y - ref) / bound).max()))
    # the bound is tight enough to see the activations' rounding: F32 activations miss it
    f32 = x.astype(np.float64) @ values.astype(np.float64).T
    assert (np.abs(f32 - ref) > bound).any()


@needs_wide
@pytest.mark.parametrize("qtype", TYPES)
def test_wide_columns_are_independent(qtype):
    """Each column's bits are those of that column alone, for any N (groups of 16 or 8 columns, a
    partial last group) and any row count (tiles of 8 or 4 rows, single-row tails), and the same
    on AVX-512 and AVX2 (the same exact integer block sums and float operations)."""
    M, K = 21, 512
    raw, _, x = _qcase(qtype, M, K, 70, seed=5)
    alone = np.stack([_core.testing.matmul_wide(raw, x[i:i + 1], qtype, WIDE_ISAS[-1])[0] for i in range(70)])
    for isa in WIDE_ISAS:
        for n in (2, 7, 8, 9, 15, 16, 17, 33, 65, 70):
            np.testing.assert_array_equal(_core.testing.matmul_wide(raw, x[:n], qtype, isa), alone[:n],
                                          err_msg=f"{isa} N={n}")
        for m in (1, 3, 4, 5, 7, 8, 9, 16):  # rows are independent too
            np.testing.assert_array_equal(_core.testing.matmul_wide(raw[:m], x, qtype, isa), alone[:, :m],
                                          err_msg=f"{isa} M={m}")


@needs_wide
@pytest.mark.parametrize("qtype", TYPES)
def test_wide_non_finite_stays_in_its_column(qtype):
    raw, _, x = _qcase(qtype, 9, 256, 20, seed=4)
    clean = _core.testing.matmul_wide(raw, x, qtype)
    x[3, 100] = np.nan
    x[17, 7] = np.inf
    for isa in WIDE_ISAS:
        y = _core.testing.matmul_wide(raw, x, qtype, isa)
        assert np.isnan(y[[3, 17]]).all(), isa
        keep = [i for i in range(20) if i not in (3, 17)]
        np.testing.assert_array_equal(y[keep], clean[keep])


def test_wide_bad_input():
    raw, _, x = _qcase("IQ4_XS", 4, 256, 2)
    with pytest.raises(ValueError, match="takes Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K"):
        _core.testing.matmul_wide(raw, x, "iq4_xs")
    raw, _, x = _qcase("Q4_0", 4, 256, 2)
    with pytest.raises(ValueError, match="bytes"):
        _core.testing.matmul_wide(raw[:, :-2].copy(), x, "q4_0")
    with pytest.raises(ValueError, match="runs at 'avx512f' or 'avx2'"):
        _core.testing.matmul_wide(raw, x, "q4_0", "sse2")


@pytest.fixture(scope="module")
def q4_pair(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("wide")
    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    ckpt = make_random_checkpoint(d / "ckpt", "qwen3_5", seed=21, num_hidden_layers=2,
                                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                  linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, **kw)
    tg = convert_hf_to_gguf(ckpt, d / "t-f32.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d-f32.gguf", ckpt, outtype="f32", seed=22, block_size=8, target_gguf=tg,
                                  target_layer_ids=[0], num_hidden_layers=1, **kw)
    out = {}
    for t in ("q4_0", "q8_0", "q4_k_m", "q5_k_m", "q6_k"):
        out[t] = (str(dn.quantize(tg, d / f"t-{t}.gguf", t, n_threads=2, progress=False)),
                  str(dn.quantize(dg, d / f"d-{t}.gguf", t, n_threads=2, progress=False)))
    return out


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_engine_prompts_take_it_and_stay_exact(q4_pair, qtype):
    target, drafter = q4_pair[qtype]
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 500, 150)]
    eng = dn.Engine(target, drafter=drafter, block_size=8, n_ctx=320, n_threads=2, gate=False)
    ref = dn.Engine.for_benchmark(target, matmul="ggml", n_ctx=320, n_threads=2)
    try:
        _core.profile(2)
        ours = eng.eval(prompt)
        rep = _core.profile_report()
        _core.profile(0)
        wide_nodes = sum(c for k, (c, _) in rep.items() if k.endswith("/matmul_wide"))
        if _core.testing.matmul_wide_available():
            assert wide_nodes > 0, sorted(rep)
        else:
            assert wide_nodes == 0
        theirs = ref.eval(prompt)
        # ggml's kernels round the same quantized model differently; this random model's own spread
        # between two kernels is ~1e-3 of its logits' scale
        scale = np.abs(theirs).max()
        assert np.abs(ours - theirs).max() <= 2e-2 * scale, (np.abs(ours - theirs).max(), scale)
        assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.95
        # at every level the GEMM runs (16 or 8 columns), the same logits, bit for bit
        for isa in WIDE_ISAS[1:]:
            dn.set_isa(isa.replace("avx512f", "avx512"))
            try:
                np.testing.assert_array_equal(eng.eval(prompt).view(np.uint32), ours.view(np.uint32), err_msg=isa)
            finally:
                dn.set_isa(None)
        spec = eng.generate(prompt, max_tokens=40)
        ar = eng.generate(prompt, max_tokens=40, speculative=False)
        assert spec.stats.rounds > 0 and spec.tokens == ar.tokens
    finally:
        _core.profile(0)
        eng.close()
        ref.close()
