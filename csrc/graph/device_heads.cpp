#include "graph/device_heads.h"

#include "ggml-backend.h"

#include <cmath>
#include <vector>

namespace dfn {

device_head device_argmax(const build_context & b, ggml_tensor * logits, bool with_p) {
    ggml_context * ctx = b.ctx;
    device_head h;
    h.ids = ggml_argmax(ctx, logits);      // I32 [rows]
    h.sums = ggml_sum_rows(ctx, logits);   // F32 [1, rows]
    for (ggml_tensor * t : {h.ids, h.sums}) {
        ggml_set_output(t);
        ggml_build_forward_expand(b.gf, t);
    }
    if (with_p) {
        // the largest probability of each row: a max pool over the whole row of the softmax
        const int n = (int) logits->ne[0];
        ggml_tensor * probs = ggml_soft_max(ctx, logits);                                   // [n, rows]
        h.p = ggml_pool_2d(ctx, probs, GGML_OP_POOL_MAX, n, 1, n, 1, 0.0f, 0.0f);          // [1, rows]
        ggml_set_output(h.p);
        ggml_build_forward_expand(b.gf, h.p);
    }
    return h;
}

device_head device_topk(const build_context & b, ggml_tensor * logits, int64_t K) {
    ggml_context * ctx = b.ctx;
    const int64_t n = logits->ne[0], rows = logits->ne[1];
    device_head h;
    h.ids = ggml_argsort_top_k(ctx, logits, (int) K);  // I32 [K, rows], probability descending
    ggml_tensor * probs = ggml_reshape_3d(ctx, ggml_soft_max(ctx, logits), 1, n, rows);
    h.p = ggml_get_rows(ctx, probs, h.ids);             // F32 [1, K, rows]
    h.sums = ggml_sum_rows(ctx, logits);                // F32 [1, rows]
    for (ggml_tensor * t : {h.ids, h.p, h.sums}) {
        ggml_set_output(t);
        ggml_build_forward_expand(b.gf, t);
    }
    return h;
}

int64_t read_device_head(const device_head & h, int32_t * ids, float * p) {
    const int64_t rows = ggml_nelements(h.sums), n_ids = ggml_nelements(h.ids);
    std::vector<float> sums(rows);
    ggml_backend_tensor_get(h.sums, sums.data(), 0, rows * sizeof(float));
    if (ids) ggml_backend_tensor_get(h.ids, ids, 0, n_ids * sizeof(int32_t));
    if (p && h.p) ggml_backend_tensor_get(h.p, p, 0, n_ids * sizeof(float));
    for (int64_t r = 0; r < rows; ++r) {
        if (!std::isfinite(sums[r])) return r;
    }
    return -1;
}

}  // namespace dfn
