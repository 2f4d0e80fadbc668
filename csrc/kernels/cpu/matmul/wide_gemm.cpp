// The wide Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K GEMM on AVX-512 VNNI or AVX2 (wide_gemm.h has the
// layout and the math).
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
constexpr int k_tile_rows = 8;  // rows per tile on AVX-512 (8 int32 + 8 float accumulators)
constexpr int k_tile_rows_avx2 = 4;  // on AVX2 (16 ymm registers)
constexpr int k_kq_tile_rows = 4;  // K-quants, both levels (per row: the group sums, S, M, the lanes)

template <int G>
int64_t packed_bytes(int64_t K, int64_t N) { return (N + G - 1) / G * (K / 32) * group_bytes<G>; }

// The offset the pack's biases take off: the unsigned codes' (AVX-512 VNNI: Q4_0 nibbles 8, Q8_0
// xor 0x80 128); AVX2 multiplies Q8_0 as |w| by a signed by w, which needs none.
int code_offset(ggml_type type, int G) { return type == GGML_TYPE_Q4_0 ? 8 : G == 16 ? 128 : 0; }

#if DFN_X86_GCC
namespace wide512 {  // below, in 512-bit registers: the same codes and scales as the scalar functions
float quantize_q8_0_block_avx512(const float * x, int8_t * q, int32_t & sum);
float quantize_q8_K_block_avx512(const float * x, int8_t * q, int16_t * bsums);
}  // namespace wide512
namespace wide256 {  // the same in 256-bit registers
float quantize_q8_0_block_avx2(const float * x, int8_t * q, int32_t & sum);
float quantize_q8_K_block_avx2(const float * x, int8_t * q, int16_t * bsums);
}  // namespace wide256
#endif

// quantize_q8_0_block, and the codes' sum; width 16 / 8: its AVX-512 / AVX2 form (the GEMM's
// level: the CPU has it).
inline float quantize_q8_0_summed(const float * x, int8_t * q, int32_t & sum, int width) {
#if DFN_X86_GCC
    if (width == 16) return wide512::quantize_q8_0_block_avx512(x, q, sum);
    if (width == 8) return wide256::quantize_q8_0_block_avx2(x, q, sum);
#else
    (void) width;
#endif
    const float d = quantize_q8_0_block(x, q);
    sum = 0;
    for (int k = 0; k < 32; ++k) sum += q[k];
    return d;
}

// quantize_q8_K_block; width 16 / 8: its AVX-512 / AVX2 form.
inline float quantize_q8_K(const float * x, int8_t * q, int16_t * bsums, int width) {
#if DFN_X86_GCC
    if (width == 16) return wide512::quantize_q8_K_block_avx512(x, q, bsums);
    if (width == 8) return wide256::quantize_q8_K_block_avx2(x, q, bsums);
#else
    (void) width;
#endif
    return quantize_q8_K_block(x, q, bsums);
}

// Groups [g0, g1) of x's N columns into P (wide_gemm.h: pack).
template <int G>
void pack_groups(const float * x, int64_t ldx, int64_t K, int64_t N, int off, uint8_t * P, int64_t g0, int64_t g1) {
    const int64_t nb = K / 32;
    alignas(64) int8_t q[32];
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t c = 0; c < G; ++c) {
            const int64_t n = g * G + c;
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t * blk = P + (g * nb + b) * group_bytes<G>;
                float d = 0.0f;
                int32_t sum = 0;
                if (n < N) d = quantize_q8_0_summed(x + n * ldx + 32 * b, q, sum, G);
                else std::memset(q, 0, sizeof(q));
                for (int j = 0; j < 8; ++j) std::memcpy(blk + 4 * G * j + 4 * c, q + 4 * j, 4);
                const int32_t bias = -off * sum;
                std::memcpy(blk + bias_at<G> + 4 * c, &bias, 4);
                std::memcpy(blk + scale_at<G> + 4 * c, &d, 4);
            }
        }
    }
}

// Q4_K / Q6_K: the packed layout for groups of G columns per superblock of 256 (activations as
// Q8_K): 64 chunks of 4 G code bytes (chunk c: codes 4 c .. 4 c + 3, lane = column), then 8 pairs
// of int16 lanes (pair p: the sums of codes 32 p .. 32 p + 15 and 32 p + 16 .. 32 p + 31, Q8_K's
// bsums 2 p and 2 p + 1, per column), then G float scales da.
template <int G> constexpr int64_t kq_group_bytes = 292 * G;
template <int G> constexpr int64_t kq_bsum_at = 256 * G;
template <int G> constexpr int64_t kq_scale_at = 288 * G;

template <int G>
int64_t kq_packed_bytes(int64_t K, int64_t N) { return (N + G - 1) / G * (K / 256) * kq_group_bytes<G>; }

// Groups [g0, g1) of x's N columns into P for K-quant weights (ggml's quantize_row_q8_K_ref).
template <int G>
void kq_pack_groups(const float * x, int64_t ldx, int64_t K, int64_t N, uint8_t * P, int64_t g0, int64_t g1) {
    const int64_t nsb = K / 256;
    alignas(64) int8_t q[256];
    int16_t bsums[16];
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t c = 0; c < G; ++c) {
            const int64_t n = g * G + c;
            for (int64_t s = 0; s < nsb; ++s) {
                uint8_t * blk = P + (g * nsb + s) * kq_group_bytes<G>;
                float d = 0.0f;
                if (n < N) {
                    d = quantize_q8_K(x + n * ldx + 256 * s, q, bsums, G);
                } else {
                    std::memset(q, 0, sizeof(q));
                    std::memset(bsums, 0, sizeof(bsums));
                }
                for (int j = 0; j < 64; ++j) std::memcpy(blk + 4 * G * j + 4 * c, q + 4 * j, 4);
                for (int p = 0; p < 8; ++p) std::memcpy(blk + kq_bsum_at<G> + 4 * G * p + 4 * c, bsums + 2 * p, 4);
                std::memcpy(blk + kq_scale_at<G> + 4 * c, &d, 4);
            }
        }
    }
}

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
#endif

#if DFN_X86_GCC
bool cpu_has_vnni() {
    static const bool ok = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }();
    return ok;
}

// ---- AVX-512 VNNI: groups of 16 columns, tiles of 8 rows ---------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
// GCC 12 flags the undefined upper half inside its own _mm512 intrinsics' headers
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace wide512 {

// quantize_q8_0_block (quantize_act.h) on 512 bits: the same operations per value (|x| max, v = x * id
// rounded half away from zero by truncation and the exact remainder), so the same codes and scale;
// also returns the codes' sum. A block holding NaN or Inf: codes 0 and a NaN scale, as there.
float quantize_q8_0_block_avx512(const float * x, int8_t * q, int32_t & sum) {
    const __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
    const __mmask16 fin0 = _mm512_cmp_ps_mask(_mm512_sub_ps(a0, a0), _mm512_setzero_ps(), _CMP_EQ_OQ);
    const __mmask16 fin1 = _mm512_cmp_ps_mask(_mm512_sub_ps(a1, a1), _mm512_setzero_ps(), _CMP_EQ_OQ);
    if ((fin0 & fin1) != 0xFFFF) {
        std::memset(q, 0, 32);
        sum = 0;
        return quantize_q8_0_block(x, q);  // NaN, codes 0
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f), mhalf = _mm512_set1_ps(-0.5f);
    __m512i qs[2];
    for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_mul_ps(h ? a1 : a0, vid);
        const __m512i t = _mm512_cvttps_epi32(v);
        const __m512 frac = _mm512_sub_ps(v, _mm512_cvtepi32_ps(t));
        __m512i r = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask(frac, half, _CMP_GE_OQ), t, _mm512_set1_epi32(1));
        r = _mm512_mask_sub_epi32(r, _mm512_cmp_ps_mask(frac, mhalf, _CMP_LE_OQ), r, _mm512_set1_epi32(1));
        qs[h] = r;
        _mm_storeu_si128((__m128i *) (q + 16 * h), _mm512_cvtepi32_epi8(r));
    }
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qs[0], qs[1]));
    return half_to_float(ggml_fp32_to_fp16(d));
}

// quantize_q8_K_block (quantize_act.h) on 512 bits: max = the first x of largest |x|, iscale =
// -127 / max, q = min(127, round-half-even(iscale * x)) (vcvtps2dq under the default rounding: what
// nearest_int computes for |v| < 2^22), the sums of 16 codes, d = 1 / iscale. Non-finite or all-zero
// superblocks go to the scalar function (codes 0; d NaN or 0).
float quantize_q8_K_block_avx512(const float * x, int8_t * q, int16_t * bsums) {
    __m512 a[16];
    __mmask16 fin = 0xFFFF;
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) {
        a[i] = _mm512_loadu_ps(x + 16 * i);
        fin &= _mm512_cmp_ps_mask(_mm512_sub_ps(a[i], a[i]), _mm512_setzero_ps(), _CMP_EQ_OQ);
        m = _mm512_max_ps(m, _mm512_abs_ps(a[i]));
    }
    const float amax = _mm512_reduce_max_ps(m);
    if (fin != 0xFFFF || amax == 0.0f) return quantize_q8_K_block(x, q, bsums);
    float max = 0.0f;
    for (int i = 0; i < 16; ++i) {  // the first value whose |x| is amax, with its sign
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(a[i]), _mm512_set1_ps(amax), _CMP_EQ_OQ);
        if (hit) {
            max = x[16 * i + __builtin_ctz((unsigned) hit)];
            break;
        }
    }
    const float iscale = -127.0f / max;
    const __m512 vs = _mm512_set1_ps(iscale);
    for (int i = 0; i < 16; ++i) {
        const __m512i r = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(vs, a[i])), _mm512_set1_epi32(127));
        _mm_storeu_si128((__m128i *) (q + 16 * i), _mm512_cvtepi32_epi8(r));
        bsums[i] = (int16_t) _mm512_reduce_add_epi32(r);
    }
    return 1.0f / iscale;
}

// acc[i] (lane c: column c0 + c of row r + i) into y[(c0 + c) ldy + r + i] for the first cols
// columns: through a copy on the stack, one store of the RR rows per column (a scatter of each row
// wrote 16 lines, 4 bytes each: a third of a 16-column verify's matmul time went there).
template <int RR>
inline void store_tile(const __m512 * acc, float * y, int64_t ldy, int64_t r, int64_t c0, int64_t cols) {
    alignas(64) float tmp[RR][16];
    for (int i = 0; i < RR; ++i) _mm512_store_ps(tmp[i], acc[i]);
    const __m256i idx = _mm256_set_epi32(112, 96, 80, 64, 48, 32, 16, 0);  // tmp[i][c] - tmp[0][c]
    const __mmask8 rows = (__mmask8) ((1u << RR) - 1);
    for (int64_t c = 0; c < cols; ++c) {
        const __m256 v = _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), rows, idx, &tmp[0][c], 4);
        _mm256_mask_storeu_ps(y + (c0 + c) * ldy + r, rows, v);
    }
}

// Rows r .. r + RR - 1 against every group of P: y[n * ldy + r + i].
template <ggml_type T, int RR>
void gemm_tile(const uint8_t * W, size_t w_row_bytes, int64_t nb, const uint8_t * P, int64_t N, float * y, int64_t ldy,
               int64_t r, uint8_t * U, float * DW) {
    unpack_rows<T, RR, true>(W, w_row_bytes, nb, r, U, DW);
    for (int64_t g = 0; g * 16 < N; ++g) {
        __m512 acc[RR];
        for (int i = 0; i < RR; ++i) acc[i] = _mm512_setzero_ps();
        const uint8_t * pg = P + g * nb * group_bytes<16>;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t * pb = pg + b * group_bytes<16>;
            __m512i s[RR];
            const __m512i bias = _mm512_loadu_si512((const void *) (pb + bias_at<16>));
            for (int i = 0; i < RR; ++i) s[i] = bias;
            for (int j = 0; j < 8; ++j) {
                const __m512i a = _mm512_loadu_si512((const void *) (pb + 64 * j));
                for (int i = 0; i < RR; ++i) {
                    int32_t w4;
                    std::memcpy(&w4, U + (i * nb + b) * 32 + 4 * j, 4);
                    s[i] = _mm512_dpbusd_epi32(s[i], _mm512_set1_epi32(w4), a);
                }
            }
            const __m512 da = _mm512_loadu_ps((const float *) (pb + scale_at<16>));
            for (int i = 0; i < RR; ++i) {
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(DW[i * nb + b]), da);
                acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s[i]), acc[i]);
            }
        }
        store_tile<RR>(acc, y, ldy, r, g * 16, std::min<int64_t>(16, N - g * 16));
    }
}

template <ggml_type T>
__attribute__((noinline)) void gemm_rows(const uint8_t * W, size_t w_row_bytes, int64_t K, const uint8_t * P, int64_t N,
                                         float * y, int64_t ldy, int64_t r0, int64_t r1, uint8_t * U, float * DW) {
    by_row_tiles<k_tile_rows>(r0, r1, [&](int64_t r, auto rows) {
        gemm_tile<T, decltype(rows)::value>(W, w_row_bytes, K / 32, P, N, y, ldy, r, U, DW);
    });
}

// K-quant rows r .. r + RR - 1 against every group, per superblock: each scale group's exact code
// sums t (Q4_K / Q5_K: 8 sub-blocks of 8 chunks; Q6_K: 16 groups of 4), S = sum sc t; M = sum over
// the 8 bsum pairs (vpdpwssd); then Q4_K / Q5_K lane = fmaf(fl(d * da), S, lane),
// lane = fmaf(fl(-dmin * da), M, lane); Q6_K lane = fmaf(fl(d * da), S - 32 M, lane) (the codes'
// offset 32 times sum sc bsum).
template <ggml_type T, int RR>
void kq_tile(const uint8_t * W, size_t w_row_bytes, int64_t nsb, const uint8_t * P, int64_t N, float * y, int64_t ldy,
             int64_t r, kq_unpacked * U) {
    constexpr int n_groups = T == GGML_TYPE_Q6_K ? 16 : 8, chunks = 64 / n_groups;
    kq_unpack_rows<T, RR>(W, w_row_bytes, nsb, r, U);
    for (int64_t g = 0; g * 16 < N; ++g) {
        __m512 acc[RR];
        for (int i = 0; i < RR; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t s = 0; s < nsb; ++s) {
            const uint8_t * pb = P + (g * nsb + s) * kq_group_bytes<16>;
            __m512i S[RR], M[RR];
            for (int i = 0; i < RR; ++i) S[i] = M[i] = _mm512_setzero_si512();
            for (int j = 0; j < n_groups; ++j) {
                __m512i t[RR];
                for (int i = 0; i < RR; ++i) t[i] = _mm512_setzero_si512();
                for (int c = chunks * j; c < chunks * (j + 1); ++c) {
                    const __m512i a = _mm512_loadu_si512((const void *) (pb + 64 * c));
                    for (int i = 0; i < RR; ++i) {
                        int32_t w4;
                        std::memcpy(&w4, U[i * nsb + s].u + 4 * c, 4);
                        t[i] = _mm512_dpbusd_epi32(t[i], _mm512_set1_epi32(w4), a);
                    }
                }
                for (int i = 0; i < RR; ++i)
                    S[i] = _mm512_add_epi32(S[i], _mm512_mullo_epi32(t[i], _mm512_set1_epi32(U[i * nsb + s].sc[j])));
            }
            for (int p = 0; p < 8; ++p) {
                const __m512i bs = _mm512_loadu_si512((const void *) (pb + kq_bsum_at<16> + 64 * p));
                for (int i = 0; i < RR; ++i) M[i] = _mm512_dpwssd_epi32(M[i], bs, _mm512_set1_epi32(U[i * nsb + s].pair[p]));
            }
            const __m512 da = _mm512_loadu_ps((const float *) (pb + kq_scale_at<16>));
            for (int i = 0; i < RR; ++i) {
                const kq_unpacked & x = U[i * nsb + s];
                const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(x.d), da);
                if constexpr (T == GGML_TYPE_Q6_K) {
                    acc[i] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_sub_epi32(S[i], _mm512_slli_epi32(M[i], 5))), acc[i]);
                } else {
                    acc[i] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(S[i]), acc[i]);
                    const __m512 dm = _mm512_castsi512_ps(_mm512_xor_si512(  // -fl(dmin * da), as the rows kernels
                        _mm512_castps_si512(_mm512_mul_ps(_mm512_set1_ps(x.dmin), da)), _mm512_set1_epi32(INT32_MIN)));
                    acc[i] = _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(M[i]), acc[i]);
                }
            }
        }
        store_tile<RR>(acc, y, ldy, r, g * 16, std::min<int64_t>(16, N - g * 16));
    }
}

template <ggml_type T>
__attribute__((noinline)) void kq_rows(const uint8_t * W, size_t w_row_bytes, int64_t K, const uint8_t * P, int64_t N,
                                       float * y, int64_t ldy, int64_t r0, int64_t r1, kq_unpacked * U) {
    by_row_tiles<k_kq_tile_rows>(r0, r1, [&](int64_t r, auto rows) {
        kq_tile<T, decltype(rows)::value>(W, w_row_bytes, K / 256, P, N, y, ldy, r, U);
    });
}

}  // namespace wide512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// ---- AVX2: groups of 8 columns, tiles of 4 rows; maddubs + madd for the block sums -------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace wide256 {

// 8 int32 lanes of each of a, b (values in -127..127) as 16 int8, in order.
inline __m128i pack_epi8(__m256i a, __m256i b) {
    const __m256i w = _mm256_packs_epi32(a, b);  // a0-3 b0-3 | a4-7 b4-7 (int16)
    const __m256i y = _mm256_permute4x64_epi64(w, 0xD8);  // a0-3 a4-7 b0-3 b4-7
    return _mm_packs_epi16(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
}

inline float hmax_ps(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

inline bool all_finite(__m256 v) {  // x - x is 0 for every finite x, NaN otherwise
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0xFF;
}

// quantize_q8_0_block (quantize_act.h) on 256 bits, as wide512's form: the same operations per value
// (|x| max, v = x * id rounded half away from zero by truncation and the exact remainder), so the
// same codes and scale; also returns the codes' sum. NaN / Inf: the scalar function's codes 0, NaN.
float quantize_q8_0_block_avx2(const float * x, int8_t * q, int32_t & sum) {
    __m256 a[4];
    bool fin = true;
    __m256 m = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < 4; ++i) {
        a[i] = _mm256_loadu_ps(x + 8 * i);
        fin = fin && all_finite(a[i]);
        m = _mm256_max_ps(m, _mm256_and_ps(a[i], abs));
    }
    if (!fin) {
        std::memset(q, 0, 32);
        sum = 0;
        return quantize_q8_0_block(x, q);  // NaN, codes 0
    }
    const float d = hmax_ps(m) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f), mhalf = _mm256_set1_ps(-0.5f);
    __m256i r[4];
    for (int i = 0; i < 4; ++i) {
        const __m256 v = _mm256_mul_ps(a[i], vid);
        const __m256i t = _mm256_cvttps_epi32(v);
        const __m256 frac = _mm256_sub_ps(v, _mm256_cvtepi32_ps(t));
        // the compares' all-ones lanes are -1: subtracting adds 1, adding subtracts 1
        r[i] = _mm256_sub_epi32(t, _mm256_castps_si256(_mm256_cmp_ps(frac, half, _CMP_GE_OQ)));
        r[i] = _mm256_add_epi32(r[i], _mm256_castps_si256(_mm256_cmp_ps(frac, mhalf, _CMP_LE_OQ)));
    }
    _mm_storeu_si128((__m128i *) q, pack_epi8(r[0], r[1]));
    _mm_storeu_si128((__m128i *) (q + 16), pack_epi8(r[2], r[3]));
    sum = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
    return half_to_float(ggml_fp32_to_fp16(d));
}

// quantize_q8_K_block on 256 bits, as wide512's form (iscale = -127 / the first value of largest
// |x|, codes min(127, round-half-even(iscale x)) by vcvtps2dq).
float quantize_q8_K_block_avx2(const float * x, int8_t * q, int16_t * bsums) {
    bool fin = true;
    __m256 m = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < 32; ++i) {
        const __m256 a = _mm256_loadu_ps(x + 8 * i);
        fin = fin && all_finite(a);
        m = _mm256_max_ps(m, _mm256_and_ps(a, abs));
    }
    const float amax = hmax_ps(m);
    if (!fin || amax == 0.0f) return quantize_q8_K_block(x, q, bsums);
    float max = 0.0f;
    for (int i = 0; i < 32; ++i) {  // the first value whose |x| is amax, with its sign
        const __m256 a = _mm256_loadu_ps(x + 8 * i);
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(a, abs), _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hit) {
            max = x[8 * i + __builtin_ctz((unsigned) hit)];
            break;
        }
    }
    const float iscale = -127.0f / max;
    const __m256 vs = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (int i = 0; i < 16; ++i) {
        const __m256i r0 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + 16 * i))), top);
        const __m256i r1 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + 16 * i + 8))), top);
        _mm_storeu_si128((__m128i *) (q + 16 * i), pack_epi8(r0, r1));
        bsums[i] = (int16_t) hsum8_epi32(_mm256_add_epi32(r0, r1));
    }
    return 1.0f / iscale;
}

// acc[i] (lane c: column c0 + c of row r + i) into y[(c0 + c) ldy + r + i] for the first cols
// columns: one store of the RR (<= 4) rows per column, as wide512's store_tile.
template <int RR>
inline void store_tile(const __m256 * acc, float * y, int64_t ldy, int64_t r, int64_t c0, int64_t cols) {
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

template <ggml_type T, int RR>
void gemm_tile(const uint8_t * W, size_t w_row_bytes, int64_t nb, const uint8_t * P, int64_t N, float * y, int64_t ldy,
               int64_t r, uint8_t * U, float * DW) {
    unpack_rows<T, RR, false>(W, w_row_bytes, nb, r, U, DW);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g * 8 < N; ++g) {
        __m256 acc[RR];
        for (int i = 0; i < RR; ++i) acc[i] = _mm256_setzero_ps();
        const uint8_t * pg = P + g * nb * group_bytes<8>;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t * pb = pg + b * group_bytes<8>;
            const __m256i bias = _mm256_loadu_si256((const __m256i *) (pb + bias_at<8>));
            __m256i s[RR];
            if constexpr (T == GGML_TYPE_Q4_0) {
                // pairs nibble x a are at most 2 x 15 x 127 = 3810, so 8 chunks' pairs sum in int16 (<= 30480)
                __m256i s16[RR];
                for (int i = 0; i < RR; ++i) s16[i] = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *) (pb + 32 * j));
                    for (int i = 0; i < RR; ++i) {
                        int32_t w4;
                        std::memcpy(&w4, U + (i * nb + b) * 32 + 4 * j, 4);
                        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(_mm256_set1_epi32(w4), a));
                    }
                }
                for (int i = 0; i < RR; ++i) s[i] = _mm256_add_epi32(_mm256_madd_epi16(s16[i], ones), bias);
            } else {
                for (int i = 0; i < RR; ++i) s[i] = bias;  // 0: no offset on this path
                for (int j = 0; j < 8; ++j) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *) (pb + 32 * j));
                    for (int i = 0; i < RR; ++i) {
                        int32_t w4;
                        std::memcpy(&w4, U + (i * nb + b) * 32 + 4 * j, 4);
                        const __m256i w = _mm256_set1_epi32(w4);
                        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
                        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p, ones));
                    }
                }
            }
            const __m256 da = _mm256_loadu_ps((const float *) (pb + scale_at<8>));
            for (int i = 0; i < RR; ++i) {
                const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(DW[i * nb + b]), da);
                acc[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s[i]), acc[i]);
            }
        }
        store_tile<RR>(acc, y, ldy, r, g * 8, std::min<int64_t>(8, N - g * 8));
    }
}

template <ggml_type T>
__attribute__((noinline)) void gemm_rows(const uint8_t * W, size_t w_row_bytes, int64_t K, const uint8_t * P, int64_t N,
                                         float * y, int64_t ldy, int64_t r0, int64_t r1, uint8_t * U, float * DW) {
    by_row_tiles<k_tile_rows_avx2>(r0, r1, [&](int64_t r, auto rows) {
        gemm_tile<T, decltype(rows)::value>(W, w_row_bytes, K / 32, P, N, y, ldy, r, U, DW);
    });
}

// K-quants as wide512's kq_tile, by maddubs + madd: pairs of code x a summed in int16 (Q4_K: a
// sub-block's 8 chunks, pairs at most 2 x 15 x 127, sums at most 30480; Q5_K: 4 chunks at a time,
// pairs at most 2 x 31 x 127, sums at most 31496; Q6_K: 2 chunks at a time, pairs at most
// 2 x 63 x 127, sums at most 32004), then one madd by the group's scale (<= 8.2e6);
// M by madd on the bsum pairs. The same exact S and M, so the same bits as wide512.
template <ggml_type T, int RR>
void kq_tile(const uint8_t * W, size_t w_row_bytes, int64_t nsb, const uint8_t * P, int64_t N, float * y, int64_t ldy,
             int64_t r, kq_unpacked * U) {
    constexpr int n_groups = T == GGML_TYPE_Q6_K ? 16 : 8, chunks = 64 / n_groups;
    // chunks whose pairs one int16 sum may hold: 32767 / (2 x 127 x the largest code) chunks
    constexpr int per_sum = T == GGML_TYPE_Q6_K ? 2 : T == GGML_TYPE_Q5_K ? 4 : 8;
    kq_unpack_rows<T, RR>(W, w_row_bytes, nsb, r, U);
    for (int64_t g = 0; g * 8 < N; ++g) {
        __m256 acc[RR];
        for (int i = 0; i < RR; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < nsb; ++s) {
            const uint8_t * pb = P + (g * nsb + s) * kq_group_bytes<8>;
            __m256i S[RR], M[RR];
            for (int i = 0; i < RR; ++i) S[i] = M[i] = _mm256_setzero_si256();
            for (int j = 0; j < n_groups; ++j) {
                for (int c0 = chunks * j; c0 < chunks * (j + 1); c0 += per_sum) {
                    __m256i t[RR];
                    for (int i = 0; i < RR; ++i) t[i] = _mm256_setzero_si256();
                    for (int c = c0; c < c0 + per_sum; ++c) {
                        const __m256i a = _mm256_loadu_si256((const __m256i *) (pb + 32 * c));
                        for (int i = 0; i < RR; ++i) {
                            int32_t w4;
                            std::memcpy(&w4, U[i * nsb + s].u + 4 * c, 4);
                            t[i] = _mm256_add_epi16(t[i], _mm256_maddubs_epi16(_mm256_set1_epi32(w4), a));
                        }
                    }
                    for (int i = 0; i < RR; ++i)
                        S[i] = _mm256_add_epi32(S[i], _mm256_madd_epi16(t[i], _mm256_set1_epi16((int16_t) U[i * nsb + s].sc[j])));
                }
            }
            for (int p = 0; p < 8; ++p) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *) (pb + kq_bsum_at<8> + 32 * p));
                for (int i = 0; i < RR; ++i)
                    M[i] = _mm256_add_epi32(M[i], _mm256_madd_epi16(bs, _mm256_set1_epi32(U[i * nsb + s].pair[p])));
            }
            const __m256 da = _mm256_loadu_ps((const float *) (pb + kq_scale_at<8>));
            for (int i = 0; i < RR; ++i) {
                const kq_unpacked & x = U[i * nsb + s];
                const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(x.d), da);
                if constexpr (T == GGML_TYPE_Q6_K) {
                    acc[i] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(_mm256_sub_epi32(S[i], _mm256_slli_epi32(M[i], 5))), acc[i]);
                } else {
                    acc[i] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(S[i]), acc[i]);
                    const __m256 dm = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(x.dmin), da), _mm256_set1_ps(-0.0f));
                    acc[i] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(M[i]), acc[i]);
                }
            }
        }
        store_tile<RR>(acc, y, ldy, r, g * 8, std::min<int64_t>(8, N - g * 8));
    }
}

template <ggml_type T>
__attribute__((noinline)) void kq_rows(const uint8_t * W, size_t w_row_bytes, int64_t K, const uint8_t * P, int64_t N,
                                       float * y, int64_t ldy, int64_t r0, int64_t r1, kq_unpacked * U) {
    by_row_tiles<k_kq_tile_rows>(r0, r1, [&](int64_t r, auto rows) {
        kq_tile<T, decltype(rows)::value>(W, w_row_bytes, K / 256, P, N, y, ldy, r, U);
    });
}

}  // namespace wide256
#pragma GCC pop_options
#endif  // DFN_X86_GCC

// The group width of the GEMM that runs at `level` on this CPU: 16 (AVX-512 with VNNI), 8 (AVX2,
// also AVX-512 without VNNI), 0 (none: portable, or not x86).
int width_at(isa_level level) {
#if DFN_X86_GCC
    if (level == isa_level::avx512 && cpu_has_vnni()) return 16;
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
    } else if (!kernel_scratch(U, (size_t) (k_tile_rows * (K / 32) * 32), "the wide matmul's unpacked rows") ||
               !kernel_scratch(DW, (size_t) (k_tile_rows * (K / 32)), "the wide matmul's row scales")) {
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
    // the quantizers' forms at the width's level (pack_groups / kq_pack_groups pass G)
    if (q8_kind_of(type) == q8_kind::q8_K) {
        if (width == 16) kq_pack_groups<16>(x, ldx, K, N, P, g0, g1);
        else kq_pack_groups<8>(x, ldx, K, N, P, g0, g1);
    } else if (width == 16) {
        pack_groups<16>(x, ldx, K, N, code_offset(type, 16), P, g0, g1);
    } else {
        pack_groups<8>(x, ldx, K, N, code_offset(type, 8), P, g0, g1);
    }
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
    const int64_t tiles = (M + k_tile_rows - 1) / k_tile_rows;
    const int64_t r0 = std::min(M, tiles * ith / nth * k_tile_rows);
    const int64_t r1 = std::min(M, tiles * (ith + 1) / nth * k_tile_rows);
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
