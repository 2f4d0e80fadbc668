// The wide Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K GEMM on AVX-512 VNNI or AVX2 (wide_gemm.h has the
// layout and the math): what both levels share (the packed layout, the weights' unpacking), each
// level's primitives and exact integer sums in its namespace (wide512, wide256) with the loops they
// run included from wide_gemm.inc, and the ggml ops.
#include "kernels/cpu/matmul/wide_gemm.h"

#include "base/alloc.h"
#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/matmul/blocks.h"
#include "kernels/cpu/matmul/quantize_act.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if DFN_X86_GCC
#include <immintrin.h>
#endif

namespace dfn {

namespace {

// The packed layout for groups of G columns (wide_gemm.h with 16 replaced by G): per group and
// block, 8 chunks of 4 G code bytes, G int32 biases, G float scales.
template <int G> constexpr int64_t group_bytes = 40 * G;
template <int G> constexpr int64_t bias_at = 32 * G;
template <int G> constexpr int64_t scale_at = 36 * G;
constexpr int k_max_tile_rows = 8;  // Q4_0 / Q8_0 rows per tile at any width (each level's k_tile_rows)
constexpr int k_kq_tile_rows = 4;  // K-quants, both levels (per row: the group sums, S, M, the lanes)

template <int G>
int64_t packed_bytes(int64_t K, int64_t N) { return (N + G - 1) / G * (K / 32) * group_bytes<G>; }

// Q4_K / Q6_K: the packed layout for groups of G columns per superblock of 256 (activations as
// Q8_K): 64 chunks of 4 G code bytes (chunk c: codes 4 c .. 4 c + 3, lane = column), then 8 pairs
// of int16 lanes (pair p: the sums of codes 32 p .. 32 p + 15 and 32 p + 16 .. 32 p + 31, Q8_K's
// bsums 2 p and 2 p + 1, per column), then G float scales da.
template <int G> constexpr int64_t kq_group_bytes = 292 * G;
template <int G> constexpr int64_t kq_bsum_at = 256 * G;
template <int G> constexpr int64_t kq_scale_at = 288 * G;

template <int G>
int64_t kq_packed_bytes(int64_t K, int64_t N) { return (N + G - 1) / G * (K / 256) * kq_group_bytes<G>; }

// One K-quant superblock unpacked: the 256 unsigned codes in order, the group scales sc (Q4_K: 8
// sub-blocks of 32; Q6_K: 16 groups of 16, signed), the 8 int16 pairs `pair` that multiply the
// packed bsum pairs (Q4_K: (m_p, m_p), the min of sub-block p, which covers bsums 2 p and 2 p + 1;
// Q6_K: (sc_{2p}, sc_{2p+1})), d and dmin (Q6_K: 0).
struct kq_unpacked {
    uint8_t u[256];
    int32_t sc[16];
    int32_t pair[8];
    float d, dmin;
};

inline int32_t int16_pair(int lo, int hi) { return (int32_t) ((uint32_t) (uint16_t) lo | ((uint32_t) (uint16_t) hi << 16)); }

// Q4_K / Q5_K's d, dmin and 6-bit scales and mins (ggml's get_scale_min_k4; on x86 by the shuffle
// pair of k4_scales_mins, blocks.h: the scalar decode took 15% of a K-quant GEMM of 16
// columns). Called from the GEMM's AVX2 and AVX-512 code only.
#if DFN_X86_GCC
__attribute__((target("avx2,ssse3,sse4.1"))) inline void k4_scales(ggml_fp16_t d, ggml_fp16_t dmin,
                                                                   const uint8_t * scales, kq_unpacked & o) {
    o.d = half_to_float(d);
    o.dmin = half_to_float(dmin);
    const __m128i sm = k4_scales_mins(scales);
    _mm256_storeu_si256((__m256i *) o.sc, _mm256_cvtepu8_epi32(sm));
    const __m256i m = _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8));
    _mm256_storeu_si256((__m256i *) o.pair, _mm256_or_si256(m, _mm256_slli_epi32(m, 16)));  // int16_pair(m, m)
}
#else
inline void k4_scales(ggml_fp16_t d, ggml_fp16_t dmin, const uint8_t * scales, kq_unpacked & o) {
    o.d = half_to_float(d);
    o.dmin = half_to_float(dmin);
    for (int j = 0; j < 8; ++j) {
        int m;
        if (j < 4) {
            o.sc[j] = scales[j] & 63;
            m = scales[j + 4] & 63;
        } else {
            o.sc[j] = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
            m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        }
        o.pair[j] = int16_pair(m, m);
    }
}
#endif

// Q4_K: the nibbles in code order.
inline void kq_unpack(const blk_q4_K & x, kq_unpacked & o) {
    k4_scales(x.d, x.dmin, x.scales, o);
    for (int jj = 0; jj < 4; ++jj) {
        for (int l = 0; l < 32; ++l) {
            o.u[64 * jj + l] = x.qs[32 * jj + l] & 0xF;
            o.u[64 * jj + 32 + l] = x.qs[32 * jj + l] >> 4;
        }
    }
}

// Q5_K: Q4_K's scales and mins, and a fifth bit per code from qh (ggml's dequantize_row_q5_K:
// values 64 jj + l and 64 jj + 32 + l take bits 2 jj and 2 jj + 1 of qh[l]); codes 0..31.
inline void kq_unpack(const blk_q5_K & x, kq_unpacked & o) {
    k4_scales(x.d, x.dmin, x.scales, o);
    for (int jj = 0; jj < 4; ++jj) {
        for (int l = 0; l < 32; ++l) {
            o.u[64 * jj + l] = (uint8_t) ((x.qs[32 * jj + l] & 0xF) | (((x.qh[l] >> (2 * jj)) & 1) << 4));
            o.u[64 * jj + 32 + l] = (uint8_t) ((x.qs[32 * jj + l] >> 4) | (((x.qh[l] >> (2 * jj + 1)) & 1) << 4));
        }
    }
}

// ggml's dequantize_row_q6_K order: per half of 128, value l + 32 i (i < 4) takes the low or high
// nibble of ql and two bits of qh; the unsigned code q is 0..63 (w = d sc (q - 32)).
inline void kq_unpack(const blk_q6_K & x, kq_unpacked & o) {
    o.d = half_to_float(x.d);
    o.dmin = 0.0f;
    for (int gi = 0; gi < 16; ++gi) o.sc[gi] = x.scales[gi];
    for (int p = 0; p < 8; ++p) o.pair[p] = int16_pair(x.scales[2 * p], x.scales[2 * p + 1]);
    for (int h = 0; h < 2; ++h) {
        const uint8_t * ql = x.ql + 64 * h;
        const uint8_t * qh = x.qh + 32 * h;
        uint8_t * u = o.u + 128 * h;
        for (int l = 0; l < 32; ++l) {
            u[l] = (uint8_t) ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
            u[l + 32] = (uint8_t) ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
            u[l + 64] = (uint8_t) ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            u[l + 96] = (uint8_t) ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
}

#if DFN_X86_GCC
// One Q4_0 block's nibbles in code order (u[k] = code k) and its scale; baseline x86-64 (SSE2), so
// both levels' kernels inline it.
inline void unpack_q4_0(const blk_q4_0 & x, uint8_t * u, float & dw) {
    dw = half_to_float(x.d);
    const __m128i q = _mm_loadu_si128((const __m128i *) x.qs);
    const __m128i m = _mm_set1_epi8(0x0F);
    _mm_storeu_si128((__m128i *) u, _mm_and_si128(q, m));
    _mm_storeu_si128((__m128i *) (u + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m));
}

// Rows r .. r + RR - 1 of W unpacked: U[i][b][32] code bytes, DW[i][b] the F32 scales. Q4_0: the
// nibbles; Q8_0: with Q8_UNSIGNED (AVX-512 VNNI) the codes xor 0x80, else (AVX2) the signed codes,
// multiplied there as |w| by a signed by w (maddubs takes one unsigned operand and saturates pairs
// past 32767, which 255 x 127 x 2 would reach). Baseline code: both levels' kernels inline it.
template <ggml_type T, int RR, bool Q8_UNSIGNED>
inline void unpack_rows(const uint8_t * W, size_t w_row_bytes, int64_t nb, int64_t r, uint8_t * U, float * DW) {
    for (int i = 0; i < RR; ++i) {
        const uint8_t * row = W + (r + i) * w_row_bytes;
        uint8_t * u = U + i * nb * 32;
        for (int64_t b = 0; b < nb; ++b) {
            if constexpr (T == GGML_TYPE_Q4_0) {
                unpack_q4_0(((const blk_q4_0 *) row)[b], u + 32 * b, DW[i * nb + b]);
            } else {
                const blk_q8_0 & x = ((const blk_q8_0 *) row)[b];
                DW[i * nb + b] = half_to_float(x.d);
                for (int k = 0; k < 32; ++k) u[32 * b + k] = (uint8_t) ((uint8_t) x.qs[k] ^ (Q8_UNSIGNED ? 0x80 : 0));
            }
        }
    }
}

// K-quant rows r .. r + RR - 1 of W unpacked, superblock by superblock, into U[i][s].
template <ggml_type T, int RR>
inline void kq_unpack_rows(const uint8_t * W, size_t w_row_bytes, int64_t nsb, int64_t r, kq_unpacked * U) {
    using B = std::conditional_t<T == GGML_TYPE_Q6_K, blk_q6_K, std::conditional_t<T == GGML_TYPE_Q5_K, blk_q5_K, blk_q4_K>>;
    for (int i = 0; i < RR; ++i)
        for (int64_t s = 0; s < nsb; ++s) kq_unpack(((const B *) (W + (r + i) * w_row_bytes))[s], U[i * nsb + s]);
}

// Rows [r0, r1) in tiles of TR rows, then single rows: tile(r, std::integral_constant<int, rows>).
template <int TR, class Tile>
inline void by_row_tiles(int64_t r0, int64_t r1, Tile tile) {
    int64_t r = r0;
    for (; r + TR <= r1; r += TR) tile(r, std::integral_constant<int, TR>{});
    for (; r < r1; ++r) tile(r, std::integral_constant<int, 1>{});
}

// ---- AVX-512 VNNI: groups of 16 columns, tiles of 8 rows ---------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
// GCC 12 flags the undefined upper half inside its own _mm512 intrinsics' headers
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace wide512 {

// The primitives and integer sums wide_gemm.inc asks for (its first comment), on 512 bits.
constexpr int k_width = 16;
constexpr int k_tile_rows = 8;  // 8 int32 + 8 float accumulators
constexpr bool k_q8_unsigned = true;  // vpdpbusd takes unsigned codes: Q8_0 xor 0x80 (off 128)
typedef __m512 vec;
typedef __m512i ivec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const uint8_t * p) { return _mm512_loadu_ps((const float *) p); }
inline vec vset1(float v) { return _mm512_set1_ps(v); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vcvt(ivec v) { return _mm512_cvtepi32_ps(v); }
inline vec vneg(vec v) {  // the sign bit flipped (AVX-512F has no xor_ps)
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec iload(const uint8_t * p) { return _mm512_loadu_si512((const void *) p); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec isub(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
inline ivec islli(ivec a, unsigned n) { return _mm512_slli_epi32(a, n); }
// the activations' quantizers
inline vec vload(const float * p) { return _mm512_loadu_ps(p); }
inline vec vabs(vec v) { return _mm512_abs_ps(v); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float hmax(vec v) { return _mm512_reduce_max_ps(v); }
inline bool all_finite(vec v) {  // x - x is 0 for every finite x, NaN otherwise
    return _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF;
}
inline unsigned lanes_equal(vec v, float x) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_EQ_OQ); }
inline ivec round_away(vec v) {  // ggml's reference rounding: t = trunc(v), +1 where v - t >= 0.5, -1 where <= -0.5
    const ivec t = _mm512_cvttps_epi32(v);
    const vec frac = _mm512_sub_ps(v, _mm512_cvtepi32_ps(t));
    const ivec r = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ), t, _mm512_set1_epi32(1));
    return _mm512_mask_sub_epi32(r, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), r, _mm512_set1_epi32(1));
}
inline ivec round_even(vec v) { return _mm512_cvtps_epi32(v); }  // under the default rounding mode
inline ivec imin(ivec a, int32_t b) { return _mm512_min_epi32(a, _mm512_set1_epi32(b)); }
inline int32_t ihsum(ivec v) { return _mm512_reduce_add_epi32(v); }
inline void store_codes16(int8_t * q, const ivec * r) {  // 16 int32 lanes (-127..127) as int8
    _mm_storeu_si128((__m128i *) q, _mm512_cvtepi32_epi8(r[0]));
}

// acc[i] (lane c: column c0 + c of row r + i) into y[(c0 + c) ldy + r + i] for the first cols
// columns: through a copy on the stack, one store of the RR rows per column (a scatter of each row
// wrote 16 lines, 4 bytes each: a third of a 16-column verify's matmul time went there).
template <int RR>
inline void store_tile(const vec * acc, float * y, int64_t ldy, int64_t r, int64_t c0, int64_t cols) {
    alignas(64) float tmp[RR][16];
    for (int i = 0; i < RR; ++i) _mm512_store_ps(tmp[i], acc[i]);
    const __m256i idx = _mm256_set_epi32(112, 96, 80, 64, 48, 32, 16, 0);  // tmp[i][c] - tmp[0][c]
    const __mmask8 rows = (__mmask8) ((1u << RR) - 1);
    for (int64_t c = 0; c < cols; ++c) {
        const __m256 v = _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), rows, idx, &tmp[0][c], 4);
        _mm256_mask_storeu_ps(y + (c0 + c) * ldy + r, rows, v);
    }
}

// Q4_0 / Q8_0: s = bias + sum_j vpdpbusd(the row's 4 unsigned codes, chunk j).
template <ggml_type T>
inline ivec q8_sum_init(ivec bias) { return bias; }
template <ggml_type T>
inline ivec q8_sum_step(ivec s, int32_t w4, ivec a) { return _mm512_dpbusd_epi32(s, _mm512_set1_epi32(w4), a); }
template <ggml_type T>
inline ivec q8_sum_end(ivec s, ivec) { return s; }

// K-quants: a scale group's chunks in one run of vpdpbusd, times sc by vpmulld; M by vpdpwssd.
template <ggml_type T>
constexpr int kq_per_sum = T == GGML_TYPE_Q6_K ? 4 : 8;  // all the group's chunks
inline ivec kq_sum_step(ivec t, int32_t w4, ivec a) { return _mm512_dpbusd_epi32(t, _mm512_set1_epi32(w4), a); }
inline ivec kq_sum_scaled(ivec t, int32_t sc) { return _mm512_mullo_epi32(t, _mm512_set1_epi32(sc)); }
inline ivec kq_min_step(ivec M, ivec bs, int32_t pair) { return _mm512_dpwssd_epi32(M, bs, _mm512_set1_epi32(pair)); }

#include "kernels/cpu/matmul/wide_gemm.inc"

}  // namespace wide512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// ---- AVX2: groups of 8 columns, tiles of 4 rows; maddubs + madd for the block sums -------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace wide256 {

// The primitives and integer sums wide_gemm.inc asks for (its first comment), on 256 bits.
constexpr int k_width = 8;
constexpr int k_tile_rows = 4;  // 16 ymm registers
constexpr bool k_q8_unsigned = false;  // Q8_0 as |w| x (a signed by w): maddubs takes one unsigned operand
typedef __m256 vec;
typedef __m256i ivec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const uint8_t * p) { return _mm256_loadu_ps((const float *) p); }
inline vec vset1(float v) { return _mm256_set1_ps(v); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vcvt(ivec v) { return _mm256_cvtepi32_ps(v); }
inline vec vneg(vec v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec iload(const uint8_t * p) { return _mm256_loadu_si256((const __m256i *) p); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec isub(ivec a, ivec b) { return _mm256_sub_epi32(a, b); }
inline ivec islli(ivec a, int n) { return _mm256_slli_epi32(a, n); }
// the activations' quantizers
inline vec vload(const float * p) { return _mm256_loadu_ps(p); }
inline vec vabs(vec v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float hmax(vec v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
inline bool all_finite(vec v) {  // x - x is 0 for every finite x, NaN otherwise
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0xFF;
}
inline unsigned lanes_equal(vec v, float x) {
    return (unsigned) _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_EQ_OQ));
}
inline ivec round_away(vec v) {  // ggml's reference rounding: t = trunc(v), +1 where v - t >= 0.5, -1 where <= -0.5
    const ivec t = _mm256_cvttps_epi32(v);
    const vec frac = _mm256_sub_ps(v, _mm256_cvtepi32_ps(t));
    // the compares' all-ones lanes are -1: subtracting adds 1, adding subtracts 1
    const ivec r = _mm256_sub_epi32(t, _mm256_castps_si256(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ)));
    return _mm256_add_epi32(r, _mm256_castps_si256(_mm256_cmp_ps(frac, _mm256_set1_ps(-0.5f), _CMP_LE_OQ)));
}
inline ivec round_even(vec v) { return _mm256_cvtps_epi32(v); }  // under the default rounding mode
inline ivec imin(ivec a, int32_t b) { return _mm256_min_epi32(a, _mm256_set1_epi32(b)); }
inline int32_t ihsum(ivec v) { return hsum8_epi32(v); }
inline void store_codes16(int8_t * q, const ivec * r) {  // 2 x 8 int32 lanes (-127..127) as 16 int8, in order
    const __m256i w = _mm256_packs_epi32(r[0], r[1]);  // r0 0-3, r1 0-3 | r0 4-7, r1 4-7 (int16)
    const __m256i y = _mm256_permute4x64_epi64(w, 0xD8);  // r0 0-3, r0 4-7, r1 0-3, r1 4-7
    _mm_storeu_si128((__m128i *) q, _mm_packs_epi16(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)));
}

// acc[i] (lane c: column c0 + c of row r + i) into y[(c0 + c) ldy + r + i] for the first cols
// columns: one store of the RR (<= 4) rows per column, as wide512's store_tile.
template <int RR>
inline void store_tile(const vec * acc, float * y, int64_t ldy, int64_t r, int64_t c0, int64_t cols) {
    static_assert(RR <= 4, "store_tile: at most 4 rows");
    alignas(32) float tmp[4][8] = {};
    for (int i = 0; i < RR; ++i) _mm256_store_ps(tmp[i], acc[i]);
    for (int64_t c = 0; c < cols; ++c) {
        float * out = y + (c0 + c) * ldy + r;
        if constexpr (RR == 4) {
            _mm_storeu_ps(out, _mm_set_ps(tmp[3][c], tmp[2][c], tmp[1][c], tmp[0][c]));
        } else {
            for (int i = 0; i < RR; ++i) out[i] = tmp[i][c];
        }
    }
}

// Q4_0: the pairs nibble x a (at most 2 x 15 x 127 = 3810) summed in int16 over the block's 8 chunks
// (<= 30480), then one madd by 1 and the bias. Q8_0: |w| x (a signed by w) (|w| <= 128: the pairs
// never saturate) by maddubs + madd per chunk, from the bias (0: no offset on this path).
template <ggml_type T>
inline ivec q8_sum_init(ivec bias) {
    if constexpr (T == GGML_TYPE_Q4_0) return izero();
    else return bias;
}
template <ggml_type T>
inline ivec q8_sum_step(ivec s, int32_t w4, ivec a) {
    const ivec w = _mm256_set1_epi32(w4);
    if constexpr (T == GGML_TYPE_Q4_0) {
        return _mm256_add_epi16(s, _mm256_maddubs_epi16(w, a));
    } else {
        const ivec p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
        return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
}
template <ggml_type T>
inline ivec q8_sum_end(ivec s, ivec bias) {
    if constexpr (T == GGML_TYPE_Q4_0) return _mm256_add_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), bias);
    else return s;
}

// K-quants by maddubs + madd: pairs of code x a summed in int16, kq_per_sum chunks at a time (Q4_K:
// a sub-block's 8 chunks, pairs at most 2 x 15 x 127, sums at most 30480; Q5_K: 4 chunks, pairs at
// most 2 x 31 x 127, sums at most 31496; Q6_K: 2 chunks, pairs at most 2 x 63 x 127, sums at most
// 32004: 32767 / (2 x 127 x the largest code) chunks), then one madd by the group's scale
// (<= 8.2e6); M by madd on the bsum pairs. The same exact S and M as wide512's, so the same bits.
template <ggml_type T>
constexpr int kq_per_sum = T == GGML_TYPE_Q6_K ? 2 : T == GGML_TYPE_Q5_K ? 4 : 8;
inline ivec kq_sum_step(ivec t, int32_t w4, ivec a) {
    return _mm256_add_epi16(t, _mm256_maddubs_epi16(_mm256_set1_epi32(w4), a));
}
inline ivec kq_sum_scaled(ivec t, int32_t sc) { return _mm256_madd_epi16(t, _mm256_set1_epi16((int16_t) sc)); }
inline ivec kq_min_step(ivec M, ivec bs, int32_t pair) {
    return _mm256_add_epi32(M, _mm256_madd_epi16(bs, _mm256_set1_epi32(pair)));
}

#include "kernels/cpu/matmul/wide_gemm.inc"

}  // namespace wide256
#pragma GCC pop_options
#endif  // DFN_X86_GCC

// The group width of the GEMM that runs at `level` on this CPU: 16 (AVX-512 with VNNI), 8 (AVX2,
// also AVX-512 without VNNI), 0 (none: portable, or not x86).
int width_at(isa_level level) {
#if DFN_X86_GCC
    if (level == isa_level::avx512 && cpu_has_avx512vnni()) return 16;
    if (level >= isa_level::avx2) return 8;
#else
    (void) level;
#endif
    return 0;
}

// Rows [r0, r1) of y from P packed for `width`; false when the scratch cannot be had (noted).
bool gemm(int width, const ggml_tensor * W, const uint8_t * P, int64_t N, float * y, int64_t ldy, int64_t r0, int64_t r1) {
    thread_local std::vector<uint8_t> U;
    thread_local std::vector<float> DW;
    thread_local std::vector<kq_unpacked> UK;
    const int64_t K = W->ne[0];
    if (q8_kind_of(W->type) == q8_kind::q8_K) {
        if (!kernel_scratch(UK, (size_t) (k_kq_tile_rows * (K / 256)), "the wide matmul's unpacked rows")) return false;
    } else if (!kernel_scratch(U, (size_t) (k_max_tile_rows * (K / 32) * 32), "the wide matmul's unpacked rows") ||
               !kernel_scratch(DW, (size_t) (k_max_tile_rows * (K / 32)), "the wide matmul's row scales")) {
        return false;
    }
#if DFN_X86_GCC
    const auto * w = (const uint8_t *) W->data;
    const size_t rb = W->nb[1];
    auto q8_0 = [&](auto type) {  // Q4_0 / Q8_0 rows at the width's level
        constexpr ggml_type T = decltype(type)::value;
        if (width == 16) wide512::gemm_rows<T>(w, rb, K, P, N, y, ldy, r0, r1, U.data(), DW.data());
        else wide256::gemm_rows<T>(w, rb, K, P, N, y, ldy, r0, r1, U.data(), DW.data());
    };
    auto q8_K = [&](auto type) {  // K-quant rows at the width's level
        constexpr ggml_type T = decltype(type)::value;
        if (width == 16) wide512::kq_rows<T>(w, rb, K, P, N, y, ldy, r0, r1, UK.data());
        else wide256::kq_rows<T>(w, rb, K, P, N, y, ldy, r0, r1, UK.data());
    };
    switch (W->type) {
        case GGML_TYPE_Q4_K: q8_K(std::integral_constant<ggml_type, GGML_TYPE_Q4_K>{}); break;
        case GGML_TYPE_Q5_K: q8_K(std::integral_constant<ggml_type, GGML_TYPE_Q5_K>{}); break;
        case GGML_TYPE_Q6_K: q8_K(std::integral_constant<ggml_type, GGML_TYPE_Q6_K>{}); break;
        case GGML_TYPE_Q8_0: q8_0(std::integral_constant<ggml_type, GGML_TYPE_Q8_0>{}); break;
        default: q8_0(std::integral_constant<ggml_type, GGML_TYPE_Q4_0>{}); break;
    }
    return true;
#else
    (void) width, (void) P, (void) N, (void) y, (void) ldy, (void) r0, (void) r1;
    return false;  // never built off x86 (width_at is 0 there)
#endif
}

void pack(int width, const float * x, int64_t ldx, int64_t K, int64_t N, ggml_type type, uint8_t * P, int64_t g0, int64_t g1) {
#if DFN_X86_GCC
    if (width == 16) wide512::pack_groups(x, ldx, K, N, type, P, g0, g1);
    else wide256::pack_groups(x, ldx, K, N, type, P, g0, g1);
#else
    (void) width, (void) x, (void) ldx, (void) K, (void) N, (void) type, (void) P, (void) g0, (void) g1;  // width_at is 0
#endif
}

int64_t packed_size(int width, ggml_type type, int64_t K, int64_t N) {
    if (q8_kind_of(type) == q8_kind::q8_K) return width == 16 ? kq_packed_bytes<16>(K, N) : kq_packed_bytes<8>(K, N);
    return width == 16 ? packed_bytes<16>(K, N) : packed_bytes<8>(K, N);
}

bool wide_type(ggml_type type, int64_t K) {
    // the integer path's types (quantize_act.h): Q4_0 / Q8_0 by blocks of 32, Q4_K / Q5_K / Q6_K by 256
    const q8_kind kind = q8_kind_of(type);
    return (kind == q8_kind::q8_0 && K % 32 == 0) || (kind == q8_kind::q8_K && K % 256 == 0);
}

// The ops' userdata: the group width and the weight type, fixed when the graph is built, in the
// pointer's value (ggml passes it through untouched).
void * op_args(int width, ggml_type type) { return (void *) (intptr_t) (width * GGML_TYPE_COUNT + (int) type); }
int args_width(void * a) { return (int) ((intptr_t) a / GGML_TYPE_COUNT); }
ggml_type args_type(void * a) { return (ggml_type) ((intptr_t) a % GGML_TYPE_COUNT); }

// ggml custom ops. pack: src[0] = x; groups split across threads.
void pack_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int width = args_width(userdata);
    const ggml_tensor * x = dst->src[0];
    const int64_t K = x->ne[0], N = x->ne[1], ng = (N + width - 1) / width;
    pack(width, (const float *) x->data, (int64_t) (x->nb[1] / sizeof(float)), K, N, args_type(userdata),
         (uint8_t *) dst->data, ng * ith / nth, ng * (ith + 1) / nth);
}

// gemm: src[0] = W, src[1] = the packed x; rows split across threads in tiles of 8.
void wide_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * W = dst->src[0];
    const int64_t M = W->ne[1], N = dst->ne[1];
    const int64_t tiles = (M + k_max_tile_rows - 1) / k_max_tile_rows;
    const int64_t r0 = std::min(M, tiles * ith / nth * k_max_tile_rows);
    const int64_t r1 = std::min(M, tiles * (ith + 1) / nth * k_max_tile_rows);
    if (r0 >= r1) return;
    gemm(args_width(userdata), W, (const uint8_t *) dst->src[1]->data, N, (float *) dst->data, (int64_t) (dst->nb[1] / sizeof(float)),
         r0, r1);
}

}  // namespace

bool matmul_wide_available() { return width_at(isa_in_use()) != 0; }

int matmul_wide_width(isa_level level, bool no_vnni) {
    const int width = width_at(level);
    return width == 16 && no_vnni ? 8 : width;
}

bool matmul_wide_span(int width, const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx,
                      float * y, int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1) {
    thread_local std::vector<uint8_t> P;
    if (!kernel_scratch(P, (size_t) packed_size(width, type, K, N), "the wide matmul's packed columns")) return false;
    pack(width, x, ldx, K, N, type, P.data(), 0, (N + width - 1) / width);
    ggml_tensor t{};  // a view of W for gemm(): type, row size, shape
    t.type = type;
    t.ne[0] = K;
    t.ne[1] = r1;
    t.nb[1] = w_row_bytes;
    t.data = const_cast<void *>(W);
    return gemm(width, &t, P.data(), N, y, ldy, r0, r1);
}

ggml_tensor * matmul_wide(const build_context & b, ggml_tensor * W, ggml_tensor * x) {
    const int width = width_at(isa_in_use());  // once: a set_isa between two reads cannot mix levels
    if (width == 0 || !b.own_kernels() || x->ne[1] <= k_matmul_max_cols || !wide_type(W->type, W->ne[0]) ||
        !matmul_op_supported(W, x))
        return nullptr;
    void * args = op_args(width, W->type);
    ggml_tensor * xs[1] = {x};
    ggml_tensor * P = ggml_custom_4d(b.ctx, GGML_TYPE_I8, packed_size(width, W->type, x->ne[0], x->ne[1]), 1, 1, 1, xs, 1,
                                     pack_fn, GGML_N_TASKS_MAX, args);
    ggml_set_name(P, "q8_pack");
    ggml_tensor * srcs[2] = {W, P};
    ggml_tensor * y = ggml_custom_4d(b.ctx, GGML_TYPE_F32, W->ne[1], x->ne[1], 1, 1, srcs, 2, wide_fn, GGML_N_TASKS_MAX, args);
    ggml_set_name(y, "matmul_wide");
    return y;
}

void matmul_wide_rows(const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                      int64_t ldy, int64_t K, int64_t M, int64_t N, const std::string & isa) {
    DFN_REQUIRE(q8_kind_of(type) != q8_kind::none, "matmul", "the wide matmul takes Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K, not ",
                ggml_type_name(type));
    DFN_REQUIRE(wide_type(type, K) && K > 0 && M > 0 && N > 0 && ldy == M, "matmul", "bad shape K = ",
                K, ", M = ", M, ", N = ", N);
    int width = 0;
    if (isa.empty()) width = width_at(isa_in_use());
    else if (isa == "avx512f") width = isa_cpu_best() == isa_level::avx512 && width_at(isa_level::avx512) == 16 ? 16 : 0;
    else if (isa == "avx2") width = isa_cpu_best() >= isa_level::avx2 ? width_at(isa_level::avx2) : 0;  // 8
    else throw input_error(cat("[matmul] the wide matmul runs at 'avx512f' or 'avx2', not '", isa, "'"));
    DFN_REQUIRE(width > 0, "matmul", "the wide matmul", isa.empty() ? "" : cat(" at ", isa),
                " cannot run on this CPU (it needs AVX-512 VNNI or AVX2)");
    if (!matmul_wide_span(width, W, type, w_row_bytes, x, ldx, y, ldy, K, N, 0, M)) throw_kernel_oom("matmul");
}

}  // namespace dfn
