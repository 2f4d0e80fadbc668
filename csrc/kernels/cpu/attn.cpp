#include "kernels/cpu/attn.h"
#include "base/alloc.h"

#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/vmath.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#if DFN_X86_GCC
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace dfn {

namespace {

// The op's parameters, the softmax scale (low 32 bits) and the gather flag (bit 32), travel in
// the bits of its userdata pointer, so nothing has to outlive the graph.
void * scale_to_userdata(float scale, bool gather) {
    uint32_t bits;
    std::memcpy(&bits, &scale, sizeof(bits));
    return reinterpret_cast<void *>((uintptr_t) bits | ((uintptr_t) gather << 32));
}

float userdata_to_scale(const void * userdata) {
    const uint32_t bits = (uint32_t) reinterpret_cast<uintptr_t>(userdata);
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return scale;
}

bool userdata_to_gather(const void * userdata) { return (reinterpret_cast<uintptr_t>(userdata) >> 32) & 1; }

// A row of F16 or F32 as F32.
void row_f32(const ggml_tensor * t, const char * p, float * out, int64_t n) {
    if (t->type == GGML_TYPE_F16) ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) p, out, n);
    else std::memcpy(out, p, n * sizeof(float));
}

// kT[d * n_pad + j0 + l] = rows[l][d] for l < 16, d < hd: one block of 16 keys (rows: 16 rows of
// hd floats, converted to F32) written transposed, 16 contiguous floats per d.
DFN_MULTIVERSION(void, transpose16, (const float * __restrict rows, int64_t hd, float * __restrict kT, int64_t n_pad),
                 (rows, hd, kT, n_pad)) {
    for (int64_t d = 0; d < hd; ++d) {
        float * __restrict out = kT + d * n_pad;
#pragma omp simd
        for (int l = 0; l < 16; ++l) out[l] = rows[l * hd + d];
    }
}

#if DFN_X86_GCC
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512 intrinsics
// r[0..16) := its transpose (r[i] lane j <- r[j] lane i).
static inline void transpose16x16(__m512 * r) {
    __m512 t[16], u[16], v[16];
    for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // 4 x 4 blocks within each 128-bit lane
        u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int h = 0; h < 2; ++h) {  // then the 128-bit lanes
        for (int i = 0; i < 4; ++i) {
            v[8 * h + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0x88);
            v[8 * h + 4 + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0xDD);
        }
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(v[i], v[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(v[i], v[8 + i], 0xDD);
    }
}

// Elements d0 .. d0 + 15 of an F16 or F32 row, as F32.
static inline __m512 load16(bool f16, const char * row, int64_t d0) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const uint16_t *) row + d0)))
               : _mm512_loadu_ps((const float *) row + d0);
}

// r[d] = dims d0 + d of keys 0..15 (F16 or F32 rows `stride` bytes apart from p; keys m.. are 0).
static inline void key_tile(bool f16, const char * p, size_t stride, int64_t m, int64_t d0, __m512 * r) {
    for (int l = 0; l < 16; ++l) r[l] = l < m ? load16(f16, p + l * stride, d0) : _mm512_setzero_ps();
    transpose16x16(r);
}

// kT[d * n_pad + l] = key l's dim d (F16 or F32 rows `stride` bytes apart from p) for l < 16 (rows
// m.. are 0), d < hd (a multiple of 16): 16 x 16 tiles (key_tile).
static void keys_transposed_avx512(bool f16, const char * p, size_t stride, int64_t m, int64_t hd, float * kT,
                                   int64_t n_pad) {
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        __m512 r[16];
        key_tile(f16, p, stride, m, d0, r);
        for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kT + (d0 + d) * n_pad, r[d]);
    }
}
// s[g * n_pad + j] = sum_d qs[g][d] key_j[d] for g < G (<= 8), j < n_kv (keys: F16 or F32 rows
// `stride` bytes apart from p; hd a multiple of 16): the scores of a KV head's G query heads straight
// from the key rows, 16 keys at a time, each tile converted and transposed in registers. Each key's
// sum is one fma chain over d in order from 0, as scores() computes it from kT: the same bits,
// without writing kT (one token: nothing to share it with).
static void scores_from_keys_avx512(bool f16, const char * p, size_t stride, int64_t n_kv, int64_t hd,
                                    const float * const * qs, int64_t G, float * s, int64_t n_pad) {
    for (int64_t j0 = 0; j0 < n_kv; j0 += 16) {
        const int64_t m = std::min<int64_t>(16, n_kv - j0);
        __m512 acc[8];
        for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t d0 = 0; d0 < hd; d0 += 16) {
            __m512 r[16];
            key_tile(f16, p + j0 * stride, stride, m, d0, r);
            for (int d = 0; d < 16; ++d) {
                for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g][d0 + d]), r[d], acc[g]);
            }
        }
        for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(s + g * n_pad + j0, acc[g]);
    }
}
// o = sum_j p[j] value_j (value rows F16 or F32, `stride` bytes apart from v; hd a multiple of 16,
// at most 256): pv()'s fmaf chain per element over the keys in order, skipping p[j] == 0, with o in
// registers and each row converted as it is read (the same bits, without the F32 copy of V).
static void pv_from_rows_avx512(float * o, const float * p, bool f16, const char * v, size_t stride, int64_t n_kv,
                                int64_t hd) {
    __m512 acc[16];
    const int64_t nc = hd / 16;
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_kv; ++j) {
        if (p[j] == 0.0f) continue;
        const __m512 a = _mm512_set1_ps(p[j]);
        const char * row = v + j * stride;
        for (int64_t c = 0; c < nc; ++c) acc[c] = _mm512_fmadd_ps(a, load16(f16, row, 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < nc; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// s[j] = sum_d q[d] kT[d][j] for j < n (n a multiple of 64): 64 keys at a time, each key's sum
// one fma chain over d in order, so its bits depend on nothing else.
DFN_MULTIVERSION(void, scores,
                 (const float * __restrict q, const float * __restrict kT, float * __restrict s, int64_t hd,
                  int64_t n),
                 (q, kT, s, hd, n)) {
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        float acc[64] = {};
        for (int64_t d = 0; d < hd; ++d) {
            const float qd = q[d];
            const float * kr = kT + d * n + j0;
#pragma omp simd
            for (int l = 0; l < 64; ++l) acc[l] = fmaf(qd, kr[l], acc[l]);
        }
        std::memcpy(s + j0, acc, sizeof(acc));
    }
}

// p[j] = exp(s[j] - m) (0 where s[j] = -inf); returns their sum in 16 lanes, then a fixed tree.
DFN_MULTIVERSION(float, softmax_num, (float * __restrict s, int64_t n, float m), (s, n, m)) {
    float acc[16] = {};
    for (int64_t j0 = 0; j0 < n; j0 += 16) {  // n is a multiple of 16
#pragma omp simd
        for (int l = 0; l < 16; ++l) {
            const float x = s[j0 + l];
            const float p = x == -INFINITY ? 0.0f : exp_neg(x - m);
            s[j0 + l] = p;
            acc[l] += p;
        }
    }
    return sum16(acc);
}

// o = sum_j p[j] v[j] over the keys in order (o zeroed first; keys with p = 0 skipped).
DFN_MULTIVERSION(void, pv,
                 (float * __restrict o, const float * __restrict p, const float * __restrict v, int64_t n_kv,
                  int64_t hd),
                 (o, p, v, n_kv, hd)) {
    std::memset(o, 0, hd * sizeof(float));
    for (int64_t j = 0; j < n_kv; ++j) {
        const float a = p[j];
        if (a == 0.0f) continue;
        const float * __restrict x = v + j * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) o[i] = fmaf(a, x[i], o[i]);
    }
}

// The softmax sum and P.V over the kept keys only, gathered to indices 0..n_kept-1 (the AR
// step's indices for a tree node: attn.h). Returns the sum; o as pv() leaves it: each element
// the same fmaf chain over the same keys in the same order.
DFN_MULTIVERSION(float, gathered_softmax_pv,
                 (float * o, const float * s, float * sg, const int64_t * kept, int64_t n_kept, float m,
                  const float * vf, int64_t hd),
                 (o, s, sg, kept, n_kept, m, vf, hd)) {
    const int64_t n16 = (n_kept + 15) / 16 * 16;
    for (int64_t k = 0; k < n_kept; ++k) sg[k] = s[kept[k]];
    for (int64_t k = n_kept; k < n16; ++k) sg[k] = -INFINITY;  // exact zeros in the sum
    const float sum = m == -INFINITY ? 0.0f : softmax_num(sg, n16, m);
    std::memset(o, 0, hd * sizeof(float));
    for (int64_t k = 0; k < n_kept; ++k) {
        const float a = sg[k];
        if (a == 0.0f) continue;
        const float * __restrict x = vf + kept[k] * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) o[i] = fmaf(a, x[i], o[i]);
    }
    return sum;
}

void attn_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * q = dst->src[0], * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3];
    const float scale = userdata_to_scale(userdata);
    const bool gather = userdata_to_gather(userdata);
    const int64_t hd = q->ne[0], n_head = q->ne[1], n_tok = q->ne[2];
    const int64_t n_kv_head = K->ne[1], n_kv = K->ne[2], G = n_head / n_kv_head;
    const int64_t n_pad = (n_kv + 63) / 64 * 64;
    thread_local std::vector<float> kT, vf, row, s_one, mf, sg, sG;
    thread_local std::vector<int64_t> kept;
    if (!kernel_scratch(kT, (size_t) hd * n_pad, "attention keys") ||
        !kernel_scratch(vf, (size_t) n_kv * hd, "attention values") || !kernel_scratch(row, (size_t) 16 * hd, "attention") ||
        !kernel_scratch(s_one, (size_t) n_pad, "attention scores") || !kernel_scratch(mf, (size_t) n_kv, "attention mask") ||
        !kernel_scratch(sG, (size_t) std::min<int64_t>(G, 8) * n_pad, "attention scores") ||
        (gather && (!kernel_scratch(sg, (size_t) n_pad, "attention scores") ||
                    !kernel_scratch(kept, (size_t) n_kv, "attention keys")))) {
        return;  // noted; the graph runner throws MemoryError after the compute
    }
    for (int64_t d = 0; d < hd; ++d)  // the padding keys score 0 and are dropped below
        std::fill(kT.begin() + d * n_pad + n_kv, kT.begin() + (d + 1) * n_pad, 0.0f);
    // A unit is one KV head and a run of tokens: its K (transposed) and V rows are converted once
    // for those tokens and all their GQA heads. Tokens are split only as far as there are threads.
    const int64_t n_chunks = std::max<int64_t>(1, std::min<int64_t>(n_tok, nth / n_kv_head));
#if DFN_X86_GCC
    const bool tiles = isa_in_use() == isa_level::avx512 && hd % 16 == 0;  // the AVX-512 key tiles
#else
    const bool tiles = false;
#endif
    for (int64_t u = ith; u < n_kv_head * n_chunks; u += nth) {
        const int64_t hk = u % n_kv_head, c = u / n_kv_head;
        const int64_t t0 = c * n_tok / n_chunks, t1 = (c + 1) * n_tok / n_chunks;
        // one token (an AR step): its G heads' scores straight from the key rows, no kT
        const bool direct = tiles && t1 - t0 == 1 && G <= 8;
        for (int64_t j0 = 0; j0 < n_kv && !direct; j0 += 16) {  // K: 16 rows at a time, then transposed
            const int64_t m = std::min<int64_t>(16, n_kv - j0);
            const char * k0 = (const char *) K->data + hk * K->nb[1] + j0 * K->nb[2];
#if DFN_X86_GCC
            if (tiles) {
                keys_transposed_avx512(K->type == GGML_TYPE_F16, k0, K->nb[2], m, hd, kT.data() + j0, n_pad);
                continue;
            }
#endif
            for (int64_t l = 0; l < m; ++l) row_f32(K, k0 + l * K->nb[2], row.data() + l * hd, hd);
            std::fill(row.begin() + m * hd, row.begin() + 16 * hd, 0.0f);  // padding keys: 0 (n_pad >= j0 + 16)
            transpose16(row.data(), hd, kT.data() + j0, n_pad);
        }
        // ... and its P.V straight from the value rows (not with gather: it reads the F32 copy)
        const bool direct_v = direct && !gather && hd <= 256;
        for (int64_t j = 0; j < n_kv && !direct_v; ++j)
            row_f32(V, (const char *) V->data + hk * V->nb[1] + j * V->nb[2], vf.data() + j * hd, hd);
        for (int64_t t = t0; t < t1; ++t) {
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) ((const char *) mask->data + t * mask->nb[1]), mf.data(), n_kv);
            int64_t n_kept = 0;
            if (gather) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    if (mf[j] != -INFINITY) kept[n_kept++] = j;
                }
            }
#if DFN_X86_GCC
            if (direct) {
                const float * qs[8];
                for (int64_t g = 0; g < G; ++g)
                    qs[g] = (const float *) ((const char *) q->data + (hk * G + g) * q->nb[1] + t * q->nb[2]);
                scores_from_keys_avx512(K->type == GGML_TYPE_F16, (const char *) K->data + hk * K->nb[1], K->nb[2], n_kv,
                                        hd, qs, G, sG.data(), n_pad);
            }
#endif
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = hk * G + g;
                const float * qr = (const float *) ((const char *) q->data + h * q->nb[1] + t * q->nb[2]);
                float * o = (float *) ((char *) dst->data + h * dst->nb[1] + t * dst->nb[2]);
                // scores, then softmax and P.V over the keys in order
                float * s = direct ? sG.data() + g * n_pad : s_one.data();
                if (!direct) scores(qr, kT.data(), s, hd, n_pad);
                float m = -INFINITY;
                for (int64_t j = 0; j < n_pad; ++j) {
                    const float mv = j < n_kv ? mf[j] : -INFINITY;
                    s[j] = mv == -INFINITY ? -INFINITY : s[j] * scale + mv;
                    m = s[j] > m ? s[j] : m;
                }
                float sum;
                if (gather) {
                    sum = gathered_softmax_pv(o, s, sg.data(), kept.data(), n_kept, m, vf.data(), hd);
                } else {
                    sum = m == -INFINITY ? 0.0f : softmax_num(s, n_pad, m);
#if DFN_X86_GCC
                    if (direct_v) {
                        pv_from_rows_avx512(o, s, V->type == GGML_TYPE_F16, (const char *) V->data + hk * V->nb[1],
                                            V->nb[2], n_kv, hd);
                    } else
#endif
                        pv(o, s, vf.data(), n_kv, hd);
                }
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
            }
        }
    }
}

}  // namespace

bool attn_op_supported(const ggml_tensor * q, const ggml_tensor * K, const ggml_tensor * V, const ggml_tensor * mask) {
    if (q->type != GGML_TYPE_F32 || mask->type != GGML_TYPE_F16) return false;
    if (K->type != V->type || (K->type != GGML_TYPE_F16 && K->type != GGML_TYPE_F32)) return false;
    if (q->ne[2] > k_attn_max_tokens || q->ne[3] != 1 || K->ne[3] != 1) return false;
    if (K->ne[1] == 0 || q->ne[1] % K->ne[1] != 0 || K->ne[0] != q->ne[0] || V->ne[0] != q->ne[0]) return false;
    if (K->ne[1] != V->ne[1] || K->ne[2] != V->ne[2] || mask->ne[0] != K->ne[2] || mask->ne[1] < q->ne[2]) return false;
    if (q->nb[0] != sizeof(float) || K->nb[0] != ggml_type_size(K->type) || V->nb[0] != ggml_type_size(V->type)) return false;
    for (const ggml_tensor * t : {K, V}) {
        const ggml_tensor * base = t->view_src ? t->view_src : t;
        if (base->buffer && !ggml_backend_buffer_is_host(base->buffer)) return false;
    }
    return true;
}

ggml_tensor * attn_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * K, ggml_tensor * V, ggml_tensor * mask,
                      float scale, bool gather) {
    ggml_tensor * args[4] = {q, K, V, mask};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, q->ne[0], q->ne[1], q->ne[2], 1, args, 4, attn_fn,
                                       GGML_N_TASKS_MAX, scale_to_userdata(scale, gather));
    ggml_set_name(out, "attn");
    return out;
}

ggml_tensor * attention(const build_context & b, ggml_tensor * q, ggml_tensor * K, ggml_tensor * V, ggml_tensor * mask,
                        float scale, bool gather) {
    ggml_context * ctx = b.ctx;
    ggml_tensor * out = nullptr;  // [hd, n_head, n_tokens]
    if (b.own_kernels() && attn_op_supported(q, K, V, mask)) {
        out = attn_op(ctx, q, K, V, mask, scale, gather);
    } else if (b.device) {
        // a device: two matmuls and a masked softmax, ops every ggml backend has (a CUDA build
        // without flash-attention kernels too: bench/gpu/build.sh)
        ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);                  // [hd, n_tokens, n_head]
        ggml_tensor * kp = ggml_permute(ctx, K, 0, 2, 1, 3);                  // [hd, n_kv, n_kv_head]
        ggml_tensor * kq = ggml_mul_mat(ctx, kp, qp);                          // [n_kv, n_tokens, n_head]
        ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(ctx, kq, mask, scale, 0.0f);
        ggml_tensor * vt = ggml_cont(ctx, ggml_permute(ctx, V, 1, 2, 0, 3));  // [n_kv, hd, n_kv_head]
        ggml_tensor * kqv = ggml_mul_mat(ctx, vt, kq);                         // [hd, n_tokens, n_head]
        out = ggml_cont(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3));             // [hd, n_head, n_tokens]
    } else {
        out = ggml_flash_attn_ext(ctx, ggml_permute(ctx, q, 0, 2, 1, 3),  // [hd, n_tokens, n_head]
                                  ggml_permute(ctx, K, 0, 2, 1, 3),       // [hd, n_kv, n_kv_head]
                                  ggml_permute(ctx, V, 0, 2, 1, 3), mask, scale, 0.0f, 0.0f);
        ggml_prec_set_acc(out, GGML_PREC_F32);
    }
    return ggml_reshape_2d(ctx, out, out->ne[0] * out->ne[1], out->ne[2] * out->ne[3]);
}

}  // namespace dfn
