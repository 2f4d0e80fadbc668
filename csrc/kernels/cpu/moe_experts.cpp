#include "kernels/cpu/moe_experts.h"
#include "base/alloc.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/matmul/dispatch.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace dfn {

namespace {

// Rows per work unit: a whole number of tiles on every path of the rows kernel (matmul.cpp's
// k_row_unit), so only an expert's last unit runs a partial tile.
constexpr int64_t k_row_unit = 48;

// A unit's weight in the thread split: rows x (k_unit_cols + the expert's columns), streaming an
// expert's rows costing about as much as multiplying them by a few columns. Speed only: the
// outputs do not depend on the split.
constexpr int64_t k_unit_cols = 4;

int32_t id_at(const ggml_tensor * ids, int64_t j, int64_t t) {
    return *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + j * ids->nb[0]);
}

float * dst_col(ggml_tensor * dst, int64_t j, int64_t t) {
    return (float *) ((char *) dst->data + t * dst->nb[2] + j * dst->nb[1]);
}

void moe_experts_fn(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * W = dst->src[0];    // [K, M, n_expert]
    const ggml_tensor * x = dst->src[1];    // F32 [K, n_x, n_tok]
    const ggml_tensor * ids = dst->src[2];  // I32 [n_used, n_tok]
    const int64_t K = W->ne[0], M = W->ne[1], n_exp = W->ne[2];
    const int64_t n_used = ids->ne[0], n_tok = ids->ne[1], n_x = x->ne[1];

    // The routing, the same in every thread: expert e's columns are cols[start[e] .. start[e + 1]),
    // each t * n_used + j (token t's slot j), in token then slot order.
    thread_local std::vector<int64_t> start, next;  // [n_expert + 1], [n_expert]
    thread_local std::vector<int64_t> cols;         // [n_used * n_tok]
    if (!kernel_scratch(start, (size_t) (n_exp + 1), "the experts' routing") ||
        !kernel_scratch(next, (size_t) n_exp, "the experts' routing") ||
        !kernel_scratch(cols, (size_t) (n_used * n_tok), "the experts' routing"))
        return;  // noted; the runner throws it after the compute
    std::fill(start.begin(), start.end(), 0);
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < n_used; ++j) {
            const int32_t e = id_at(ids, j, t);
            if (e >= 0 && e < n_exp) ++start[e + 1];
        }
    }
    for (int64_t e = 0; e < n_exp; ++e) start[e + 1] += start[e];
    std::copy(start.begin(), start.begin() + n_exp, next.begin());
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < n_used; ++j) {
            const int32_t e = id_at(ids, j, t);
            if (e >= 0 && e < n_exp) cols[next[e]++] = t * n_used + j;
            else if (ith == 0) std::fill_n(dst_col(dst, j, t), M, std::numeric_limits<float>::quiet_NaN());
        }
    }

    // The units (expert e with columns, rows [48 u, 48 u + 48)) in expert order, unit u of e
    // starting at weight acc_e + (k_unit_cols + n_e) 48 u; this thread takes those that start in
    // [total ith / nth, total (ith + 1) / nth): a contiguous run, at most one row range per expert.
    int64_t total = 0;
    for (int64_t e = 0; e < n_exp; ++e) {
        if (const int64_t n = start[e + 1] - start[e]) total += (k_unit_cols + n) * M;
    }
    const int64_t lo = total * ith / nth, hi = total * (ith + 1) / nth;
    const int64_t n_units = (M + k_row_unit - 1) / k_row_unit;
    const int64_t ldx = (K + 15) / 16 * 16;  // gathered columns on 64-byte lines (matmul.cpp's matmul_fn)
    const auto * dispatch = (const matmul_dispatch *) userdata;
    int64_t acc = 0;
    for (int64_t e = 0; e < n_exp && acc < hi; ++e) {
        const int64_t N = start[e + 1] - start[e];
        if (N == 0) continue;
        const int64_t per_unit = (k_unit_cols + N) * k_row_unit;
        auto first_unit_from = [&](int64_t w) { return std::clamp<int64_t>((w - acc + per_unit - 1) / per_unit, 0, n_units); };
        const int64_t u0 = lo <= acc ? 0 : first_unit_from(lo), u1 = first_unit_from(hi);
        acc += (k_unit_cols + N) * M;
        if (u0 >= u1) continue;
        const int64_t r0 = u0 * k_row_unit, r1 = std::min(M, u1 * k_row_unit), rows = r1 - r0;

        // x's columns routed to e, gathered: xs [N][ldx]; the product ys [N][rows]
        thread_local std::vector<float> xbuf, ys;
        if (!kernel_scratch(xbuf, (size_t) (N * ldx + 16), "the experts' gathered input") ||
            !kernel_scratch(ys, (size_t) (N * rows), "the experts' output"))
            return;
        float * xs = xbuf.data() + (16 - (uintptr_t) xbuf.data() / sizeof(float) % 16) % 16;
        for (int64_t n = 0; n < N; ++n) {
            const int64_t t = cols[start[e] + n] / n_used, j = cols[start[e] + n] % n_used;
            const char * src = (const char *) x->data + t * x->nb[2] + (n_x == 1 ? 0 : j) * x->nb[1];
            std::memcpy(xs + n * ldx, src, (size_t) K * sizeof(float));
        }
        const isa_level level = dispatch ? dispatch->isa_for(W->type, N) : isa_in_use();
        const char * We = (const char *) W->data + e * W->nb[2] + r0 * W->nb[1];  // rows [r0, r1) of expert e
        if (!matmul_rows_at(level, We, W->type, W->nb[1], xs, ldx, ys.data(), rows, K, N, 0, rows)) return;
        for (int64_t n = 0; n < N; ++n) {
            const int64_t t = cols[start[e] + n] / n_used, j = cols[start[e] + n] % n_used;
            std::memcpy(dst_col(dst, j, t) + r0, ys.data() + n * rows, (size_t) rows * sizeof(float));
        }
    }
}

}  // namespace

bool moe_experts_supported(const ggml_tensor * W, const ggml_tensor * x, const ggml_tensor * ids) {
    if (!matmul_weight_type(W->type) || x->type != GGML_TYPE_F32 || ids->type != GGML_TYPE_I32) return false;
    if (W->ne[3] != 1 || x->ne[3] != 1 || ids->ne[2] != 1 || ids->ne[3] != 1) return false;
    if (W->ne[0] != x->ne[0] || W->ne[0] % ggml_blck_size(W->type) != 0) return false;
    if ((x->ne[1] != 1 && x->ne[1] != ids->ne[0]) || x->ne[2] != ids->ne[1]) return false;
    if (W->nb[0] != ggml_type_size(W->type) || W->nb[1] < ggml_row_size(W->type, W->ne[0])) return false;
    if ((W->type == GGML_TYPE_F16 || W->type == GGML_TYPE_F32) && W->nb[1] % ggml_type_size(W->type) != 0) return false;
    if (x->nb[0] != sizeof(float) || ids->nb[0] != sizeof(int32_t)) return false;
    // weights in a device buffer stay with ggml (the custom op runs on the CPU)
    if (W->buffer && !ggml_backend_buffer_is_host(W->buffer)) return false;
    return true;
}

ggml_tensor * moe_experts_op(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x, ggml_tensor * ids,
                             const matmul_dispatch * dispatch) {
    ggml_tensor * args[3] = {W, x, ids};
    ggml_tensor * y = ggml_custom_4d(ctx, GGML_TYPE_F32, W->ne[1], ids->ne[0], ids->ne[1], 1, args, 3, moe_experts_fn,
                                     GGML_N_TASKS_MAX, (void *) dispatch);
    ggml_set_name(y, "moe_experts");
    return y;
}

}  // namespace dfn
