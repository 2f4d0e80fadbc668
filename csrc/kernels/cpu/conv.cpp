#include "kernels/cpu/conv.h"
#include "base/alloc.h"

#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/vmath.h"

#include "ggml-backend.h"

#include <algorithm>
#include <vector>

namespace dfn {

namespace {

DFN_MULTIVERSION(void, silu_rows, (float * __restrict y, int64_t n), (y, n)) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = silu_fast(y[i]);
}

// One token's outputs before the SiLU for a run of nc channels: out[c] = sum_j wT[j][c] in[j][c]
// in order j = 0 .. d_conv - 1, each product and sum rounded once (conv.cpp is built with
// -ffp-contract=off, so no path fuses them): the bits of a channel's sum depend on its own inputs
// only, whatever the vector width. in[j]: window element j's row of nc channels (the state's
// transposed column, or an input row); wT: the weights transposed, [d_conv][nc]. The chain and
// tree kernels both call it, so a tree node's sum is its path's AR sum.
DFN_MULTIVERSION(void, conv_row,
                 (float * __restrict out, const float * const * in, const float * __restrict wT, int64_t nc,
                  int64_t d_conv),
                 (out, in, wT, nc, d_conv)) {
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) {
        float s = 0.0f;
        for (int64_t j = 0; j < d_conv; ++j) s = s + wT[j * nc + c] * in[j][c];
        out[c] = s;
    }
}

// Channels [c0, c1) of w [n_ch][d_conv] and of the state [n_ch][kc], transposed to [d_conv][nc]
// and [kc][nc] (contiguous in the channel, as x's rows are) into thread scratch. False: out of
// memory (noted; thrown after the compute).
bool transpose_channels(const float * w, const float * state, int64_t d_conv, int64_t c0, int64_t c1,
                        std::vector<float> & wT, std::vector<float> & stT) {
    const int64_t kc = d_conv - 1, nc = c1 - c0;
    if (!kernel_scratch(wT, (size_t) (d_conv * nc), "the GDN conv") ||
        !kernel_scratch(stT, (size_t) (kc * nc), "the GDN conv")) {
        return false;
    }
    for (int64_t c = 0; c < nc; ++c) {
        for (int64_t j = 0; j < d_conv; ++j) wT[j * nc + c] = w[(c0 + c) * d_conv + j];
        for (int64_t j = 0; j < kc; ++j) stT[j * nc + c] = state[(c0 + c) * kc + j];
    }
    return true;
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
    if (c1 <= c0) return;
    const int64_t kc = d_conv - 1, nc = c1 - c0;
    thread_local std::vector<float> wT, stT;
    thread_local std::vector<const float *> in;
    if (!transpose_channels(w, state, d_conv, c0, c1, wT, stT) ||
        !kernel_scratch(in, (size_t) d_conv, "the GDN conv")) {
        return;  // noted; thrown after the compute
    }
    // element i of the sequence [state (kc); x (n_tok)], channels c0..c1
    auto row = [&](int64_t i) { return i < kc ? stT.data() + i * nc : x + (i - kc) * ldx + c0; };
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < d_conv; ++j) in[j] = row(t + j);
        conv_row(out + t * n_ch + c0, in.data(), wT.data(), nc, d_conv);
    }
    if (update_state) {  // the last kc inputs (read from the transposed copy, so in place is safe)
        for (int64_t j = 0; j < kc; ++j) {
            const float * r = row(n_tok + j);
            for (int64_t c = 0; c < nc; ++c) state[(c0 + c) * kc + j] = r[c];
        }
    }
    for (int64_t t = 0; t < n_tok; ++t) silu_rows(out + t * n_ch + c0, nc);
}

void conv_silu_tree_channels(const float * state, const float * x, int64_t ldx, const int32_t * parents, const float * w,
                             float * out, int64_t d_conv, int64_t n_ch, int64_t n_tok, int64_t c0, int64_t c1) {
    if (c1 <= c0) return;
    const int64_t kc = d_conv - 1, nc = c1 - c0;
    thread_local std::vector<float> wT, stT;
    thread_local std::vector<int64_t> anc;
    thread_local std::vector<const float *> in;
    if (!transpose_channels(w, state, d_conv, c0, c1, wT, stT) || !kernel_scratch(anc, (size_t) n_tok, "the GDN tree conv") ||
        !kernel_scratch(in, (size_t) d_conv, "the GDN tree conv")) {
        return;  // noted; thrown after the compute
    }
    for (int64_t t = 0; t < n_tok; ++t) {
        // node t's window: [state; its path (ancestors root first, then t)][depth .. depth + kc],
        // what the AR step of that path reads
        int64_t dep = 0;  // ancestors of t, root first: anc[0 .. dep)
        for (int64_t a = parents[t]; a >= 0; a = parents[a]) ++dep;
        int64_t d = dep;
        for (int64_t a = parents[t]; a >= 0; a = parents[a]) anc[--d] = a;
        for (int64_t j = 0; j < kc; ++j) {
            const int64_t i = dep + j;  // index into [state (kc); path]
            in[j] = i < kc ? stT.data() + i * nc : x + anc[i - kc] * ldx + c0;
        }
        in[kc] = x + t * ldx + c0;
        conv_row(out + t * n_ch + c0, in.data(), wT.data(), nc, d_conv);
    }
    for (int64_t t = 0; t < n_tok; ++t) silu_rows(out + t * n_ch + c0, nc);
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
