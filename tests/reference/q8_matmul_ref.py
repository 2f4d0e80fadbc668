"""The integer path of the batch-invariant matmul (csrc/kernels/cpu/matmul/matmul.h), emulated operation by operation.

Written from the GGUF block layouts and the contract in matmul.h, not from the C++: the weight
rows are decoded to integer codes and scales here, the activations quantized as ggml's reference
quantizers do, the block sums formed as Python integers, and every F32 operation of an output
(the scale product, the conversion of an integer sum, each fused multiply-add) rounded exactly
(fractions, round to nearest even). So an output that matches it bit for bit computed exactly the
operations the contract names, in its order:

  Q4_0 / Q8_0 (activations as Q8_0): per block b in order,
      acc = fmaf(fl(dw_b * da_b), (float) s_b, acc),  s_b = sum of the block's 32 code products;
  Q4_K / Q5_K (activations as Q8_K): per superblock in order,
      acc = fmaf(fl(d * da), (float) S, acc); acc = fmaf(-fl(dmin * da), (float) M, acc),
      S = sum_j sc_j sum_{k in sub-block j} q_k a_k, M = sum_j m_j sum_{k in j} a_k;
  Q6_K: acc = fmaf(fl(d * da), (float) S, acc), S = sum_g sc_g sum_{k in group g} (q_k - 32) a_k.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

F32 = np.float32


def round_f32(x: Fraction) -> np.float32:
    """x rounded to the nearest F32, ties to even (x inside F32's normal range or zero)."""
    f = F32(float(x))  # within one F32 step of the answer (float() rounds x once, to 53 bits)
    cands = [np.nextafter(f, F32(-np.inf)), f, np.nextafter(f, F32(np.inf))]
    dist = [abs(Fraction(float(c)) - x) for c in cands]
    best = min(dist)
    ties = [c for c, d in zip(cands, dist) if d == best]
    if len(ties) == 1:
        return F32(ties[0])
    return F32(next(c for c in ties if int(np.array(c).view(np.uint32)) % 2 == 0))


def fmaf(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    return round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def to_f32(n: int) -> np.float32:
    """(float) of an int32: round to nearest even."""
    return round_f32(Fraction(int(n)))


# ---- activations ------------------------------------------------------------------------------

def q8_0_acts(x: np.ndarray):
    """quantize_row_q8_0_ref per column: codes [N, K] int64, scales [N, K / 32] F32 (F16-rounded)."""
    N, K = x.shape
    xb = x.reshape(N, K // 32, 32)
    d = (np.abs(xb).max(-1) / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    v = (xb * inv[..., None]).astype(F32).astype(np.float64)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int64)  # roundf: half away from zero
    return q.reshape(N, K), d.astype(np.float16).astype(F32)


def q8_K_acts(x: np.ndarray):
    """quantize_row_q8_K_ref per column: codes [N, K] int64, scales [N, K / 256] F32."""
    N, K = x.shape
    xb = x.reshape(N, K // 256, 256)
    first = np.abs(xb).argmax(-1)  # the first of largest |x|
    mx = np.take_along_axis(xb, first[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, F32(-127) / mx, F32(0)).astype(F32)
        d = np.where(mx != 0, F32(1) / iscale, F32(0)).astype(F32)
    q = np.minimum(np.rint((xb * iscale[..., None]).astype(F32)), 127).astype(np.int64)
    return q.reshape(N, K), d


# ---- weights ----------------------------------------------------------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(F32)


def decode_q8_0_kind(raw: np.ndarray, qtype: str):
    """Q4_0 / Q8_0 rows -> signed codes [M, K] int64, block scales [M, K / 32] F32."""
    M = raw.shape[0]
    if qtype == "Q8_0":
        blk = raw.reshape(M, -1, 34)
        codes = blk[..., 2:].view(np.int8).astype(np.int64)
    else:
        blk = raw.reshape(M, -1, 18)
        qs = blk[..., 2:].astype(np.int64)
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1) - 8  # low nibbles are codes 0..15
    return codes.reshape(M, -1), _f16(blk[..., 0:2])


def _scale_min_k4(s: np.ndarray):
    """The 8 6-bit scales and mins of Q4_K / Q5_K's 12 scale bytes ([..., 12] -> two [..., 8])."""
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def decode_k_quant(raw: np.ndarray, qtype: str):
    """K-quant rows -> per superblock: codes q [M, nsb, 256] (Q6_K: 0..63), scales per code group
    sc [M, nsb, G] (G = 8 sub-blocks of 32, or Q6_K's 16 groups of 16, signed), mins [M, nsb, 8]
    (zero for Q6_K), d and dmin [M, nsb] F32."""
    M = raw.shape[0]
    if qtype == "Q6_K":
        blk = raw.reshape(M, -1, 210)
        ql, qh = blk[..., 0:128].astype(np.int64), blk[..., 128:192].astype(np.int64)
        q = np.zeros(blk.shape[:2] + (256,), np.int64)
        for n in range(2):
            l_, h_ = ql[..., 64 * n:64 * n + 64], qh[..., 32 * n:32 * n + 32]
            q[..., 128 * n + 0:128 * n + 32] = (l_[..., :32] & 15) | ((h_ & 3) << 4)
            q[..., 128 * n + 32:128 * n + 64] = (l_[..., 32:] & 15) | (((h_ >> 2) & 3) << 4)
            q[..., 128 * n + 64:128 * n + 96] = (l_[..., :32] >> 4) | (((h_ >> 4) & 3) << 4)
            q[..., 128 * n + 96:128 * n + 128] = (l_[..., 32:] >> 4) | (((h_ >> 6) & 3) << 4)
        sc = blk[..., 192:208].view(np.int8).astype(np.int64)
        return q, sc, np.zeros(sc.shape[:2] + (8,), np.int64), _f16(blk[..., 208:210]), np.zeros(blk.shape[:2], F32)
    size, hi = (144, False) if qtype == "Q4_K" else (176, True)
    blk = raw.reshape(M, -1, size)
    sc, mn = _scale_min_k4(blk[..., 4:16])
    qs = blk[..., size - 128:].astype(np.int64)
    q = np.zeros(blk.shape[:2] + (256,), np.int64)
    for j in range(8):  # sub-block j: nibble j % 2 of qs[32 (j / 2) ..], Q5_K's fifth bit qh bit j
        nib = qs[..., 32 * (j // 2):32 * (j // 2) + 32]
        q[..., 32 * j:32 * j + 32] = (nib >> 4) if j % 2 else (nib & 15)
        if hi:
            q[..., 32 * j:32 * j + 32] |= ((blk[..., 16:48].astype(np.int64) >> j) & 1) << 4
    return q, sc, mn, _f16(blk[..., 0:2]), _f16(blk[..., 2:4])


# ---- the matmul -------------------------------------------------------------------------------

def matmul(raw: np.ndarray, qtype: str, x: np.ndarray) -> np.ndarray:
    """y [N, M] F32: every output by the contract's operations, rounded exactly."""
    N, K = x.shape
    M = raw.shape[0]
    y = np.zeros((N, M), F32)
    if qtype in ("Q4_0", "Q8_0"):
        w, dw = decode_q8_0_kind(raw, qtype)
        a, da = q8_0_acts(x)
        s = np.einsum("mbk,nbk->nmb", w.reshape(M, -1, 32), a.reshape(N, -1, 32))  # exact, int64
        for n in range(N):
            for m in range(M):
                acc = F32(0)
                for b in range(K // 32):
                    acc = fmaf(F32(dw[m, b] * da[n, b]), to_f32(s[n, m, b]), acc)
                y[n, m] = acc
        return y
    q, sc, mn, d, dmin = decode_k_quant(raw, qtype)
    a, da = q8_K_acts(x)
    nsb = K // 256
    G = sc.shape[-1]
    q0 = 32 if qtype == "Q6_K" else 0
    t = np.einsum("msgk,nsgk->nmsg", (q - q0).reshape(M, nsb, G, -1), a.reshape(N, nsb, G, -1))  # per group
    S = np.einsum("nmsg,msg->nms", t, sc)
    bs = a.reshape(N, nsb, 8, 32).sum(-1)  # the activations' sums per sub-block of 32
    Mn = np.einsum("nsj,msj->nms", bs, mn)
    for n in range(N):
        for m in range(M):
            acc = F32(0)
            for s_ in range(nsb):
                acc = fmaf(F32(d[m, s_] * da[n, s_]), to_f32(S[n, m, s_]), acc)
                if qtype != "Q6_K":
                    acc = fmaf(-F32(dmin[m, s_] * da[n, s_]), to_f32(Mn[n, m, s_]), acc)
            y[n, m] = acc
    return y
