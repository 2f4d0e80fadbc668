#include "kernels/cpu/top1.h"

#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/vmath.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

namespace dfn {

namespace {

// The row's maximum, and in the same pass whether every element is finite: l - l is 0 for a
// finite l and NaN for inf or NaN, so the sum stays 0 exactly when the row is finite (the max
// alone would skip a NaN).
DFN_MULTIVERSION(float, max_of, (const float * l, int64_t n, bool & finite), (l, n, finite)) {
    float mx = l[0];
    float z = 0.0f;
#pragma omp simd reduction(max : mx) reduction(+ : z)
    for (int64_t j = 0; j < n; ++j) {
        mx = l[j] > mx ? l[j] : mx;
        z += l[j] - l[j];
    }
    finite = z == 0.0f;
    return mx;
}

// sum_j exp(l[j] - mx) in a fixed order (16 lanes, element j on lane j % 16, then sum16): the
// same bits on every ISA (a vector reduction's order would follow the vector width).
DFN_MULTIVERSION(float, sum_exp, (const float * l, int64_t n, float mx), (l, n, mx)) {
    float acc[16] = {};
    int64_t j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
#pragma omp simd
        for (int c = 0; c < 16; ++c) acc[c] += exp_neg(l[j0 + c] - mx);
    }
    for (int c = 0; j0 + c < n; ++c) acc[c] += exp_neg(l[j0 + c] - mx);
    return sum16(acc);
}

void top1_fn(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * lg = dst->src[0];
    const int64_t V = lg->ne[0], n = lg->ne[1];
    for (int64_t r = ith; r < n; r += nth) {
        int64_t a;
        float p;
        top1_row((const float *) ((const char *) lg->data + r * lg->nb[1]), V, a, p);
        float * out = (float *) ((char *) dst->data + r * dst->nb[1]);
        out[0] = (float) a;
        out[1] = p;
    }
}

void topk_fn(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * lg = dst->src[0];
    for (int64_t r = ith; r < lg->ne[1]; r += nth) {
        topk_row((const float *) ((const char *) lg->data + r * lg->nb[1]), lg->ne[0], dst->ne[1],
                 (float *) ((char *) dst->data + r * dst->nb[2]));
    }
}

void argmax_fn(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * lg = dst->src[0];
    for (int64_t r = ith; r < lg->ne[1]; r += nth) {
        const float * row = (const float *) ((const char *) lg->data + r * lg->nb[1]);
        ((int32_t *) dst->data)[r] = (int32_t) argmax_row(row, lg->ne[0]);
    }
}

int64_t first_index_of(const float * l, int64_t n, float mx) {
    int64_t a = 0;
    while (a + 1 < n && !(l[a] == mx)) ++a;
    return a;
}

}  // namespace

int64_t argmax_row(const float * l, int64_t n) {
    bool finite;
    const float mx = max_of(l, n, finite);
    return finite ? first_index_of(l, n, mx) : -1;
}

void top1_row(const float * l, int64_t n, int64_t & arg, float & p) {
    bool finite;
    const float mx = max_of(l, n, finite);
    if (!finite) {
        arg = -1;
        p = NAN;
        return;
    }
    arg = first_index_of(l, n, mx);  // the first maximum
    p = 1.0f / sum_exp(l, n, mx);
}

void topk_row(const float * l, int64_t n, int64_t K, float * out) {
    bool finite;
    const float mx = max_of(l, n, finite);
    if (!finite) {
        for (int64_t k = 0; k < K; ++k) out[2 * k] = -1.0f, out[2 * k + 1] = NAN;
        return;
    }
    for (int64_t k = n; k < K; ++k) out[2 * k] = 0.0f, out[2 * k + 1] = 0.0f;  // fewer entries than K: p = 0
    K = std::min(K, n);
    // the K largest by insertion into a sorted list: scanning indices upwards, an equal value
    // never displaces an earlier index, so ties come out by index
    std::vector<int64_t> best;
    best.reserve(K + 1);
    for (int64_t j = 0; j < n; ++j) {
        if ((int64_t) best.size() == K && !(l[j] > l[best.back()])) continue;
        size_t at = best.size();
        while (at > 0 && l[j] > l[best[at - 1]]) --at;
        best.insert(best.begin() + at, j);
        if ((int64_t) best.size() > K) best.pop_back();
    }
    const float inv = 1.0f / sum_exp(l, n, mx);
    for (int64_t k = 0; k < K; ++k) {
        const float x = l[best[k]];
        out[2 * k] = (float) best[k];
        out[2 * k + 1] = x == mx ? inv : exp_neg(x - mx) * inv;
    }
}

void throw_non_finite_logits(const char * where, int64_t pos) {
    throw runtime_error(cat("[", where, "] non-finite logits (NaN or inf) at position ", pos,
                            ": the model's weights or inputs produce NaN/inf"));
}

ggml_tensor * top1_op(ggml_context * ctx, ggml_tensor * logits) {
    ggml_tensor * args[1] = {logits};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, 2, logits->ne[1], 1, 1, args, 1, top1_fn, GGML_N_TASKS_MAX, nullptr);
    ggml_set_name(out, "top1");
    return out;
}

ggml_tensor * topk_op(ggml_context * ctx, ggml_tensor * logits, int64_t K) {
    ggml_tensor * args[1] = {logits};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, 2, K, logits->ne[1], 1, args, 1, topk_fn, GGML_N_TASKS_MAX,
                                       nullptr);
    ggml_set_name(out, "topk");
    return out;
}

ggml_tensor * argmax_op(ggml_context * ctx, ggml_tensor * logits) {
    ggml_tensor * args[1] = {logits};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_I32, logits->ne[1], 1, 1, 1, args, 1, argmax_fn, GGML_N_TASKS_MAX,
                                       nullptr);
    ggml_set_name(out, "argmax");
    return out;
}

}  // namespace dfn
