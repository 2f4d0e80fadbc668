// The block layouts of the quantized types the matmul decodes itself (the GGUF format's, as
// ggml-common.h has them; matmul_weight_type checks their sizes against ggml's before use), and
// the F16 -> F32 conversion of their scales. Internal to matmul*.cpp.
#pragma once

#include "base/common.h"
#include "ggml.h"

#include <cstdint>
#include <cstring>

#if DFN_X86_GCC
#include <immintrin.h>
#endif

namespace dfn {

struct blk_q8_0 {
    ggml_fp16_t d;
    int8_t qs[32];
};
struct blk_q4_0 {
    ggml_fp16_t d;
    uint8_t qs[16];
};
struct blk_q4_K {
    ggml_fp16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
};
struct blk_q5_K {
    ggml_fp16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
};
struct blk_q6_K {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    ggml_fp16_t d;
};

// F16 -> F32 (exact) for the block scales, inline: a call into ggml per block of 32 codes costs more
// than dequantizing the block.
static inline float half_to_float(ggml_fp16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in F32
        const float v = (float) man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

#if DFN_X86_GCC
// Q4_K / Q5_K: the 8 6-bit scales (bytes 0..7) and mins (bytes 8..15) of the 12 scale bytes s, as
// scale_min_k4 reads them: sc 0..3 = s 0..3 & 63, sc 4..7 = (s 8..11 & 15) | (s 0..3 >> 6) << 4,
// m 0..3 = s 4..7 & 63, m 4..7 = (s 8..11 >> 4) | (s 4..7 >> 6) << 4. Reads 16 bytes from s (the
// last 4 are the block's next field, unused).
__attribute__((target("ssse3,sse4.1"))) static inline __m128i k4_scales_mins(const uint8_t * s) {
    const __m128i v = _mm_loadu_si128((const __m128i *) s);
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_and_si128(_mm_blend_epi16(a, _mm_srli_epi16(a, 4), 0xC0),  // bytes 12..15: high nibbles
                                      _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    return _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));  // bits 6, 7 -> 4, 5
}

// Lane sums of int32 lanes (exact integers, any order).
static inline int32_t hsum4_epi32(__m128i v) {
    v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 1)));
}
__attribute__((target("avx2"))) static inline int32_t hsum8_epi32(__m256i v) {
    return hsum4_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#endif

// A tile of 16 rows of Q4_0 / Q8_0 weights for the rows kernels (q8_0_rows.inc; each ISA's
// q8_0_rows16 adds the integer sums): row i's pointer (lanes past nr repeat the last row, computed
// and never stored), and what every ISA does alike.
template <ggml_type T>
struct q8_0_rows16_base {
    static constexpr size_t bsz = T == GGML_TYPE_Q8_0 ? sizeof(blk_q8_0) : sizeof(blk_q4_0);
    const uint8_t * w[16];
    size_t next;  // bytes to the next tile's rows
    q8_0_rows16_base(const uint8_t * W, size_t w_row_bytes, int64_t r, int nr) : next(16 * w_row_bytes) {
        for (int i = 0; i < 16; ++i) w[i] = W + (r + (i < nr ? i : nr - 1)) * w_row_bytes;
    }
    // The next tile's block b, while block b is read: 16 interleaved row streams are more than the
    // hardware prefetcher follows (prefetching ahead in the same rows instead ran 10-20% slower).
    void prefetch_next(int64_t b) const {
        for (int i = 0; i < 16; ++i) __builtin_prefetch(w[i] + next + b * bsz);
    }
    // The rows' F16 scales of block b (d leads both layouts), read one by one: their stride is a row.
    void scales_f16(int64_t b, ggml_fp16_t * h) const {
        for (int i = 0; i < 16; ++i) h[i] = ((const blk_q4_0 *) (w[i] + b * bsz))->d;
    }
};

}  // namespace dfn
