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
// kernels' fixed-order sums (16 lanes, each an in-order chain), the same bits on every ISA. Written
// on GCC vectors so that each clone reduces in registers (halves of a zmm / ymm / xmm), not on the
// stack one float at a time.
inline float sum16(const float * acc) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
    typedef float v16 __attribute__((vector_size(64), aligned(4)));
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    const v16 v = *(const v16 *) acc;
    const v8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#else
    float s8[8], s4[4];
    for (int l = 0; l < 8; ++l) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

}  // namespace dfn
