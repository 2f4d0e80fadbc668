#include "conv.h"
#include "alloc.h"

#include "common.h"
#include "vmath.h"

#include "ggml-backend.h"

#include <algorithm>
#include <vector>

namespace dfn {

namespace {

DFN_MULTIVERSION
void silu_rows(float * __restrict y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = silu_fast(y[i]);
}

// One output before the SiLU: sum_j w[j] in[j] in order j = 0 .. d_conv - 1 (the chain and tree
// kernels share it, so a tree node's sum is its path's AR sum).
inline float conv_dot(const float * wc, const float * in, int64_t d_conv) {
    float s = 0.0f;
    for (int64_t j = 0; j < d_conv; ++j) s += wc[j] * in[j];
    return s;
}

// Channels split over the threads; each thread reads its channels' state before it writes them.
void conv_silu_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * state = dst->src[0], * x = dst->src[1], * w = dst->src[2];
    const int64_t n_ch = state->ne[1];
    conv_silu_channels((float *) state->data, userdata != nullptr, (const float *) x->data,
                       (int64_t) (x->nb[1] / sizeof(float)), (const float *) w->data, (float *) dst->data, w->ne[0],
                       n_ch, x->ne[1], n_ch * ith / nth, n_ch * (ith + 1) / nth);
}

void conv_silu_tree_fn(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * state = dst->src[0], * x = dst->src[1], * w = dst->src[2], * par = dst->src[3];
    const int64_t n_ch = state->ne[1];
    conv_silu_tree_channels((const float *) state->data, (const float *) x->data, (int64_t) (x->nb[1] / sizeof(float)),
                            (const int32_t *) par->data, (const float *) w->data, (float *) dst->data, w->ne[0], n_ch,
                            x->ne[1], n_ch * ith / nth, n_ch * (ith + 1) / nth);
}

}  // namespace

void conv_silu_channels(float * state, bool update_state, const float * x, int64_t ldx, const float * w, float * out,
                        int64_t d_conv, int64_t n_ch, int64_t n_tok, int64_t c0, int64_t c1) {
    const int64_t kc = d_conv - 1;
    thread_local std::vector<float> in;
    if (!kernel_scratch(in, (size_t) (kc + n_tok), "the GDN conv")) return;  // noted; thrown after the compute
    for (int64_t c = c0; c < c1; ++c) {
        for (int64_t j = 0; j < kc; ++j) in[j] = state[c * kc + j];
        for (int64_t t = 0; t < n_tok; ++t) in[kc + t] = x[t * ldx + c];
        const float * wc = w + c * d_conv;
        for (int64_t t = 0; t < n_tok; ++t) out[t * n_ch + c] = conv_dot(wc, in.data() + t, d_conv);
        if (update_state) {
            for (int64_t j = 0; j < kc; ++j) state[c * kc + j] = in[n_tok + j];
        }
    }
    if (c1 > c0) {
        for (int64_t t = 0; t < n_tok; ++t) silu_rows(out + t * n_ch + c0, c1 - c0);
    }
}

void conv_silu_tree_channels(const float * state, const float * x, int64_t ldx, const int32_t * parents, const float * w,
                             float * out, int64_t d_conv, int64_t n_ch, int64_t n_tok, int64_t c0, int64_t c1) {
    const int64_t kc = d_conv - 1;
    // src[t * kc + j]: where window element j of node t comes from: >= 0 an input row (a node),
    // < 0 the state column -1 - src. The AR step of the path reads [state; path][depth + j].
    thread_local std::vector<int64_t> src, anc;
    thread_local std::vector<float> win;
    if (!kernel_scratch(src, (size_t) (n_tok * kc), "the GDN tree conv") ||
        !kernel_scratch(anc, (size_t) n_tok, "the GDN tree conv") || !kernel_scratch(win, (size_t) d_conv, "the GDN tree conv")) {
        return;  // noted; thrown after the compute
    }
    for (int64_t t = 0; t < n_tok; ++t) {
        int64_t dep = 0;  // ancestors of t, root first: anc[0 .. dep)
        for (int64_t a = parents[t]; a >= 0; a = parents[a]) ++dep;
        int64_t d = dep;
        for (int64_t a = parents[t]; a >= 0; a = parents[a]) anc[--d] = a;
        for (int64_t j = 0; j < kc; ++j) {
            const int64_t i = dep + j;  // index into [state (kc); path]
            src[t * kc + j] = i < kc ? -1 - i : anc[i - kc];
        }
    }
    for (int64_t c = c0; c < c1; ++c) {
        const float * wc = w + c * d_conv;
        for (int64_t t = 0; t < n_tok; ++t) {
            for (int64_t j = 0; j < kc; ++j) {
                const int64_t sj = src[t * kc + j];
                win[j] = sj >= 0 ? x[sj * ldx + c] : state[c * kc + (-1 - sj)];
            }
            win[kc] = x[t * ldx + c];
            out[t * n_ch + c] = conv_dot(wc, win.data(), d_conv);
        }
    }
    if (c1 > c0) {
        for (int64_t t = 0; t < n_tok; ++t) silu_rows(out + t * n_ch + c0, c1 - c0);
    }
}

bool conv_silu_supported(const ggml_tensor * state, const ggml_tensor * x, const ggml_tensor * w) {
    if (state->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || w->type != GGML_TYPE_F32) return false;
    if (!ggml_is_contiguous(state) || !ggml_is_contiguous(w) || x->nb[0] != sizeof(float)) return false;
    if (w->ne[0] != state->ne[0] + 1 || w->ne[1] != state->ne[1] || x->ne[0] != state->ne[1]) return false;
    for (const ggml_tensor * t : {state, w}) {
        const ggml_tensor * base = t->view_src ? t->view_src : t;
        if (base->buffer && !ggml_backend_buffer_is_host(base->buffer)) return false;
    }
    return true;
}

ggml_tensor * conv_silu_op(ggml_context * ctx, ggml_tensor * state, ggml_tensor * x, ggml_tensor * w, bool update_state) {
    ggml_tensor * args[3] = {state, x, w};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, x->ne[0], x->ne[1], 1, 1, args, 3, conv_silu_fn,
                                       GGML_N_TASKS_MAX, update_state ? (void *) 1 : nullptr);
    ggml_set_name(out, "conv_silu");
    return out;
}

}  // namespace dfn

namespace dfn {

ggml_tensor * conv_silu_tree_op(ggml_context * ctx, ggml_tensor * state, ggml_tensor * x, ggml_tensor * w,
                                ggml_tensor * parents) {
    ggml_tensor * args[4] = {state, x, w, parents};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, x->ne[0], x->ne[1], 1, 1, args, 4, conv_silu_tree_fn,
                                       GGML_N_TASKS_MAX, nullptr);
    ggml_set_name(out, "conv_silu_tree");
    return out;
}

}  // namespace dfn
