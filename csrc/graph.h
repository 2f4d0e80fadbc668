// Graph-building context shared by all architectures, and the blocks they share.
#pragma once

#include "cache.h"
#include "model.h"

#include "ggml.h"

#include <vector>

namespace dfn {

// Everything one forward pass needs: the ggml context it builds in, its inputs and the
// cache it reads and appends to. Positions are n_past .. n_past + n_tokens - 1.
struct graph_inputs {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    const target_hparams * hp = nullptr;
    model_cache * cache = nullptr;

    int64_t n_tokens = 0;
    int64_t n_past = 0;
    int64_t n_kv = 0;  // >= n_past + n_tokens: attention spans the live prefix (padded, masked)

    ggml_tensor * tokens = nullptr;   // I32 [n_tokens]
    ggml_tensor * pos = nullptr;      // I32 [n_tokens] (x4 for multi-section RoPE)
    ggml_tensor * kq_mask = nullptr;  // F16 [n_kv, n_tokens]: 0 or -inf, causal (-inf past the live rows)

    // Verify pass: GDN layers record their tape and leave their state alone (see gdn_tape.h);
    // the caller commits the accepted prefix afterwards.
    bool record_tape = false;

    // Hidden-state taps: output of layer tap_layers[i] (after its residual), F32 [n_embd, n_tokens].
    std::vector<int> tap_layers;
    std::vector<ggml_tensor *> taps;

    void tap(int il, ggml_tensor * cur);
};

ggml_tensor * rms_norm(graph_inputs & g, ggml_tensor * x, ggml_tensor * w);

// SwiGLU: down( silu(gate x) * (up x) )
ggml_tensor * ffn_swiglu(graph_inputs & g, ggml_tensor * x, const layer_weights & w);

// Causal attention over the cache of layer il after appending k/v at n_past.
// q: F32 [head_dim, n_head, n_tokens], k/v: F32 [head_dim, n_head_kv, n_tokens].
// Returns F32 [head_dim * n_head, n_tokens].
ggml_tensor * attention_kv(graph_inputs & g, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float scale);

// Gated DeltaNet mixer with its short conv, reading and updating the layer's GDN state.
// x: F32 [n_embd, n_tokens] (after attn_norm). Returns F32 [n_embd, n_tokens].
ggml_tensor * gdn_mixer(graph_inputs & g, int il, const layer_weights & w, ggml_tensor * x);

}  // namespace dfn
