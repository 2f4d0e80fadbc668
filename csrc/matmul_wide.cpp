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
#include <vector>

#if DFN_X86_GCC
#include <immintrin.h>
#endif

namespace dfn {

namespace {

constexpr int64_t k_cols = 16;        // columns per group: one per float / int32 lane
constexpr int64_t k_group_bytes = 640;  // per group and block: 8 x 64 code bytes, 16 biases, 16 scales
constexpr int64_t k_bias_at = 512;
constexpr int64_t k_scale_at = 576;
constexpr int k_tile_rows = 8;        // rows per tile: 8 int32 + 8 float accumulators, the codes, a chunk

int64_t packed_bytes(int64_t K, int64_t N) { return (N + k_cols - 1) / k_cols * (K / 32) * k_group_bytes; }

int code_offset(ggml_type type) { return type == GGML_TYPE_Q8_0 ? 128 : 8; }

// Groups [g0, g1) of x's N columns into P (matmul_wide.h: pack).
void pack_groups(const float * x, int64_t ldx, int64_t K, int64_t N, int off, uint8_t * P, int64_t g0, int64_t g1) {
    const int64_t nb = K / 32;
    int8_t q[32];
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t c = 0; c < k_cols; ++c) {
            const int64_t n = g * k_cols + c;
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t * blk = P + (g * nb + b) * k_group_bytes;
                float d = 0.0f;
                int32_t sum = 0;
                if (n < N) {
                    d = quantize_q8_0_block(x + n * ldx + 32 * b, q);
                    for (int k = 0; k < 32; ++k) sum += q[k];
                } else {
                    std::memset(q, 0, sizeof(q));
                }
                for (int j = 0; j < 8; ++j) std::memcpy(blk + 64 * j + 4 * c, q + 4 * j, 4);
                const int32_t bias = -off * sum;
                std::memcpy(blk + k_bias_at + 4 * c, &bias, 4);
                std::memcpy(blk + k_scale_at + 4 * c, &d, 4);
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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
// GCC 12 flags the undefined upper half inside its own _mm512 intrinsics' headers
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Rows r .. r + RR - 1 of W unpacked: U[i][b][32] unsigned code bytes, DW[i][b] the F32 scales.
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
    for (int64_t g = 0; g * k_cols < N; ++g) {
        __m512 acc[RR];
        for (int i = 0; i < RR; ++i) acc[i] = _mm512_setzero_ps();
        const uint8_t * pg = P + g * nb * k_group_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t * pb = pg + b * k_group_bytes;
            __m512i s[RR];
            const __m512i bias = _mm512_loadu_si512((const void *) (pb + k_bias_at));
            for (int i = 0; i < RR; ++i) s[i] = bias;
            for (int j = 0; j < 8; ++j) {
                const __m512i a = _mm512_loadu_si512((const void *) (pb + 64 * j));
                for (int i = 0; i < RR; ++i) {
                    int32_t w4;
                    std::memcpy(&w4, U + (i * nb + b) * 32 + 4 * j, 4);
                    s[i] = _mm512_dpbusd_epi32(s[i], _mm512_set1_epi32(w4), a);
                }
            }
            const __m512 da = _mm512_loadu_ps((const float *) (pb + k_scale_at));
            for (int i = 0; i < RR; ++i) {
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(DW[i * nb + b]), da);
                acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s[i]), acc[i]);
            }
        }
        const __mmask16 live = (__mmask16) (N - g * k_cols >= k_cols ? 0xFFFF : (1u << (N - g * k_cols)) - 1);
        for (int i = 0; i < RR; ++i) _mm512_mask_i32scatter_ps(y + g * k_cols * ldy + r + i, live, col, acc[i], 4);
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

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else
bool cpu_has_vnni() { return false; }
template <ggml_type T>
void gemm_rows(const uint8_t *, size_t, int64_t, const uint8_t *, int64_t, float *, int64_t, int64_t, int64_t, uint8_t *,
               float *) {}
#endif

// Rows [r0, r1) of y from packed P; false when the scratch cannot be had (noted).
bool gemm(const ggml_tensor * W, const uint8_t * P, int64_t N, float * y, int64_t ldy, int64_t r0, int64_t r1) {
    thread_local std::vector<uint8_t> U;
    thread_local std::vector<float> DW;
    const int64_t nb = W->ne[0] / 32;
    if (!kernel_scratch(U, (size_t) (k_tile_rows * nb * 32), "the wide matmul's unpacked rows") ||
        !kernel_scratch(DW, (size_t) (k_tile_rows * nb), "the wide matmul's row scales"))
        return false;
    const auto * w = (const uint8_t *) W->data;
    if (W->type == GGML_TYPE_Q8_0) gemm_rows<GGML_TYPE_Q8_0>(w, W->nb[1], W->ne[0], P, N, y, ldy, r0, r1, U.data(), DW.data());
    else gemm_rows<GGML_TYPE_Q4_0>(w, W->nb[1], W->ne[0], P, N, y, ldy, r0, r1, U.data(), DW.data());
    return true;
}

// ggml custom ops. pack: src[0] = x; userdata = the weight type's code offset.
void pack_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * x = dst->src[0];
    const int64_t K = x->ne[0], N = x->ne[1], ng = (N + k_cols - 1) / k_cols;
    pack_groups((const float *) x->data, (int64_t) (x->nb[1] / sizeof(float)), K, N, (int) (intptr_t) userdata,
                (uint8_t *) dst->data, ng * ith / nth, ng * (ith + 1) / nth);
}

// gemm: src[0] = W, src[1] = the packed x; rows split across threads in tiles of 8.
void wide_fn(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * W = dst->src[0];
    const int64_t M = W->ne[1], N = dst->ne[1];
    const int64_t tiles = (M + k_tile_rows - 1) / k_tile_rows;
    const int64_t r0 = std::min(M, tiles * ith / nth * k_tile_rows);
    const int64_t r1 = std::min(M, tiles * (ith + 1) / nth * k_tile_rows);
    if (r0 >= r1) return;
    gemm(W, (const uint8_t *) dst->src[1]->data, N, (float *) dst->data, (int64_t) (dst->nb[1] / sizeof(float)), r0, r1);
}

}  // namespace

bool matmul_wide_available() { return cpu_has_vnni() && isa_in_use() == isa_level::avx512; }

bool matmul_wide_applies(const build_context & b, const ggml_tensor * W, const ggml_tensor * x) {
    return b.own_kernels() && x->ne[1] > k_matmul_max_cols && (W->type == GGML_TYPE_Q4_0 || W->type == GGML_TYPE_Q8_0) &&
           W->ne[0] % 32 == 0 && matmul_op_supported(W, x) && matmul_wide_available();
}

ggml_tensor * matmul_wide(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x) {
    ggml_tensor * xs[1] = {x};
    ggml_tensor * P = ggml_custom_4d(ctx, GGML_TYPE_I8, packed_bytes(x->ne[0], x->ne[1]), 1, 1, 1, xs, 1, pack_fn,
                                     GGML_N_TASKS_MAX, (void *) (intptr_t) code_offset(W->type));
    ggml_set_name(P, "q8_pack");
    ggml_tensor * args[2] = {W, P};
    ggml_tensor * y = ggml_custom_4d(ctx, GGML_TYPE_F32, W->ne[1], x->ne[1], 1, 1, args, 2, wide_fn, GGML_N_TASKS_MAX, nullptr);
    ggml_set_name(y, "matmul_wide");
    return y;
}

void matmul_wide_rows(const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                      int64_t ldy, int64_t K, int64_t M, int64_t N) {
    DFN_REQUIRE(type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q8_0, "matmul", "the wide matmul takes Q4_0 / Q8_0, not ",
                ggml_type_name(type));
    DFN_REQUIRE(K % 32 == 0 && K > 0 && M > 0 && N > 0, "matmul", "bad shape K = ", K, ", M = ", M, ", N = ", N);
    DFN_REQUIRE(cpu_has_vnni(), "matmul", "the wide matmul needs AVX-512 VNNI, which this CPU lacks");
    std::vector<uint8_t> P((size_t) packed_bytes(K, N));
    pack_groups(x, ldx, K, N, code_offset(type), P.data(), 0, (N + k_cols - 1) / k_cols);
    ggml_tensor t{};  // a view of W for gemm(): type, row size, shape
    t.type = type;
    t.ne[0] = K;
    t.ne[1] = M;
    t.nb[1] = w_row_bytes;
    t.data = const_cast<void *>(W);
    if (!gemm(&t, P.data(), N, y, ldy, 0, M)) throw_kernel_oom("matmul");
}

}  // namespace dfn
