// Sequence state of a target: attention K/V by position, GDN recurrent and conv state.
#pragma once

#include "kernels/cpu/gdn_tape.h"
#include "models/model.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <functional>
#include <vector>

namespace dfn {

struct kv_layer {
    ggml_tensor * k = nullptr;  // [head_dim, n_head_kv, n_ctx]  (kv type)
    ggml_tensor * v = nullptr;  // [head_dim, n_head_kv, n_ctx]
};

struct gdn_layer {
    ggml_tensor * conv = nullptr;  // F32 [d_conv - 1, conv_channels]: the last conv inputs, oldest first
    ggml_tensor * ssm = nullptr;   // F32 [S, S, n_v_heads]: S^T per head (ggml_gated_delta_net layout, k fastest)

    // Tape of the last verify pass (see gdn_tape.h); T_cap = model_cache::n_tape tokens.
    // Host (CPU kernels): k, u = the corrected value, g. Device (stock ggml ops): the GDN op's own
    // inputs k, v, g, beta, replayed through ggml_gated_delta_net at commit (docs "Devices").
    ggml_tensor * tape_k = nullptr;    // F32 [S, n_v_heads, T_cap] (device: k of tape_k_heads heads per token)
    ggml_tensor * tape_u = nullptr;    // F32 [S, n_v_heads, T_cap] (device: v)
    ggml_tensor * tape_g = nullptr;    // F32 [n_v_heads, T_cap]
    ggml_tensor * tape_beta = nullptr; // F32 [n_v_heads, T_cap]: device only
    int64_t tape_k_heads = 0;          // device: heads of k per token (H_k, or H_v when repeated)
    ggml_tensor * tape_qkv = nullptr;  // F32 [conv_channels, T_cap]: conv inputs, for the conv state
    ggml_tensor * snapshots = nullptr; // F32 [S * S * n_v_heads, T_cap]: state after each token
                                       // (only for the snapshot rollback baseline)
};

// Rollback of attention K/V is a cursor move: rows at positions >= n_past are dead and
// are overwritten by the next decode. GDN state has no positions; it is the state after
// exactly n_past tokens.
class model_cache {
public:
    // n_tape: the most tokens one verify pass may record (0: no verify on this cache).
    // layer_buft(il): where layer il's cache lives (a model split over devices: its layer's device).
    // device_tape: the tape in the device form (the GDN op's inputs, with tape_beta: graph.h).
    model_cache(const target_hparams & hp, int64_t n_ctx, ggml_type kv_type, int64_t n_tape, bool snapshots, bool device_tape,
                const std::function<ggml_backend_buffer_type_t(int)> & layer_buft);
    model_cache(const model_cache &) = delete;
    model_cache & operator=(const model_cache &) = delete;

    void clear();  // n_past = 0 and GDN state zeroed

    int64_t n_ctx = 0;
    int64_t n_past = 0;
    int64_t n_tape = 0;
    // Tape tokens the GDN states (host buffers) have yet to take: commit() leaves the replay to
    // the next graph's GDN op, which does it per head on its own threads before its own tokens.
    int64_t replay_n = 0;
    // A pending tree verify's parents and replay count, for its GDN ops (gdn_tape.h: gdn_tree_pass).
    gdn_tree_pass tree;
    ggml_type kv_type;
    std::vector<kv_layer> kv;    // per layer; null tensors on GDN layers
    std::vector<gdn_layer> gdn;  // per layer; null tensors on attention layers
    size_t bytes() const;
    size_t kv_bytes() const;         // attention K/V, all layers
    size_t gdn_state_bytes() const;  // GDN recurrent + conv state
    size_t gdn_tape_bytes() const;   // GDN tape (with the snapshot baseline's snapshots)
    // The buffers holding the tensors' data, one per device (or the host) they live on.
    const std::vector<ggml_backend_buffer_ptr> & buffers() const { return bufs_; }

private:
    ggml_context_ptr ctx_;         // tensor metadata (freed last: declared first)
    std::vector<ggml_backend_buffer_ptr> bufs_;  // the tensors' data (one buffer per device)
};

}  // namespace dfn
