"""Plain reference of the seeded sampler (csrc/sampler.{h,cpp}), written from the definitions, not
from the C++ code: Philox4x32-10 over NumPy uint64 lanes, the filters with a full sort, and the
Gumbel-max draw as a plain argmax over every kept token (no pruning).

The scalar transcendental functions are Python's `math.exp` / `math.log` (the C library's, as the
C++ side calls them), and every sum runs in the order the sampler defines, so the reference agrees
with the C++ sampler exactly, not within a tolerance.
"""

from __future__ import annotations

import math

import numpy as np

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(ctr, key):
    """Philox4x32-10 (Salmon et al., SC'11). ctr: 4 arrays (or ints) of uint32 words, key: 2 ints.
    Returns the 4 output words as uint64 arrays holding 32-bit values."""
    c = [np.asarray(x, dtype=np.uint64) & MASK32 for x in ctr]
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W[0])) & MASK32
            k1 = (k1 + np.uint64(PHILOX_W[1])) & MASK32
        p0 = np.uint64(PHILOX_M[0]) * c[0]  # < 2^64: no wrap
        p1 = np.uint64(PHILOX_M[1]) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & MASK32, p1 & MASK32,
             ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & MASK32, p0 & MASK32]
    return c


def noise_bits(seed: int, pos: int, tokens) -> np.ndarray:
    """52 bits per token: Philox keyed by the seed at counter (pos lo, pos hi, token, 0)."""
    tokens = np.asarray(tokens, dtype=np.int64).astype(np.uint64) & MASK32
    pos &= (1 << 64) - 1
    zeros = np.zeros_like(tokens)
    out = philox4x32_10([zeros + np.uint64(pos & 0xFFFFFFFF), zeros + np.uint64(pos >> 32), tokens, zeros],
                        (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    return ((out[0] << np.uint64(32)) | out[1]) >> np.uint64(12)


def gumbel(seed: int, pos: int, tokens) -> np.ndarray:
    """G = -log(-log(U)), U = (bits + 0.5) / 2^52."""
    bits = noise_bits(seed, pos, tokens)
    return np.array([-math.log(-math.log((float(int(b)) + 0.5) * 2.0 ** -52)) for b in bits], dtype=np.float64)


def exp_neg(x) -> np.ndarray:
    """The package's float exp for x <= 0 (csrc/kernels/cpu/vmath.h: exp_neg), operation by operation in
    float32: 2^n 2^f with n the nearest integer to x log2(e) and 2^f a degree-6 polynomial; x below
    -87 gives 0."""
    f32 = np.float32
    x = np.asarray(x, dtype=np.float32)
    y = np.where(x > f32(-87.0), x, f32(-87.0)).astype(np.float32) * f32(1.44269504)
    n = (y + f32(12582912.0)) - f32(12582912.0)
    f = y - n
    p = f32(0.000154035304)
    for c in (0.00133335581, 0.00961812911, 0.0555041087, 0.240226507, 0.693147182, 1.0):
        p = f32(c) + f * p
    bits = p.astype(np.float32).view(np.int32) + n.astype(np.int32) * np.int32(1 << 23)
    return np.where(x < f32(-87.0), f32(0.0), bits.view(np.float32))


def top_p_weights(logits, l_max: float) -> np.ndarray:
    """Top-p's integer weights: floor(2^30 exp_neg(l - l_max)), l - l_max in float32."""
    d = np.asarray(logits, dtype=np.float32) - np.float32(l_max)
    return (exp_neg(d) * np.float32(2.0 ** 30)).astype(np.int64)


def filter_kept(logits, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
    """Indices kept by top-k, then top-p, then min-p (see sampler.h), ascending. Top-p keeps the
    shortest prefix in (larger logit, lower index) order whose integer weights reach
    ceil(top_p * their total over the tokens top-k kept)."""
    lg = [float(x) for x in np.asarray(logits, dtype=np.float32)]
    kept = [i for i, x in enumerate(lg) if x > -math.inf]
    l_max = max(lg[i] for i in kept)
    order = sorted(kept, key=lambda i: (-lg[i], i))  # larger logit first, lower index among equals
    if 0 < top_k < len(kept):
        kept = sorted(order[:top_k])
    if top_p < 1.0:
        order = sorted(kept, key=lambda i: (-lg[i], i))
        w = top_p_weights([lg[i] for i in order], l_max)
        need = math.ceil(top_p * float(int(w.sum())))
        cut = int(np.searchsorted(np.cumsum(w), need)) + 1  # the first prefix whose sum reaches need
        kept = sorted(order[:cut])
    if min_p > 0.0:
        lim = math.log(min_p)
        kept = [i for i in kept if lg[i] - l_max >= lim]
    return kept


def sample(logits, *, temperature: float, seed: int, pos: int, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, ids=None) -> int:
    """The draw: argmax over the kept entries of l / T + G(seed, pos, id); lowest index on ties.
    Returns the token id (ids[index] when ids is given)."""
    lg = np.asarray(logits, dtype=np.float32)
    if not np.all(np.isfinite(lg) | (lg == -np.inf)) or not np.any(lg > -np.inf):
        raise ValueError("non-finite logits")
    kept = filter_kept(lg, top_k, top_p, min_p)
    tok = np.asarray(ids if ids is not None else np.arange(len(lg)), dtype=np.int64)
    g = gumbel(seed, pos, tok[kept])
    best, s_best = -1, -math.inf
    for j, i in enumerate(kept):
        s = float(lg[i]) / temperature + float(g[j])
        if best < 0 or s > s_best:  # ascending order: the first of equal scores stays
            best, s_best = i, s
    return int(tok[best])


def kept_probs(logits, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The distribution the draw samples: softmax(kept logits / T), zero elsewhere (float64)."""
    lg = np.asarray(logits, dtype=np.float64)
    kept = filter_kept(logits, top_k, top_p, min_p)
    p = np.zeros(len(lg))
    x = lg[kept] / temperature
    e = np.exp(x - x.max())
    p[kept] = e / e.sum()
    return p


def logprobs(logits, *, temperature: float, token: int, n: int, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> tuple[float, list[tuple[int, float]]]:
    """generate(..., logprobs=n)'s values for one token, from its logits row: (log p(token), the n
    most probable (id, log p), most probable first, lower id first among equals). Sampled
    (temperature > 0): p = softmax(kept logits / T) over filter_kept's tokens; greedy
    (temperature 0): the log-softmax of the raw logits (every finite one, no filter). log p_i =
    l_i / T - m - log(sum over the kept tokens, ascending, of exp(l_j / T - m)), m = max l / T."""
    lg = [float(x) for x in np.asarray(logits, dtype=np.float32)]
    if temperature > 0:
        kept, T = filter_kept(lg, top_k, top_p, min_p), float(temperature)
    else:
        kept, T = [i for i, x in enumerate(lg) if x > -math.inf], 1.0
    m = max(lg[i] for i in kept) / T
    z = 0.0
    for i in kept:
        z += math.exp(lg[i] / T - m)
    lz = math.log(z)

    def lp(i):
        return lg[i] / T - m - lz

    top = sorted(kept, key=lambda i: (-lg[i], i))[:n]
    return lp(token), [(i, lp(i)) for i in top]
