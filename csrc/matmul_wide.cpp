// The prompt-sized Q4_0 / Q8_0 GEMM on AVX-512 VNNI (matmul_wide.h has the layout and the math).
#include "matmul_wide.h"

#include "alloc.h"
#include "common.h"
#include "cpu_isa.h"
#include "matmul.h"
#include "matmul_blocks.h"
#include "matmul_q8.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#if DFN_X86_GCC
#include <immintrin.h>
#endif

namespace dfn {

namespace {

// The packed layout for groups of G columns (matmul_wide.h with 16 replaced by G): per group and
// block, 8 chunks of 4 G code bytes, G int32 biases, G float scales.
template <int G> constexpr int64_t group_bytes = 40 * G;
template <int G> constexpr int64_t bias_at = 32 * G;
template <int G> constexpr int64_t scale_at = 36 * G;
constexpr int k_tile_rows = 8;  // rows per tile on AVX-512 (8 int32 + 8 float accumulators)
constexpr int k_tile_rows_avx2 = 4;  // on AVX2 (16 ymm registers)

template <int G>
int64_t packed_bytes(int64_t K, int64_t N) { return (N + G - 1) / G * (K / 32) * group_bytes<G>; }

// The offset the pack's biases take off: the unsigned codes' (AVX-512 VNNI: Q4_0 nibbles 8, Q8_0
// xor 0x80 128); AVX2 multiplies Q8_0 as |w| by a signed by w, which needs none.
int code_offset(ggml_type type, int G) { return type == GGML_TYPE_Q4_0 ? 8 : G == 16 ? 128 : 0; }

// Groups [g0, g1) of x's N columns into P (matmul_wide.h: pack).
template <int G>
void pack_groups(const float * x, int64_t ldx, int64_t K, int64_t N, int off, uint8_t * P, int64_t g0, int64_t g1) {
    const int64_t nb = K / 32;
    int8_t q[32];
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t c = 0; c < G; ++c) {
            const int64_t n = g * G + c;
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t * blk = P + (g * nb + b) * group_bytes<G>;
                float d = 0.0f;
                int32_t sum = 0;
                if (n < N) {
                    d = quantize_q8_0_block(x + n * ldx + 32 * b, q);
                    for (int k = 0; k < 32; ++k) sum += q[k];
                } else {
                    std::memset(q, 0, sizeof(q));
                }
                for (int j = 0; j < 8; ++j) std::memcpy(blk + 4 * G * j + 4 * c, q + 4 * j, 4);
                const int32_t bias = -off * sum;
                std::memcpy(blk + bias_at<G> + 4 * c, &bias, 4);
                std::memcpy(blk + scale_at<G> + 4 * c, &d, 4);
            }
        }
    }
}

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

// Rows r .. r + RR - 1 of W unpacked: U[i][b][32] unsigned code bytes (Q4_0 nibbles, Q8_0 codes
// xor 0x80), DW[i][b] the F32 scales.
template <ggml_type T, int RR>
inline void unpack_rows(const uint8_t * W, size_t w_row_bytes, int64_t nb, int64_t r, uint8_t * U, float * DW) {
    for (int i = 0; i < RR; ++i) {
        const uint8_t * row = W + (r + i) * w_row_bytes;
        uint8_t * u = U + i * nb * 32;
        for (int64_t b = 0; b < nb; ++b) {
            if constexpr (T == GGML_TYPE_Q4_0) {
                const blk_q4_0 & x = ((const blk_q4_0 *) row)[b];
                DW[i * nb + b] = _cvtsh_ss(x.d);
                const __m128i q = _mm_loadu_si128((const __m128i *) x.qs);
                const __m128i m = _mm_set1_epi8(0x0F);
                _mm_storeu_si128((__m128i *) (u + 32 * b), _mm_and_si128(q, m));
                _mm_storeu_si128((__m128i *) (u + 32 * b + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m));
            } else {
                const blk_q8_0 & x = ((const blk_q8_0 *) row)[b];
                DW[i * nb + b] = _cvtsh_ss(x.d);
                const __m256i q = _mm256_loadu_si256((const __m256i *) x.qs);
                _mm256_storeu_si256((__m256i *) (u + 32 * b), _mm256_xor_si256(q, _mm256_set1_epi8((char) 0x80)));
            }
        }
    }
}

// Rows r .. r + RR - 1 against every group of P: y[n * ldy + r + i].
template <ggml_type T, int RR>
void gemm_tile(const uint8_t * W, size_t w_row_bytes, int64_t nb, const uint8_t * P, int64_t N, float * y, int64_t ldy,
               int64_t r, uint8_t * U, float * DW) {
    unpack_rows<T, RR>(W, w_row_bytes, nb, r, U, DW);
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int) ldy));
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
        const __mmask16 live = (__mmask16) (N - g * 16 >= 16 ? 0xFFFF : (1u << (N - g * 16)) - 1);
        for (int i = 0; i < RR; ++i) _mm512_mask_i32scatter_ps(y + g * 16 * ldy + r + i, live, col, acc[i], 4);
    }
}

template <ggml_type T>
__attribute__((noinline)) void gemm_rows(const uint8_t * W, size_t w_row_bytes, int64_t K, const uint8_t * P, int64_t N,
                                         float * y, int64_t ldy, int64_t r0, int64_t r1, uint8_t * U, float * DW) {
    const int64_t nb = K / 32;
    int64_t r = r0;
    for (; r + k_tile_rows <= r1; r += k_tile_rows) gemm_tile<T, k_tile_rows>(W, w_row_bytes, nb, P, N, y, ldy, r, U, DW);
    for (; r < r1; ++r) gemm_tile<T, 1>(W, w_row_bytes, nb, P, N, y, ldy, r, U, DW);
}

}  // namespace wide512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// ---- AVX2: groups of 8 columns, tiles of 4 rows; maddubs + madd for the block sums -------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace wide256 {

// As wide512's, but Q8_0 keeps its signed codes (multiplied as |w| by a signed by w: maddubs takes
// one unsigned operand and saturates pairs past 32767, which 255 x 127 x 2 would reach).
template <ggml_type T, int RR>
inline void unpack_rows(const uint8_t * W, size_t w_row_bytes, int64_t nb, int64_t r, uint8_t * U, float * DW) {
    for (int i = 0; i < RR; ++i) {
        const uint8_t * row = W + (r + i) * w_row_bytes;
        uint8_t * u = U + i * nb * 32;
        for (int64_t b = 0; b < nb; ++b) {
            if constexpr (T == GGML_TYPE_Q4_0) {
                const blk_q4_0 & x = ((const blk_q4_0 *) row)[b];
                DW[i * nb + b] = _cvtsh_ss(x.d);
                const __m128i q = _mm_loadu_si128((const __m128i *) x.qs);
                const __m128i m = _mm_set1_epi8(0x0F);
                _mm_storeu_si128((__m128i *) (u + 32 * b), _mm_and_si128(q, m));
                _mm_storeu_si128((__m128i *) (u + 32 * b + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m));
            } else {
                const blk_q8_0 & x = ((const blk_q8_0 *) row)[b];
                DW[i * nb + b] = _cvtsh_ss(x.d);
                std::memcpy(u + 32 * b, x.qs, 32);
            }
        }
    }
}

template <ggml_type T, int RR>
void gemm_tile(const uint8_t * W, size_t w_row_bytes, int64_t nb, const uint8_t * P, int64_t N, float * y, int64_t ldy,
               int64_t r, uint8_t * U, float * DW) {
    unpack_rows<T, RR>(W, w_row_bytes, nb, r, U, DW);
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
        const int64_t live = std::min<int64_t>(8, N - g * 8);
        for (int i = 0; i < RR; ++i) {
            alignas(32) float out[8];
            _mm256_store_ps(out, acc[i]);
            for (int64_t c = 0; c < live; ++c) y[(g * 8 + c) * ldy + r + i] = out[c];
        }
    }
}

template <ggml_type T>
__attribute__((noinline)) void gemm_rows(const uint8_t * W, size_t w_row_bytes, int64_t K, const uint8_t * P, int64_t N,
                                         float * y, int64_t ldy, int64_t r0, int64_t r1, uint8_t * U, float * DW) {
    const int64_t nb = K / 32;
    int64_t r = r0;
    for (; r + k_tile_rows_avx2 <= r1; r += k_tile_rows_avx2)
        gemm_tile<T, k_tile_rows_avx2>(W, w_row_bytes, nb, P, N, y, ldy, r, U, DW);
    for (; r < r1; ++r) gemm_tile<T, 1>(W, w_row_bytes, nb, P, N, y, ldy, r, U, DW);
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
    const int64_t nb = W->ne[0] / 32;
    if (!kernel_scratch(U, (size_t) (k_tile_rows * nb * 32), "the wide matmul's unpacked rows") ||
        !kernel_scratch(DW, (size_t) (k_tile_rows * nb), "the wide matmul's row scales"))
        return false;
#if DFN_X86_GCC
    const auto * w = (const uint8_t *) W->data;
    const size_t rb = W->nb[1];
    const int64_t K = W->ne[0];
    const bool q8 = W->type == GGML_TYPE_Q8_0;
    if (width == 16) {
        if (q8) wide512::gemm_rows<GGML_TYPE_Q8_0>(w, rb, K, P, N, y, ldy, r0, r1, U.data(), DW.data());
        else wide512::gemm_rows<GGML_TYPE_Q4_0>(w, rb, K, P, N, y, ldy, r0, r1, U.data(), DW.data());
    } else {
        if (q8) wide256::gemm_rows<GGML_TYPE_Q8_0>(w, rb, K, P, N, y, ldy, r0, r1, U.data(), DW.data());
        else wide256::gemm_rows<GGML_TYPE_Q4_0>(w, rb, K, P, N, y, ldy, r0, r1, U.data(), DW.data());
    }
#else
    (void) width, (void) P, (void) N, (void) y, (void) ldy, (void) r0, (void) r1;
#endif
    return true;
}

void pack(int width, const float * x, int64_t ldx, int64_t K, int64_t N, ggml_type type, uint8_t * P, int64_t g0, int64_t g1) {
    if (width == 16) pack_groups<16>(x, ldx, K, N, code_offset(type, 16), P, g0, g1);
    else pack_groups<8>(x, ldx, K, N, code_offset(type, 8), P, g0, g1);
}

int64_t packed_size(int width, int64_t K, int64_t N) { return width == 16 ? packed_bytes<16>(K, N) : packed_bytes<8>(K, N); }

// The op's userdata: the group width and the weight type, fixed when the graph is built.
struct wide_args {
    int width;
    ggml_type type;
};
const wide_args k_args[] = {{16, GGML_TYPE_Q4_0}, {16, GGML_TYPE_Q8_0}, {8, GGML_TYPE_Q4_0}, {8, GGML_TYPE_Q8_0}};

// ggml custom ops. pack: src[0] = x; groups split across threads.
void pack_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * a = (const wide_args *) userdata;
    const ggml_tensor * x = dst->src[0];
    const int64_t K = x->ne[0], N = x->ne[1], ng = (N + a->width - 1) / a->width;
    pack(a->width, (const float *) x->data, (int64_t) (x->nb[1] / sizeof(float)), K, N, a->type, (uint8_t *) dst->data,
         ng * ith / nth, ng * (ith + 1) / nth);
}

// gemm: src[0] = W, src[1] = the packed x; rows split across threads in tiles of 8.
void wide_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * a = (const wide_args *) userdata;
    const ggml_tensor * W = dst->src[0];
    const int64_t M = W->ne[1], N = dst->ne[1];
    const int64_t tiles = (M + k_tile_rows - 1) / k_tile_rows;
    const int64_t r0 = std::min(M, tiles * ith / nth * k_tile_rows);
    const int64_t r1 = std::min(M, tiles * (ith + 1) / nth * k_tile_rows);
    if (r0 >= r1) return;
    gemm(a->width, W, (const uint8_t *) dst->src[1]->data, N, (float *) dst->data, (int64_t) (dst->nb[1] / sizeof(float)),
         r0, r1);
}

}  // namespace

bool matmul_wide_available() { return width_at(isa_in_use()) != 0; }

bool matmul_wide_applies(const build_context & b, const ggml_tensor * W, const ggml_tensor * x) {
    return b.own_kernels() && x->ne[1] > k_matmul_max_cols && (W->type == GGML_TYPE_Q4_0 || W->type == GGML_TYPE_Q8_0) &&
           W->ne[0] % 32 == 0 && matmul_op_supported(W, x) && matmul_wide_available();
}

ggml_tensor * matmul_wide(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x) {
    const int width = width_at(isa_in_use());
    const wide_args * args = &k_args[(width == 16 ? 0 : 2) + (W->type == GGML_TYPE_Q8_0 ? 1 : 0)];
    ggml_tensor * xs[1] = {x};
    ggml_tensor * P = ggml_custom_4d(ctx, GGML_TYPE_I8, packed_size(width, x->ne[0], x->ne[1]), 1, 1, 1, xs, 1, pack_fn,
                                     GGML_N_TASKS_MAX, (void *) args);
    ggml_set_name(P, "q8_pack");
    ggml_tensor * srcs[2] = {W, P};
    ggml_tensor * y = ggml_custom_4d(ctx, GGML_TYPE_F32, W->ne[1], x->ne[1], 1, 1, srcs, 2, wide_fn, GGML_N_TASKS_MAX,
                                     (void *) args);
    ggml_set_name(y, "matmul_wide");
    return y;
}

void matmul_wide_rows(const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                      int64_t ldy, int64_t K, int64_t M, int64_t N, const std::string & isa) {
    DFN_REQUIRE(type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q8_0, "matmul", "the wide matmul takes Q4_0 / Q8_0, not ",
                ggml_type_name(type));
    DFN_REQUIRE(K % 32 == 0 && K > 0 && M > 0 && N > 0, "matmul", "bad shape K = ", K, ", M = ", M, ", N = ", N);
    int width = 0;
    if (isa.empty()) width = width_at(isa_in_use());
    else if (isa == "avx512f") width = isa_cpu_best() == isa_level::avx512 && width_at(isa_level::avx512) == 16 ? 16 : 0;
    else if (isa == "avx2") width = isa_cpu_best() >= isa_level::avx2 ? width_at(isa_level::avx2) : 0;
    else throw input_error(cat("[matmul] the wide matmul runs at 'avx512f' or 'avx2', not '", isa, "'"));
    DFN_REQUIRE(width > 0, "matmul", "the wide matmul", isa.empty() ? "" : cat(" at ", isa),
                " cannot run on this CPU (it needs AVX-512 VNNI or AVX2)");
    std::vector<uint8_t> P((size_t) packed_size(width, K, N));
    pack(width, x, ldx, K, N, type, P.data(), 0, (N + width - 1) / width);
    ggml_tensor t{};  // a view of W for gemm(): type, row size, shape
    t.type = type;
    t.ne[0] = K;
    t.ne[1] = M;
    t.nb[1] = w_row_bytes;
    t.data = const_cast<void *>(W);
    if (!gemm(width, &t, P.data(), N, y, ldy, 0, M)) throw_kernel_oom("matmul");
}

}  // namespace dfn
