// Sequence state of a target: attention K/V by position, GDN recurrent and conv state.
#pragma once

#include "model.h"

#include "ggml-backend.h"

#include <vector>

namespace dfn {

struct kv_layer {
    ggml_tensor * k = nullptr;  // [head_dim, n_head_kv, n_ctx]  (kv type)
    ggml_tensor * v = nullptr;  // [head_dim, n_head_kv, n_ctx]
};

struct gdn_layer {
    ggml_tensor * conv = nullptr;  // F32 [d_conv - 1, conv_channels]: the last conv inputs, oldest first
    ggml_tensor * ssm = nullptr;   // F32 [S, S, n_v_heads]: S^T per head (ggml_gated_delta_net layout, k fastest)
};

// Rollback of attention K/V is a cursor move: rows at positions >= n_past are dead and
// are overwritten by the next decode. GDN state has no positions; it is the state after
// exactly n_past tokens.
class model_cache {
public:
    model_cache(const target_hparams & hp, int64_t n_ctx, ggml_type kv_type, ggml_backend_buffer_type_t buft);
    ~model_cache();
    model_cache(const model_cache &) = delete;
    model_cache & operator=(const model_cache &) = delete;

    void clear();  // n_past = 0 and GDN state zeroed

    int64_t n_ctx = 0;
    int64_t n_past = 0;
    ggml_type kv_type;
    std::vector<kv_layer> kv;    // per layer; null tensors on GDN layers
    std::vector<gdn_layer> gdn;  // per layer; null tensors on attention layers
    size_t bytes() const;

private:
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
};

}  // namespace dfn
