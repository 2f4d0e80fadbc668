"""The engine's own CPU matmul (csrc/kernels/cpu/matmul/matmul.h) and top-1 op (csrc/kernels/cpu/top1.h).

The matmul's contract is batch invariance: every output's bits are the same whatever the number
of columns, the tile, the thread split and the instruction set. The engine-level consequence is
checked in test_engine.py (test_batch_equals_single_steps, matmul='own'): a batch of tokens gives
bit-identical logits and caches to one-token steps, so a verify pass computes exactly what AR
decoding computes."""
from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core

ISAS = _core.testing.matmul_isas()


def _case(M, K, N, dtype, seed=0):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((M, K)).astype(dtype)
    x = rng.standard_normal((N, K)).astype(np.float32)
    return W, x


def test_isas_listed():
    assert _core.testing.matmul_isa() == ISAS[0]
    assert ISAS[-1] == "portable"
    assert set(ISAS) <= {"avx512f", "avx2", "portable"}


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("M,K", [(1, 5), (3, 16), (25, 37), (320, 320), (47, 896)])
def test_matches_float64(dtype, M, K):
    W, x = _case(M, K, 11, dtype)
    ref = x.astype(np.float64) @ W.astype(np.float64).T
    for isa in ISAS:
        y = _core.testing.matmul(W, x, isa)
        assert y.shape == (11, M) and y.dtype == np.float32
        # F32 accumulation of K products: a few ulps of the terms' magnitudes
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.sqrt(K) * np.abs(ref).max() + 1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("M,K", [(29, 37), (320, 320), (100, 896)])
def test_batch_invariant_bitwise(dtype, M, K):
    """Any number of columns, any instruction set, any thread split: the same bits."""
    W, x = _case(M, K, 17, dtype, seed=1)
    full = _core.testing.matmul(W, x, ISAS[-1])
    for isa in ISAS:
        for n in range(1, 18):
            np.testing.assert_array_equal(_core.testing.matmul(W, x[:n], isa), full[:n], err_msg=f"{isa} N={n}")
        for i in (0, 7, 16):  # one column alone, as an AR step computes it
            np.testing.assert_array_equal(_core.testing.matmul(W, x[i:i + 1], isa)[0], full[i])
        for nt in (2, 3):
            np.testing.assert_array_equal(_core.testing.matmul(W, x, isa, nt), full)


# Every weight type the kernel takes besides F16/F32, each at a K its blocks divide.
QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "BF16"]


def _qcase(qtype: str, M: int, K: int, N: int, seed: int = 0):
    """(raw rows uint8 [M, row bytes], the F32 values they hold [M, K], x [N, K]): rows quantized by
    ggml's quantizer, dequantized by gguf-py (a second implementation of the format)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from reference.ggml_quant import ggml_quantize

    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((M, K)) * rng.uniform(0.2, 3.0, (M, 1))).astype(np.float32)
    q = Q[qtype]
    raw = gguf.quants.quantize(W, q).view(np.uint8).reshape(M, -1) if q == Q.BF16 else ggml_quantize(W, q)
    values = gguf.quants.dequantize(raw, q).astype(np.float32).reshape(M, K)
    return raw, values, rng.standard_normal((N, K)).astype(np.float32)


# The types on the integer path (activations quantized to Q8_0 / Q8_K, integer block dots).
Q8_TYPES = {"Q4_0": "Q8_0", "Q8_0": "Q8_0", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K"}


def q8_activations(x: np.ndarray, kind: str) -> np.ndarray:
    """x [N, K] F32 quantized as ggml's reference quantizers do (quantize_row_q8_0_ref /
    quantize_row_q8_K_ref: tests/reference/q8_matmul_ref.py), returned as the values they stand for
    (code * scale, float64)."""
    from reference import q8_matmul_ref

    N, K = x.shape
    q, d = q8_matmul_ref.q8_0_acts(x) if kind == "Q8_0" else q8_matmul_ref.q8_K_acts(x)
    assert np.abs(q).max() <= 127
    block = K // d.shape[1]
    return (q.reshape(N, -1, block) * d.astype(np.float64)[..., None]).reshape(N, K)


def k_quant_mins(raw: np.ndarray, qtype: str) -> np.ndarray:
    """|dmin * m_j| of each weight's 32-value sub-block (Q4_K / Q5_K; 0 for other types): the
    term that w = d sc q - dmin m subtracts, which cancellation can leave larger than |w|."""
    from reference import q8_matmul_ref

    M = raw.shape[0]
    if qtype not in ("Q4_K", "Q5_K"):
        return np.zeros((M, 1))
    _, _, mn, _, dmin = q8_matmul_ref.decode_k_quant(raw, qtype)  # mins [M, nsb, 8], dmin [M, nsb]
    return np.repeat(np.abs(dmin.astype(np.float64)[..., None] * mn).reshape(M, -1), 32, axis=1)


def q8_bound(qtype: str, K: int, mag: np.ndarray) -> np.ndarray:
    """The integer path's F32 rounding bound (test_q8_path_matches_float64) for the sums of |terms| mag."""
    chain = K // 32 if Q8_TYPES[qtype] == "Q8_0" else (1 if qtype == "Q6_K" else 2) * K // 256
    return (1 + chain) * 2.0**-24 * mag + 1e-30


@pytest.mark.parametrize("qtype", sorted(Q8_TYPES))
@pytest.mark.parametrize("M,K", [(1, 256), (29, 512), (70, 768), (33, 2560)])
def test_q8_path_matches_float64(qtype, M, K):
    """The integer path against float64: weights dequantized (gguf-py), activations quantized to
    Q8_0 / Q8_K as specified (an independent numpy quantizer), dot in float64. The integer block
    sums are exact; what is left is F32 rounding, each at most u = 2^-24 of a partial sum bounded by
    the sum of |terms|: the scale products (1) and the one fmaf chain per output (one step per Q8_0
    block, two per Q4_K / Q5_K superblock: S and M, one for Q6_K; a K-quant's S above 2^24 also
    rounds in its conversion, within the same u of the partial sum). Unquantized activations (the
    F32 path) miss the bar by orders of magnitude."""
    raw, values, x = _qcase(qtype, M, K, 11)
    x[3, :32] = 0.0    # an all-zero block (and superblock part)
    x[4, 40] = 1e4     # one dominant value
    # exact ties: a block / superblock whose scale is 1 (max |x| = 127), halves rounded away from
    # zero (Q8_0: roundf) or to even (Q8_K: nearest_int)
    x[5, :256] = np.resize(np.float32([-127, 2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 126.5]), 256)
    xq = q8_activations(x, Q8_TYPES[qtype])
    ref = xq @ values.astype(np.float64).T
    # the sum of |terms| per output (a K-quant weight's terms: d sc q and dmin m)
    mag = np.abs(xq) @ (np.abs(values.astype(np.float64)) + 2 * k_quant_mins(raw, qtype)).T
    bound = q8_bound(qtype, K, mag)
    for isa in ISAS:
        y = _core.testing.matmul(raw, x, isa, 1, qtype)
        assert y.shape == (11, M) and y.dtype == np.float32
        assert (np.abs(y - ref) <= bound).all(), (isa, float((np.abs(y - ref) / bound).max()))
    f32 = _core.testing.matmul(raw, x, "", 1, qtype, f32_path=True)
    assert (np.abs(f32 - ref) > bound).any()


def _wide_isas() -> list[str]:
    """The levels the GEMM of wide_gemm.h runs at on this CPU: "avx512f" (VNNI), "avx2"."""
    raw, _, x = _qcase("Q4_0", 1, 32, 1)
    out = []
    for isa in ("avx512f", "avx2"):
        try:
            _core.testing.matmul_wide(raw, x, "q4_0", isa)
            out.append(isa)
        except ValueError:  # the level is not on this CPU (the message says so)
            pass
    return out


@pytest.mark.parametrize("qtype", sorted(Q8_TYPES))
def test_q8_path_is_the_contract(qtype):
    """Every output of the integer path, on every ISA (AVX-512 with and without VNNI), at 1, 3, 19
    and 24 columns (from 12 / 14 / 16 / 22 columns on AVX-512 VNNI and 6 / 24 on AVX2 the op runs the GEMM of
    wide_gemm.h, also called directly here), with 1 and 2 threads, has the bits of an exact
    emulation of matmul.h's operations (tests/reference/q8_matmul_ref.py: integer block sums, each
    F32 product, conversion and fmaf rounded exactly, in the contract's order): the contract itself,
    not only agreement between paths. 21 rows: partial tiles of 16 rows; an all-zero block and
    superblock (scale 0), a dominant value, exact rounding ties."""
    from reference import q8_matmul_ref

    kquant = Q8_TYPES[qtype] == "Q8_K"
    raw, _, x = _qcase(qtype, 21, 1024 if kquant else 768, 24, seed=5)
    x[2, :256 if kquant else 32] = 0.0
    x[4, 40] = 1e4
    x[5, :256] = np.resize(np.float32([-127, 2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 126.5]), 256)
    ref = q8_matmul_ref.matmul(raw, qtype, x).view(np.uint32)
    for isa in ISAS + (["avx512f-novnni"] if "avx512f" in ISAS else []):
        for n, nt in ((1, 1), (3, 2), (19, 1), (24, 2)):
            np.testing.assert_array_equal(_core.testing.matmul(raw, x[:n], isa, nt, qtype).view(np.uint32), ref[:n],
                                          err_msg=f"{qtype} {isa} N={n} threads={nt}")
    for isa in _wide_isas():
        np.testing.assert_array_equal(_core.testing.matmul_wide(raw, x, qtype.lower(), isa).view(np.uint32), ref,
                                      err_msg=f"{qtype} wide {isa}")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M,K", [(1, 256), (29, 512), (70, 768)])
def test_quantized_matches_float64(qtype, M, K):
    """The F32 path on quantized rows against a float64 dot over the dequantized values. The
    activations stay F32 (no Q8 rounding as in ggml), so the tolerance is the F32 path's (the
    integer-path types taken through the F32 path: f32_path)."""
    raw, values, x = _qcase(qtype, M, K, 11)
    ref = x.astype(np.float64) @ values.astype(np.float64).T
    for isa in ISAS:
        y = _core.testing.matmul(raw, x, isa, 1, qtype, f32_path=qtype in Q8_TYPES)
        assert y.shape == (11, M) and y.dtype == np.float32
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.sqrt(K) * np.abs(ref).max() + 1e-6, err_msg=isa)


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_batch_invariant_bitwise(qtype):
    """Batch sizes 2..64 (every one for the integer path), every ISA, 1..3 threads: each column's
    bits are those of that column alone on the portable path (the AR step's computation, whatever
    the ISA)."""
    M, K = 37, 512
    raw, values, x = _qcase(qtype, M, K, 64, seed=1)
    cols = np.stack([_core.testing.matmul(raw, x[i:i + 1], ISAS[-1], 1, qtype)[0] for i in range(64)])
    sizes = range(1, 65) if qtype in Q8_TYPES else [2, 3, 5, 8, 9, 16, 17, 24, 31, 32, 33, 48, 63, 64]
    for isa in ISAS:
        for n in sizes:
            for nt in (1, 2, 3):
                np.testing.assert_array_equal(_core.testing.matmul(raw, x[:n], isa, nt, qtype), cols[:n],
                                              err_msg=f"{qtype} {isa} N={n} threads={nt}")
        np.testing.assert_array_equal(_core.testing.matmul(raw, x[5:6], isa, 2, qtype)[0], cols[5])


@pytest.mark.parametrize("qtype", ["F16", "F32", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_wide_batches_bitwise(qtype):
    """Past k_matmul_max_cols too (a batched pass of many requests' steps takes the kernel at any
    width: build_context::any_width): 65..256 columns give each column the bits it has alone."""
    M, K = 29, 256
    if qtype in ("F16", "F32"):
        W, x = _case(M, K, 256, np.float16 if qtype == "F16" else np.float32, seed=3)
        mm = lambda xs, isa, nt=1: _core.testing.matmul(W, xs, isa, nt)  # noqa: E731
    else:
        raw, _, x = _qcase(qtype, M, K, 256, seed=3)
        mm = lambda xs, isa, nt=1: _core.testing.matmul(raw, xs, isa, nt, qtype)  # noqa: E731
    cols = np.stack([mm(x[i:i + 1], ISAS[-1])[0] for i in range(256)])
    for isa in ISAS:
        for n in (65, 100, 128, 256):
            np.testing.assert_array_equal(mm(x[:n], isa, 2), cols[:n], err_msg=f"{qtype} {isa} N={n}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("K", [32, 96, 800, 1024])
def test_q8_0_block_counts_bitwise(qtype, K):
    """Q8_0-kind rows of any block count and every tile (AVX-512 and AVX2: 16 rows in the lanes, up
    to 16 columns per pass over their blocks; 21 rows: a partial tile; from 16 (Q8_0 22) columns on
    AVX-512 VNNI, 6 (Q8_0 24) on AVX2: the GEMM of wide_gemm.h): every ISA (AVX-512 with and without VNNI), thread split and batch size
    gives the portable path's single-column bits."""
    raw, _, x = _qcase(qtype, 21, K, 24, seed=K)
    cols = np.stack([_core.testing.matmul(raw, x[i:i + 1], ISAS[-1], 1, qtype)[0] for i in range(24)])
    for isa in ISAS + (["avx512f-novnni"] if "avx512f" in ISAS else []):
        for n, nt in ((1, 1), (1, 2), (2, 1), (3, 2), (4, 1), (5, 1), (8, 2), (9, 1), (10, 1), (14, 2), (16, 1), (17, 2), (19, 2), (22, 1), (24, 1)):
            np.testing.assert_array_equal(_core.testing.matmul(raw, x[:n], isa, nt, qtype), cols[:n],
                                          err_msg=f"{isa} N={n} threads={nt}")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("M,K", [(1, 256), (7, 2560), (35, 768)])
def test_k_quant_tiles_bitwise(qtype, M, K):
    """The K-quant tiles (AVX-512BW, with and without VNNI: 2 rows x 1 column for one column, else
    16 rows in the lanes x 2-13 columns in one pass, 8 and 4 at a time past that; AVX2: 2 x 1 and 1 x 4 in blocks of 16 rows; 64 codes per
    vector on AVX-512BW, 32 on AVX2; 12 (Q6_K 14) / 6 columns and more: the GEMM of wide_gemm.h): row counts
    that are not a multiple of a tile, column counts with every remainder, 1 and 2 threads, every
    ISA -- each output has the bits of the portable path's single-column result, which is within
    the float64 bound of test_q8_path_matches_float64 (here over 1..10 superblocks)."""
    raw, values, x = _qcase(qtype, M, K, 13, seed=M + K)
    cols = np.stack([_core.testing.matmul(raw, x[i:i + 1], ISAS[-1], 1, qtype)[0] for i in range(13)])
    xq = q8_activations(x, "Q8_K")
    ref = xq @ values.astype(np.float64).T
    mag = np.abs(xq) @ (np.abs(values.astype(np.float64)) + 2 * k_quant_mins(raw, qtype)).T
    assert (np.abs(cols - ref) <= q8_bound(qtype, K, mag)).all()
    for isa in ISAS + (["avx512f-novnni"] if "avx512f" in ISAS else []):
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13):
            for nt in (1, 2):
                np.testing.assert_array_equal(_core.testing.matmul(raw, x[:n], isa, nt, qtype), cols[:n],
                                              err_msg=f"{qtype} {isa} M={M} K={K} N={n} threads={nt}")


@pytest.mark.parametrize("qtype", sorted(Q8_TYPES))
def test_ggml_vec_dot_agrees(qtype):
    """_core.testing.ggml_vec_dot (ggml's one-column CPU dot, the benchmarks' reference) computes the
    same matmul: within the activations' Q8 rounding of the own kernel (ggml's x86 quantizers may
    round a code differently from the reference one)."""
    raw, values, x = _qcase(qtype, 19, 512, 3, seed=2)
    ours = _core.testing.matmul(raw, x, "", 1, qtype)
    theirs = _core.testing.ggml_vec_dot(raw, x, qtype)
    assert theirs.shape == ours.shape and theirs.dtype == np.float32
    mag = np.abs(x.astype(np.float64)) @ np.abs(values.astype(np.float64)).T
    np.testing.assert_array_less(np.abs(theirs - ours), 2e-2 * mag / np.sqrt(512) + 1e-6)
    with pytest.raises(ValueError, match="ggml_vec_dot"):
        _core.testing.ggml_vec_dot(raw[:, :-1], x, qtype)


@pytest.mark.parametrize("qtype", sorted(Q8_TYPES))
def test_q8_path_non_finite_propagates(qtype):
    """A NaN or Inf activation makes its column's outputs NaN (as on the F32 path, so the engine's
    non-finite-logits check still raises); the other columns keep their bits."""
    raw, _, x = _qcase(qtype, 9, 512, 3, seed=4)
    clean = _core.testing.matmul(raw, x, "", 1, qtype)
    x[1, 300] = np.nan
    x[2, 7] = np.inf
    for isa in ISAS:
        y = _core.testing.matmul(raw, x, isa, 1, qtype)
        assert np.isnan(y[1:]).all(), isa
        np.testing.assert_array_equal(y[0], clean[0])


def test_quantized_bad_input():
    raw, _, x = _qcase("Q4_K", 4, 256, 2)
    with pytest.raises(ValueError, match="unknown ggml type"):
        _core.testing.matmul(raw, x, "", 1, "q4_9")
    with pytest.raises(ValueError, match="bytes"):
        _core.testing.matmul(raw[:, :-2].copy(), x, "", 1, "q4_K")
    with pytest.raises(ValueError, match="multiple of"):
        _core.testing.matmul(raw, x[:, :100].copy(), "", 1, "q4_K")
    with pytest.raises(ValueError, match="uint8"):
        _core.testing.matmul(raw.astype(np.float32), x, "", 1, "q4_K")
    with pytest.raises(ValueError, match="not one the kernel takes"):
        _core.testing.matmul(raw, x, "", 1, "i32")


def test_matmul_bad_input():
    W, x = _case(4, 8, 2, np.float32)
    with pytest.raises(ValueError, match="columns"):
        _core.testing.matmul(W, x[:, :5])
    with pytest.raises(ValueError, match="float16 or float32"):
        _core.testing.matmul(W.astype(np.float64), x)
    with pytest.raises(ValueError, match="not available|instruction set"):
        _core.testing.matmul(W, x, "sse9")


def test_own_and_ggml_agree(gguf_model):
    """The two matmul settings compute the same model (ggml rounds activations to F16 for F16
    weights, hence the tolerance)."""
    path = gguf_model("qwen3_5", outtype="f16")
    toks = [int(t) for t in np.random.default_rng(4).integers(0, 500, 12)]
    own = dn.Engine(path, n_ctx=32, n_threads=2).eval(toks)
    ggml = dn.Engine.for_benchmark(path, n_ctx=32, n_threads=2, matmul="ggml").eval(toks)
    np.testing.assert_allclose(own, ggml, atol=2e-2 * np.abs(ggml).max(), rtol=0)


def test_engine_rejects_unknown_matmul(gguf_model):
    with pytest.raises(ValueError, match="matmul must be 'own' or 'ggml'"):
        dn.Engine.for_benchmark(gguf_model("qwen3"), matmul="blas")


def test_top1_matches_float64_softmax():
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(4096) * s for s in (0.1, 1.0, 5.0, 30.0)]
    rows.append(np.zeros(4096))                       # uniform: p = 1 / V
    spike = np.full(4096, -50.0); spike[123] = 50.0   # one certain token: p = 1
    rows.append(spike)
    tie = rng.standard_normal(4096); tie[[7, 900]] = tie.max() + 1.0  # first maximum wins, as ggml_argmax
    rows.append(tie)
    logits = np.stack(rows).astype(np.float32)
    arg, p = _core.testing.top1(logits)
    l64 = logits.astype(np.float64)
    ref_p = 1.0 / np.exp(l64 - l64.max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_array_equal(arg, np.argmax(logits, axis=1))
    assert arg[-1] == 7
    np.testing.assert_allclose(p, ref_p, rtol=2e-5, atol=0)
    assert abs(p[4] - 1 / 4096) < 1e-9 and p[5] == pytest.approx(1.0, abs=1e-6)


def test_decode_greedy_is_argmax_of_decode(gguf_model):
    """The AR loop's step (argmax in the graph) picks the token the logits' argmax picks."""
    eng = dn.Engine(gguf_model("qwen3_5", outtype="f16"), n_ctx=64, n_threads=2)
    core = eng._core
    toks = [int(t) for t in np.random.default_rng(6).integers(0, 500, 9)]
    core.reset()
    ref = [int(np.argmax(core.decode(toks)[-1]))]
    for _ in range(6):
        ref.append(int(np.argmax(core.decode([ref[-1]])[-1])))
    core.reset()
    got = [core.decode_greedy(toks)]
    for _ in range(6):
        got.append(core.decode_greedy([got[-1]]))
    assert got == ref


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_attention_is_batch_invariant_across_thread_splits(gguf_model, threads):
    """The own attention op (csrc/kernels/cpu/attn.cpp) splits tokens over threads when there are more threads
    than KV heads: a batch of tokens still equals one-token steps bit for bit."""
    path = gguf_model("qwen3", outtype="f32")
    toks = [int(t) for t in np.random.default_rng(7).integers(0, 500, 14)]
    core = dn.Engine(path, n_ctx=64, n_threads=threads, kv_type="f32")._core
    core.reset()
    core.decode(toks[:5])
    batch = core.decode(toks[5:], all_logits=True)
    core.reset()
    core.decode(toks[:5])
    steps = np.stack([core.decode([t])[-1] for t in toks[5:]])
    np.testing.assert_array_equal(batch, steps)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("n_prefix", [16, 150, 203])
def test_attention_one_token_equals_batch_past_many_keys(gguf_model, kv_type, n_prefix):
    """An AR step's attention (AVX-512: its heads' scores straight from the key rows, 16 keys a tile)
    and a batch's (keys converted once into a transposed copy) give the same bits, for key counts
    that are and are not multiples of 16, with F16 and F32 caches."""
    path = gguf_model("qwen3", outtype="f32")
    toks = [int(t) for t in np.random.default_rng(n_prefix).integers(0, 500, n_prefix + 9)]
    core = dn.Engine(path, n_ctx=256, n_threads=2, kv_type=kv_type)._core
    core.reset()
    core.decode(toks[:n_prefix])
    batch = core.decode(toks[n_prefix:], all_logits=True)
    core.reset()
    core.decode(toks[:n_prefix])
    steps = np.stack([core.decode([t])[-1] for t in toks[n_prefix:]])
    np.testing.assert_array_equal(batch, steps)


@pytest.mark.parametrize("n_tok,n_ch,d_conv", [(1, 512, 4), (6, 37, 4), (32, 16, 2), (3, 8, 5)])
def test_conv_silu_matches_float64(n_tok, n_ch, d_conv):
    """The GDN conv op (conv.h): silu of the causal depthwise conv over [state; x], and the state
    moved to the last d_conv-1 inputs, against float64."""
    rng = np.random.default_rng(n_tok + n_ch)
    state = rng.standard_normal((n_ch, d_conv - 1)).astype(np.float32) * 3
    x = rng.standard_normal((n_tok, n_ch)).astype(np.float32) * 3
    w = rng.standard_normal((n_ch, d_conv)).astype(np.float32)
    out, new_state = _core.testing.conv_silu(state, x, w)
    seq = np.concatenate([state.astype(np.float64), x.T.astype(np.float64)], axis=1)  # [n_ch, d_conv-1+n_tok]
    pre = np.stack([(seq[:, t:t + d_conv] * w).sum(1) for t in range(n_tok)])       # [n_tok, n_ch]
    want = pre / (1 + np.exp(-pre))
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(new_state, seq[:, -(d_conv - 1):].astype(np.float32))
    with pytest.raises(ValueError, match="conv_silu"):
        _core.testing.conv_silu(state, x[:, :-1], w)
