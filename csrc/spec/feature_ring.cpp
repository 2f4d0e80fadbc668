#include "models/drafter.h"

#include "base/alloc.h"
#include "base/common.h"

namespace dfn {

feature_ring::feature_ring(const drafter_hparams & hp, int64_t capacity_, int64_t scratch_, ggml_backend_buffer_type_t buft)
    : capacity(capacity_), scratch(scratch_) {
    DFN_REQUIRE(capacity >= 1, "feature_ring", "capacity must be >= 1, got ", capacity);
    DFN_REQUIRE(scratch >= 0, "feature_ring", "scratch must be >= 0, got ", scratch);
    ctx_.reset(init_meta_ctx(2 * (size_t) hp.n_layer, "feature_ring"));
    for (int il = 0; il < hp.n_layer; ++il) {
        k.push_back(ggml_new_tensor_3d(ctx_.get(), GGML_TYPE_F32, hp.head_dim, hp.n_head_kv, capacity + scratch));
        v.push_back(ggml_new_tensor_3d(ctx_.get(), GGML_TYPE_F32, hp.head_dim, hp.n_head_kv, capacity + scratch));
        ggml_format_name(k.back(), "ring.k.%d", il);
        ggml_format_name(v.back(), "ring.v.%d", il);
    }
    buf_.reset(alloc_ctx_tensors(ctx_.get(), buft, "feature_ring", cat("a feature ring of capacity ", capacity)));
    clear();
}

void feature_ring::clear() {
    ggml_backend_buffer_clear(buf_.get(), 0);
    n_pushed = 0;
}

int64_t feature_ring::slot_position(int64_t slot) const {
    if (slot < 0 || slot >= capacity || slot >= n_pushed) return -1;
    // the newest position in this slot: the largest p < n_pushed with p % capacity == slot
    const int64_t last = n_pushed - 1;
    const int64_t base = last - (last % capacity);
    const int64_t p = base + slot;
    return p <= last ? p : p - capacity;
}

}  // namespace dfn
