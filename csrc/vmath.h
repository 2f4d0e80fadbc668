// Small vectorisable math shared by our CPU kernels (top1.cpp, attn.cpp, conv.cpp, gdn_tape.cpp). Inline, so
// each multiversioned caller compiles it for its own instruction set and vectorises it.
#pragma once

#include <cstdint>
#include <cstring>

namespace dfn {

// exp(x) for x <= 0: 2^(x log2 e) = 2^n 2^f, n the nearest integer, f in [-1/2, 1/2], 2^f by
// its degree-6 Taylor polynomial (relative error < 2e-7); x below -87 gives 0. Plain arithmetic,
// so `#pragma omp simd` loops vectorise it, and every caller gets the same bits.
inline float exp_neg(float x) {
    const float y = (x > -87.0f ? x : -87.0f) * 1.44269504f;
    const float n = (y + 12582912.0f) - 12582912.0f;  // nearest integer (1.5 * 2^23 trick: vectorises)
    const float f = y - n;
    const float p = 1.0f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f +
                    f * (0.00133335581f + f * 0.000154035304f)))));
    int32_t bits;
    std::memcpy(&bits, &p, sizeof(bits));
    bits += (int32_t) n * (1 << 23);
    float r;
    std::memcpy(&r, &bits, sizeof(r));
    return x < -87.0f ? 0.0f : r;
}

// silu(x) = x / (1 + exp(-x)), through exp_neg(-|x|) (no overflow for large |x|).
inline float silu_fast(float x) {
    const float e = exp_neg(x >= 0.0f ? -x : x);
    return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

// The sum of 16 lanes by a fixed tree (i + 8, then i + 4, i + 2, i + 1): the last step of the
// kernels' fixed-order sums (16 lanes, each an in-order chain), the same bits on every ISA.
inline float sum16(float * acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

}  // namespace dfn
