#include "models/drafter.h"

#include "base/alloc.h"
#include "base/common.h"

#include <cmath>

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

void fill_block_mask(const feature_ring & ring, int64_t n_past, int64_t n_ctx, int64_t n_att, int64_t R, int64_t lo,
                     int64_t w, bool causal, std::vector<ggml_fp16_t> & m) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    m.assign((size_t) n_att * R, ninf);
    std::vector<int64_t> slot_pos(n_ctx);
    for (int64_t s = 0; s < n_ctx; ++s) slot_pos[s] = ring.slot_position(s);
    for (int64_t i = 0; i < R; ++i) {
        const int64_t q = n_past + i;
        ggml_fp16_t * row = m.data() + (size_t) i * n_att;
        for (int64_t s = 0; s < n_ctx; ++s) {
            const int64_t k = slot_pos[s];
            row[s] = (k >= lo && (w == 0 || q - k < w)) ? zero : ninf;
        }
        for (int64_t j = 0; j < R; ++j) {
            const bool ok = (!causal || j <= i) && (w == 0 || (i > j ? i - j : j - i) < w);
            row[n_ctx + j] = ok ? zero : ninf;
        }
    }
}

}  // namespace dfn
