// The batch-invariant matmul (matmul.h: the contract, the math and the family's map): each ISA's
// namespace with the primitives its .inc files take, the choice of path and level per call
// (rows_on), and the ggml op.
#include "kernels/cpu/matmul/matmul.h"
#include "base/alloc.h"
#include "kernels/cpu/matmul/blocks.h"
#include "kernels/cpu/matmul/quantize_act.h"

#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/matmul/wide_gemm.h"
#include "kernels/cpu/vmath.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if DFN_X86_GCC
#include <immintrin.h>
#endif

namespace dfn {

// The 32 signed codes of block b of a Q8_0 / Q4_0 row (Q4_0: q - 8, low nibbles first).
static inline void block_codes(ggml_type type, const uint8_t * w, int64_t b, int8_t * c) {
    if (type == GGML_TYPE_Q8_0) {
        std::memcpy(c, ((const blk_q8_0 *) w)[b].qs, 32);
    } else {
        const uint8_t * q = ((const blk_q4_0 *) w)[b].qs;
        for (int l = 0; l < 16; ++l) {
            c[l] = (int8_t) ((q[l] & 0xF) - 8);
            c[l + 16] = (int8_t) ((q[l] >> 4) - 8);
        }
    }
}

// ---- portable: 16 lanes in an array, fmaf per lane ------------------------------------------
namespace isa_portable {
struct vec {
    float l[16];
};
static inline vec vzero() { return vec{}; }
static inline vec vload(const float * p) {
    vec v;
    std::memcpy(v.l, p, sizeof(v.l));
    return v;
}
static inline void vstore(float * p, const vec & v) { std::memcpy(p, v.l, sizeof(v.l)); }
static inline vec vload(const uint16_t * p) {
    vec v;
    for (int i = 0; i < 16; ++i) v.l[i] = ggml_fp16_to_fp32(p[i]);
    return v;
}
static inline vec vfma(const vec & a, const vec & b, const vec & c) {
    vec r;
    for (int i = 0; i < 16; ++i) r.l[i] = std::fmaf(a.l[i], b.l[i], c.l[i]);
    return r;
}
static inline float vsum(const vec & v) { return sum16(v.l); }  // the fixed lane tree (vmath.h)
static inline vec vmul(const vec & a, const vec & b) {
    vec r;
    for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] * b.l[i];
    return r;
}
static inline float h2f(ggml_fp16_t h) { return half_to_float(h); }
#define TILE_RM 2
#define TILE_RN 4
#define TILE_RM1 4
#include "kernels/cpu/matmul/tile.inc"
#include "kernels/cpu/matmul/dequant.inc"
#include "kernels/cpu/matmul/int_portable.inc"
#undef TILE_RM
#undef TILE_RN
#undef TILE_RM1
#define KQ_RR1 1
#define KQ_RR 1
#define KQ_RC 4
#include "kernels/cpu/matmul/kq_rows.inc"
#undef KQ_RR1
#undef KQ_RR
#undef KQ_RC
}  // namespace isa_portable

#if DFN_X86_GCC
// The lane sum shared by the x86 paths: 8 + 8 lanes in, the portable tree from there.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline float sum_halves(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);                                                // i + (i + 8)
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // i + (i + 4)
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                 // i + (i + 2)
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                         // 0 + 1
}

// ---- AVX2: two 8-lane halves per accumulator (16 ymm registers) -----------------------------
namespace isa_avx2 {
struct vec {
    __m256 lo, hi;
};
static inline vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vec vload(const float * p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float * p, const vec & v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline vec vload(const uint16_t * p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 8)))};
}
static inline vec vfma(const vec & a, const vec & b, const vec & c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline float vsum(const vec & v) { return sum_halves(v.lo, v.hi); }
static inline vec vmul(const vec & a, const vec & b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline float h2f(ggml_fp16_t h) { return _cvtsh_ss(h); }
// vsum of 4 accumulators at once, transposed (as the AVX-512 tile_sums, on 8-lane halves: lo + hi
// is vsum's l + (l + 8)); lanes 0, 1 of the result hold the sums of in[0], in[2], lanes 4, 5 those
// of in[1], in[3].
static inline __m256 sum_l4(__m256 a, __m256 b) {  // [a's l + (l + 4) | b's], l < 4
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
static inline __m256 vsum4(const vec (&in)[4]) {
    __m256 s8[4];
    for (int m = 0; m < 4; ++m) s8[m] = _mm256_add_ps(in[m].lo, in[m].hi);
    const __m256 p = sum_l4(s8[0], s8[1]), q = sum_l4(s8[2], s8[3]);
    const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(v, v, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A tile's y[j * ldy + i] = vsum(acc[i][j]) by vsum4: 2 rows x 2 columns, or 4 rows x 1 column.
template <int RM, int RN>
static inline bool tile_sums(const vec (&acc)[RM][RN], float * y, int64_t ldy) {
    if constexpr (RM == 2 && RN == 2) {
        const vec in[4] = {acc[0][0], acc[0][1], acc[1][0], acc[1][1]};
        const __m256 s = vsum4(in);  // column j's rows at lanes 4 j, 4 j + 1
        _mm_storel_pi((__m64 *) y, _mm256_castps256_ps128(s));
        _mm_storel_pi((__m64 *) (y + ldy), _mm256_extractf128_ps(s, 1));
        return true;
    } else if constexpr (RM == 4 && RN == 1) {
        const vec in[4] = {acc[0][0], acc[2][0], acc[1][0], acc[3][0]};
        const __m256 s = vsum4(in);  // rows 0, 1 at lanes 0, 1; rows 2, 3 at lanes 4, 5
        _mm_storel_pi((__m64 *) y, _mm256_castps256_ps128(s));
        _mm_storel_pi((__m64 *) (y + 2), _mm256_extractf128_ps(s, 1));
        return true;
    } else {
        return false;
    }
}

// 2 x 2 tiles: 8 accumulators (two 8-lane halves each) hide the fma latency at any N (1 x 4 left a
// 2-column tile 4 chains: 160 us for F16 1024 x 1024 by 2 columns, now 93), W (2 rows x 2 halves)
// and x pinned (GCC folds x's loads otherwise) within the 16 registers
#define TILE_SUMS 1
#define TILE_PIN(v) asm("" : "+x"(v.lo), "+x"(v.hi))
#define TILE_RM 2
#define TILE_RN 2
#define TILE_RM1 4
#include "kernels/cpu/matmul/tile.inc"
#undef TILE_SUMS
#undef TILE_PIN
#include "kernels/cpu/matmul/dequant.inc"
#undef TILE_RM
#undef TILE_RN
#undef TILE_RM1
#include "kernels/cpu/matmul/q8_0_avx2.inc"
#include "kernels/cpu/matmul/q8_0_rows.inc"
#define KQ_RR1 2  // 16 ymm registers: 2 x 2 integer lane halves x KQ_RR x KQ_RC <= 8 accumulators
#define KQ_RR 1
#define KQ_RC 4
#include "kernels/cpu/matmul/kq_avx2.inc"
#include "kernels/cpu/matmul/kq_rows.inc"
#undef KQ_RR1
#undef KQ_RR
#undef KQ_RC
}  // namespace isa_avx2
#pragma GCC pop_options

// ---- AVX-512: one zmm per accumulator (32 registers: 3 x 8 accumulators + 3 rows of W + x) ---
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12 flags the undefined upper half inside _mm512_castps512_ps256 / _mm512_castps_pd.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace isa_avx512 {
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float * p) { return _mm512_loadu_ps(p); }
static inline void vstore(float * p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vload(const uint16_t * p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    return sum_halves(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline float h2f(ggml_fp16_t h) { return _cvtsh_ss(h); }

// vsum of 16 (or 8) accumulators at once, transposed: each level adds the lanes vsum adds (l and
// l + 8, then l + 4, l + 2, l + 1) for several accumulators per instruction, so every output is
// the same sum, ~3 instructions per output instead of ~9 (one thread, F16 1536 x 320 by 16
// columns: 123 -> 107 us). The lanes of the result: 4 L + e holds the sum of in[L + 4 e].
static inline vec sum_l8(vec a, vec b) {  // [a_l + a_l+8 | b_l + b_l+8], l < 8
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline vec sum_l4(vec a, vec b) {  // 128-bit lanes [a's 0 + 1, a's 2 + 3, b's 0 + 1, b's 2 + 3]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline vec sum_l2(vec a, vec b) {  // per 128-bit lane [a0 + a2, a1 + a3, b0 + b2, b1 + b3]
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline vec sum_l1(vec a, vec b) {  // per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline vec vsum16(const vec (&in)[16]) {
    vec t[8], u[4];
    for (int p = 0; p < 8; ++p) t[p] = sum_l8(in[2 * p], in[2 * p + 1]);
    for (int q = 0; q < 4; ++q) u[q] = sum_l4(t[2 * q], t[2 * q + 1]);
    return sum_l1(sum_l2(u[0], u[1]), sum_l2(u[2], u[3]));
}
static inline vec vsum8(const vec (&in)[8]) {  // lanes 4 L + e, e < 2: the sum of in[L + 4 e]
    vec t[4];
    for (int p = 0; p < 4; ++p) t[p] = sum_l8(in[2 * p], in[2 * p + 1]);
    const vec v = sum_l2(sum_l4(t[0], t[1]), sum_l4(t[2], t[3]));
    return sum_l1(v, v);
}

// The first R of v's 4 lanes at y (never a byte past them: the next rows may be another thread's).
template <int R>
static inline void store_rows(float * y, __m128 v) {
    if constexpr (R == 1) _mm_store_ss(y, v);
    if constexpr (R == 4) _mm_storeu_ps(y, v);
    if constexpr (R == 2 || R == 3) _mm_storel_pi((__m64 *) y, v);
    if constexpr (R == 3) _mm_store_ss(y + 2, _mm_movehl_ps(v, v));
}

// A tile's outputs y[j * ldy + i] = vsum(acc[i][j]) by vsum16 / vsum8 (what tile.inc
// calls): up to 4 rows x 4 columns per vsum16 (rows padded with zero accumulators, whose sums
// are not stored), column j's rows stored from 128-bit lane j; 8 rows x 1 column by vsum8. False
// (the caller sums each output): a shape not covered.
template <int RM, int RN>
static inline bool tile_sums(const vec (&acc)[RM][RN], float * y, int64_t ldy) {
    if constexpr (RM >= 1 && RM <= 4 && RN >= 2) {
        for (int j0 = 0; j0 < RN; j0 += 4) {
            vec in[16];  // in[4 i + c] = acc[i][j0 + c]: lane c, element i of the sums
            for (int i = 0; i < 4; ++i)
                for (int c = 0; c < 4; ++c) in[4 * i + c] = i < RM && j0 + c < RN ? acc[i][j0 + c] : vzero();
            const vec s = vsum16(in);
            store_rows<RM>(y + j0 * ldy, _mm512_castps512_ps128(s));
            if (j0 + 1 < RN) store_rows<RM>(y + (j0 + 1) * ldy, _mm512_extractf32x4_ps(s, 1));
            if (j0 + 2 < RN) store_rows<RM>(y + (j0 + 2) * ldy, _mm512_extractf32x4_ps(s, 2));
            if (j0 + 3 < RN) store_rows<RM>(y + (j0 + 3) * ldy, _mm512_extractf32x4_ps(s, 3));
        }
        return true;
    } else if constexpr (RM == 8 && RN == 1) {
        vec in[8];
        for (int i = 0; i < 8; ++i) in[i] = acc[i][0];
        // row i sits in lane 4 (i % 4) + i / 4
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm256_storeu_ps(y, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, vsum8(in))));
        return true;
    } else {
        return false;
    }
}
#define TILE_SUMS 1
// x's vector in a register for the tile's RM fmas: GCC otherwise folds its load into each fma,
// RM loads per column vector, and the tile is load-bound (same matrix: 134 -> 123 us)
#define TILE_PIN(v) asm("" : "+v"(v))
#define TILE_RM 3
#define TILE_RN 8
#define TILE_RM1 8
// 9-12 columns: 2 x 12 (24 accumulators), each row's weights converted once: a verify of 9-12
// tokens of the 0.65B F16 model 6-13% cheaper than 3 x 8 and the rest (1 x 16 for 13-16 columns, x
// loaded once per fma, ran 10-25% slower: not taken)
#define TILE_RM12 2
#include "kernels/cpu/matmul/tile.inc"
#undef TILE_SUMS
#undef TILE_PIN
#include "kernels/cpu/matmul/dequant.inc"
#undef TILE_RM
#undef TILE_RN
#undef TILE_RM1
#undef TILE_RM12
}  // namespace isa_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
// ---- AVX-512BW integer rows (K-quants and Q8_0 kind, 64 codes per vector), used by the AVX-512
// path when present; with AVX-512 VNNI, madd + add fused (vpdpwssd) and vpdpbusd: the same int32
// sums --------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace isa_avx512bw {
#define INT_VNNI 0
#include "kernels/cpu/matmul/int_avx512.inc"
#undef INT_VNNI
}  // namespace isa_avx512bw
#pragma GCC diagnostic pop
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace isa_avx512vnni {
#define INT_VNNI 1
#include "kernels/cpu/matmul/int_avx512.inc"
#undef INT_VNNI
}  // namespace isa_avx512vnni
#pragma GCC diagnostic pop
#pragma GCC pop_options

#endif  // DFN_X86_GCC

namespace {

// portable < avx2 < avx512 (VNNI integer sums on the AVX-512 path where the CPU has them)
using isa = isa_level;  // matmul_op runs its dispatch's level (dispatch.h), never above isa_in_use()

template <typename TW>
void run_rows(isa which, const TW * W, int64_t ldw, const float * x, int64_t ldx, float * y, int64_t ldy, int64_t K,
              int64_t N, int64_t r0, int64_t r1) {
    switch (which) {
#if DFN_X86_GCC
        case isa::avx512: isa_avx512::rows(W, ldw, x, ldx, y, ldy, K, N, r0, r1); return;
        case isa::avx2: isa_avx2::rows(W, ldw, x, ldx, y, ldy, K, N, r0, r1); return;
#endif
        default: isa_portable::rows(W, ldw, x, ldx, y, ldy, K, N, r0, r1); return;
    }
}

// Columns from which the integer path multiplies through the GEMM of wide_gemm.h (groups of 16
// or 8 columns) rather than the rows kernels (lanes = rows): where the two crossed on the 0.65B
// model's verify passes (AVX-512, Intel Xeon, 2 threads; the Q8_0 kind's rows kernels take 16
// columns per pass, the K-quants' up to 13; Q6_K's GEMM, 16 scale groups per superblock, is the
// dearest) and on single matrices (AVX2, one thread, 16384 x 1024), with Q8_0's rows kernel cheaper
// per column than the others' (and its AVX2 GEMM, |w| x signed a through maddubs, dearer). Either
// gives the same bits.
int64_t wide_min_cols(int width, ggml_type type) {
    if (width == 16) return type == GGML_TYPE_Q8_0 ? 22 : type == GGML_TYPE_Q4_0 ? 16 : type == GGML_TYPE_Q6_K ? 14 : 12;
    return type == GGML_TYPE_Q8_0 ? 24 : 6;
}

// Enough F32 rows for the largest tile of any path (TILE_RM / TILE_RM1 <= 8).
constexpr int64_t k_dequant_rows = 8;

// The integer path (int_portable.inc): x quantized to Q8_0 / Q8_K here, by every thread for all N
// columns (a column's codes are the same whoever computes them). False: no scratch (noted).
bool rows_q8_on(isa which, const uint8_t * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1, bool no_vnni) {
    // wide_min_cols columns and more: the GEMM of wide_gemm.h, the same operations per output
    if (const int width = matmul_wide_width(which, no_vnni); width != 0 && N >= wide_min_cols(width, type))
        return matmul_wide_span(width, W, type, w_row_bytes, x, ldx, y, ldy, K, N, r0, r1);
    thread_local q8_acts A;
    if (!q8_quantize_acts(type, x, ldx, K, N, A)) return false;
    const bool kquant = A.kind == q8_kind::q8_K;
    (void) no_vnni;  // x86 only
    switch (which) {
#if DFN_X86_GCC
        case isa::avx512:  // 512-bit integer sums with AVX-512BW (VNNI), else the AVX2 ones
            if (cpu_has_avx512vnni() && !no_vnni) {
                if (kquant) isa_avx512vnni::rows_kq_bw(type, W, w_row_bytes, A, y, ldy, r0, r1);
                else isa_avx512vnni::rows_q8_bw(W, w_row_bytes, type, A, y, ldy, r0, r1);
            } else if (cpu_has_avx512bw()) {
                if (kquant) isa_avx512bw::rows_kq_bw(type, W, w_row_bytes, A, y, ldy, r0, r1);
                else isa_avx512bw::rows_q8_bw(W, w_row_bytes, type, A, y, ldy, r0, r1);
            } else if (kquant) {
                isa_avx2::rows_kq_any(type, W, w_row_bytes, A, y, ldy, r0, r1);
            } else {
                isa_avx2::rows_q8(W, w_row_bytes, type, A, y, ldy, r0, r1);
            }
            break;
        case isa::avx2:
            if (kquant) isa_avx2::rows_kq_any(type, W, w_row_bytes, A, y, ldy, r0, r1);
            else isa_avx2::rows_q8(W, w_row_bytes, type, A, y, ldy, r0, r1);
            break;
#endif
        default:
            if (kquant) isa_portable::rows_kq_any(type, W, w_row_bytes, A, y, ldy, r0, r1);
            else isa_portable::rows_q8(W, w_row_bytes, type, A, y, ldy, r0, r1);
            break;
    }
    return true;
}

// False (noted, thrown after the compute) when the scratch cannot be had. f32_path: a type of the
// integer path through the dequantize-to-F32 path instead (tests and benchmarks compare them);
// no_vnni: the AVX-512 integer rows without VNNI, as on a CPU that lacks it (tests).
bool rows_on(isa which, const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
             int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1, bool f32_path = false, bool no_vnni = false) {
    if (!f32_path && q8_kind_of(type) != q8_kind::none)
        return rows_q8_on(which, (const uint8_t *) W, type, w_row_bytes, x, ldx, y, ldy, K, N, r0, r1, no_vnni);
    if (type == GGML_TYPE_F16) {
        run_rows(which, (const uint16_t *) W, (int64_t) (w_row_bytes / sizeof(uint16_t)), x, ldx, y, ldy, K, N, r0, r1);
        return true;
    }
    if (type == GGML_TYPE_F32) {
        run_rows(which, (const float *) W, (int64_t) (w_row_bytes / sizeof(float)), x, ldx, y, ldy, K, N, r0, r1);
        return true;
    }
    thread_local std::vector<float> buf;
    const int64_t ldb = (K + 15) / 16 * 16;
    if (!kernel_scratch(buf, (size_t) (k_dequant_rows * ldb), "the matmul's dequantized rows")) return false;
    const uint8_t * w = (const uint8_t *) W;
    switch (which) {
#if DFN_X86_GCC
        case isa::avx512:
            isa_avx512::rows_dequant(w, w_row_bytes, isa_avx512::dequant_row_fn(type), buf.data(), ldb, x, ldx, y, ldy,
                                     K, N, r0, r1);
            break;
        case isa::avx2:
            isa_avx2::rows_dequant(w, w_row_bytes, isa_avx2::dequant_row_fn(type), buf.data(), ldb, x, ldx, y, ldy, K, N,
                                   r0, r1);
            break;
#endif
        default:
            isa_portable::rows_dequant(w, w_row_bytes, isa_portable::dequant_row_fn(type), buf.data(), ldb, x, ldx, y, ldy,
                                       K, N, r0, r1);
            break;
    }
    return true;
}

// Rows handed to a thread come in multiples of 48 (a whole number of tiles on every path: 16 rows
// on the Q8_0-kind rows, up to 8 elsewhere, 3 x 8 on the F32 path), so only the last thread runs
// partial tiles.
constexpr int64_t k_row_unit = 48;

void matmul_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * W = dst->src[0];
    const ggml_tensor * x = dst->src[1];
    const int64_t K = W->ne[0], M = W->ne[1], N = x->ne[1];
    const int64_t units = (M + k_row_unit - 1) / k_row_unit;
    const int64_t r0 = std::min(M, units * ith / nth * k_row_unit);
    const int64_t r1 = std::min(M, units * (ith + 1) / nth * k_row_unit);
    if (r0 >= r1) return;
    const float * xp = (const float *) x->data;
    int64_t ldx = (int64_t) (x->nb[1] / sizeof(float));
    if (q8_kind_of(W->type) == q8_kind::none && ((uintptr_t) xp % 64 != 0 || (ldx * sizeof(float)) % 64 != 0)) {
        // ggml aligns tensors to 32 bytes; a 64-byte x load across two cache lines costs the tile a
        // second load per fma (measured: 24 vs 33 GMAC/s at N = 8). Copy x (N x K floats) to rows on
        // 64-byte lines: the values, and so the results, are the same.
        thread_local std::vector<float> buf;
        const int64_t ld = (K + 15) / 16 * 16;
        if (!kernel_scratch(buf, (size_t) (N * ld + 16), "the matmul's aligned input")) return;  // noted; thrown after
        float * a = buf.data() + (16 - (uintptr_t) buf.data() / sizeof(float) % 16) % 16;
        for (int64_t n = 0; n < N; ++n) std::memcpy(a + n * ld, xp + n * ldx, (size_t) K * sizeof(float));
        xp = a;
        ldx = ld;
    }
    const auto * dispatch = (const matmul_dispatch *) userdata;
    const isa use = dispatch ? dispatch->isa_for(W->type, N) : isa_in_use();
    testing_matmul_delay(use);
    // false: no dequantization scratch (noted; the graph runner throws it after the compute)
    rows_on(use, W->data, W->type, W->nb[1], xp, ldx, (float *) dst->data, (int64_t) (dst->nb[1] / sizeof(float)), K,
            N, r0, r1);
}

const char * isa_name(isa which) {
    switch (which) {
        case isa::avx512: return "avx512f";
        case isa::avx2: return "avx2";
        default: return "portable";
    }
}

}  // namespace

void matmul_rows(const void * W, ggml_type w_type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                 int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1, const std::string & which, bool f32_path) {
    DFN_REQUIRE(matmul_weight_type(w_type), "matmul", "weight type ", ggml_type_name(w_type), " is not one the kernel takes");
    DFN_REQUIRE(K % ggml_blck_size(w_type) == 0, "matmul", "K = ", K, " is not a multiple of ", ggml_type_name(w_type),
                "'s block of ", ggml_blck_size(w_type));
    isa use = isa_in_use();
    const bool no_vnni = which == "avx512f-novnni";
    if (!which.empty()) {
        const std::vector<std::string> ok = matmul_isas();
        const std::string base = no_vnni ? "avx512f" : which;
        DFN_REQUIRE(std::find(ok.begin(), ok.end(), base) != ok.end(), "matmul", "instruction set '", which,
                    "' is not available here");
        use = base == "avx512f" ? isa::avx512 : base == "avx2" ? isa::avx2 : isa::portable;
    }
    if (!rows_on(use, W, w_type, w_row_bytes, x, ldx, y, ldy, K, N, r0, r1, f32_path, no_vnni)) throw_kernel_oom("matmul");
}

bool matmul_rows_at(isa_level level, const void * W, ggml_type w_type, size_t w_row_bytes, const float * x,
                    int64_t ldx, float * y, int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1) noexcept {
    return rows_on(level, W, w_type, w_row_bytes, x, ldx, y, ldy, K, N, r0, r1);
}

const char * matmul_isa() { return isa_name(isa_in_use()); }

std::vector<std::string> matmul_isas() {
    std::vector<std::string> out;
    for (isa i : {isa::avx512, isa::avx2, isa::portable}) {
        if (i <= isa_in_use()) out.push_back(isa_name(i));
    }
    return out;
}

// The block layouts above are the format's; a ggml that disagreed would be another format.
static const bool k_block_layouts_ok =
    sizeof(blk_q8_0) == ggml_type_size(GGML_TYPE_Q8_0) && sizeof(blk_q4_0) == ggml_type_size(GGML_TYPE_Q4_0) &&
    sizeof(blk_q4_K) == ggml_type_size(GGML_TYPE_Q4_K) && sizeof(blk_q5_K) == ggml_type_size(GGML_TYPE_Q5_K) &&
    sizeof(blk_q6_K) == ggml_type_size(GGML_TYPE_Q6_K);

bool matmul_weight_type(ggml_type type) {
    if (type == GGML_TYPE_F16 || type == GGML_TYPE_F32) return true;
    if (!k_block_layouts_ok) return false;
    if ((int) type < 0 || (int) type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0) return false;
    // BF16 and the quantized types, each through ggml's own dequantization (to_float)
    return (type == GGML_TYPE_BF16 || ggml_is_quantized(type)) && ggml_get_type_traits(type)->to_float != nullptr;
}

bool matmul_op_supported(const ggml_tensor * W, const ggml_tensor * x) {
    if (!matmul_weight_type(W->type)) return false;
    if (x->type != GGML_TYPE_F32) return false;
    if (W->ne[0] != x->ne[0] || W->ne[2] != 1 || W->ne[3] != 1 || x->ne[2] != 1 || x->ne[3] != 1) return false;
    if (W->nb[0] != ggml_type_size(W->type) || x->nb[0] != sizeof(float)) return false;
    if (W->nb[1] < ggml_row_size(W->type, W->ne[0]) || x->nb[1] % sizeof(float) != 0) return false;
    if ((W->type == GGML_TYPE_F16 || W->type == GGML_TYPE_F32) && W->nb[1] % ggml_type_size(W->type) != 0) return false;
    // weights in a device buffer stay with ggml (the custom op runs on the CPU)
    if (W->buffer && !ggml_backend_buffer_is_host(W->buffer)) return false;
    return true;
}

ggml_tensor * matmul_op(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x, const matmul_dispatch * dispatch) {
    ggml_tensor * args[2] = {W, x};
    ggml_tensor * y = ggml_custom_4d(ctx, GGML_TYPE_F32, W->ne[1], x->ne[1], 1, 1, args, 2, matmul_fn, GGML_N_TASKS_MAX,
                                     (void *) dispatch);
    ggml_set_name(y, "matmul");
    return y;
}

ggml_tensor * matmul(const build_context & b, ggml_tensor * W, ggml_tensor * x) {
    if (b.own_kernels() && (x->ne[1] <= k_matmul_max_cols || b.any_width) && matmul_op_supported(W, x))
        return matmul_op(b.ctx, W, x, b.dispatch);
    if (ggml_tensor * y = matmul_wide(b, W, x)) return y;  // a prompt chunk of Q4_0 / Q8_0 / Q4_K
    return ggml_mul_mat(b.ctx, W, x);
}

}  // namespace dfn
