// Graph-building context shared by all architectures, and the blocks they share.
#pragma once

#include "graph/build_context.h"
#include "runtime/cache.h"
#include "models/model.h"

#include "ggml.h"

#include <functional>
#include <vector>

namespace dfn {

// Everything one forward pass of a target needs: the build context (ggml context, graph, kernel
// choice), the target's hparams, its inputs and the cache it reads and appends to. Positions are
// n_past .. n_past + n_tokens - 1.
struct graph_inputs : build_context {
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

    // Tree verify (record_tape too): token i is a node of a tree whose parent is parents[i] < i
    // (-1: the root), at position n_past + depth(i). kq_mask shows each node the committed rows
    // and its ancestors only; attention gathers the kept keys (attn.h), the GDN conv and
    // recurrence run over each node's ancestors (conv.h, gdn_tape.h). Null: a chain.
    ggml_tensor * tree_parents = nullptr;  // I32 [n_tokens]

    // Hidden-state taps: output of layer tap_layers[i] (after its residual), F32 [n_embd, n_tokens].
    std::vector<int> tap_layers;
    std::vector<ggml_tensor *> taps;

    // A batch of several sequences (target_session::decode_batch): the n_tokens columns are the
    // segments' tokens one after another, each segment one sequence slot's work at its own positions
    // over its own cache. Empty: one sequence, the fields above. The ops that mix tokens (attention,
    // the GDN conv and recurrence) run once per segment as a one-sequence pass of its tokens does
    // (segment()); everything else (matmuls, norms, RoPE, FFNs) runs once over all columns.
    struct seq_segment {
        model_cache * cache = nullptr;
        int64_t tok0 = 0;      // first column of the batch
        int64_t n_tokens = 0;
        int64_t n_past = 0;
        int64_t n_kv = 0;      // as above, for this sequence
        ggml_tensor * kq_mask = nullptr;  // F16 [n_kv, n_tokens]
        bool record_tape = false;         // a verify
        ggml_tensor * tree_parents = nullptr;  // I32 [n_tokens]: a tree verify's (null: a chain)
    };
    std::vector<seq_segment> segs;

    // The one-sequence inputs of segment s (its cache, positions, mask, tape), for the blocks that
    // run per sequence; taps are not taken through it.
    graph_inputs segment(const seq_segment & s) const;

    void tap(int il, ggml_tensor * cur);
};

// Columns [c0, c0 + n) of x along its dimension `dim` (the token dimension), as a view.
ggml_tensor * columns_view(const build_context & b, ggml_tensor * x, int dim, int64_t c0, int64_t n);
// Segment s's columns [s.tok0, s.tok0 + s.n_tokens) of x (columns_view).
inline ggml_tensor * segment_view(const build_context & b, ggml_tensor * x, int dim, const graph_inputs::seq_segment & s) {
    return columns_view(b, x, dim, s.tok0, s.n_tokens);
}
// The segments' outputs (each [.., n_tokens_s, ..] along `dim`) joined in batch order along `dim`.
ggml_tensor * join_segments(const build_context & b, std::vector<ggml_tensor *> parts, int dim);

// ---- blocks shared by the targets and the drafter ----

// RMSNorm of each column of x, times w: F32 [n, n_tokens] for x [n, n_tokens], w F32 [n].
ggml_tensor * rms_norm(const build_context & b, ggml_tensor * x, ggml_tensor * w, float eps);
inline ggml_tensor * rms_norm(graph_inputs & g, ggml_tensor * x, ggml_tensor * w) { return rms_norm(g, x, w, g.hp->rms_eps); }

// NeoX RoPE of the first n_rot dims of each head, base hp.rope_base, with hp.rope's scaling
// (linear or YaRN): x F32 [head_dim, n_head, n_tokens], pos I32 [n_tokens].
ggml_tensor * rope_neox(const build_context & b, ggml_tensor * x, ggml_tensor * pos, int64_t n_rot,
                        const block_hparams & hp);
// Multi-section RoPE (ggml mode `mode`, e.g. GGML_ROPE_TYPE_IMROPE) of the first n_rot dims, with
// the same scaling: pos I32 [n_tokens * 4], one position per section.
ggml_tensor * rope_multi(const build_context & b, ggml_tensor * x, ggml_tensor * pos, int64_t n_rot,
                         const int sections[4], int mode, const block_hparams & hp);

// Llama's RoPE (GGML_ROPE_TYPE_NORM: rotates adjacent pairs (2i, 2i+1), the converter permutes W_q / W_k
// rows to that order) of the first n_rot dims of each head; freq_factors F32 [n_rot / 2] divides
// frequency i (Llama 3.1's llama3 scaling, the GGUF's rope_freqs), or null. x, pos as rope_neox.
ggml_tensor * rope_norm(const build_context & b, ggml_tensor * x, ggml_tensor * pos, ggml_tensor * freq_factors,
                        int64_t n_rot, int64_t n_ctx_train, float base);

// SwiGLU: down( silu(gate x) * (up x) ). x: F32 [n_embd, n_tokens] -> F32 [n_embd, n_tokens].
ggml_tensor * ffn_swiglu(const build_context & b, ggml_tensor * x, const layer_weights & w);

// Rows [row0, row0 + n) of a K/V store (cache or ring) t [head_dim, n_head_kv, rows], as a view.
ggml_tensor * kv_rows(const build_context & b, ggml_tensor * t, int64_t row0, int64_t n);
// Writes src F32 [head_dim, n_head_kv, n] into rows [row0, row0 + n) of t, ordered in the graph
// before anything added after it (ggml computes nodes in order).
void write_kv_rows(const build_context & b, ggml_tensor * t, ggml_tensor * src, int64_t row0);

// ---- target blocks ----

// RoPE as an architecture applies it to q or k F32 [head_dim, n_heads, n_tokens].
using rope_fn = std::function<ggml_tensor *(ggml_tensor *)>;

// The q, k, v projections of x F32 [n_embd, n_tokens], from W_q, W_k, W_v or from one fused W_qkv (the
// same dot products, so the same bits): q F32 [q_mult * head_dim * n_head, n_tokens] (a view: step
// tokens by q->nb[1]), k and v F32 [head_dim, n_head_kv, n_tokens] (views too when fused).
struct qkv_proj {
    ggml_tensor * q;
    ggml_tensor * k;
    ggml_tensor * v;
};
qkv_proj project_qkv(graph_inputs & g, const layer_weights & L, ggml_tensor * x);

// Grouped-query self-attention of layer il over the cache (Llama, Qwen3, Qwen3-MoE): W_q, W_k, W_v,
// q/k RMSNorm when L has them, `rope`, attention_kv with 1/sqrt(head_dim), W_o.
// x: F32 [n_embd, n_tokens] (after attn_norm). Returns F32 [n_embd, n_tokens].
ggml_tensor * self_attention(graph_inputs & g, int il, const layer_weights & L, ggml_tensor * x, const rope_fn & rope);

// Causal attention over the cache of layer il after appending k/v at n_past.
// q: F32 [head_dim, n_head, n_tokens], k/v: F32 [head_dim, n_head_kv, n_tokens].
// Returns F32 [head_dim * n_head, n_tokens].
ggml_tensor * attention_kv(graph_inputs & g, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float scale);

// Gated attention of layer il (Qwen3.5, Qwen3-Next): W_q emits [q | gate] per head, q/k RMSNorm,
// `rope`, attention_kv with 1/sqrt(head_dim), then attn * sigmoid(gate) and W_o.
// x: F32 [n_embd, n_tokens] (after attn_norm). Returns F32 [n_embd, n_tokens].
ggml_tensor * gated_attention(graph_inputs & g, int il, const layer_weights & L, ggml_tensor * x, const rope_fn & rope);

// What a GDN layer's input projections give for one batch; each architecture lays its weights
// out differently (Qwen3.5: separate W_beta / W_alpha; Qwen3-Next: one fused W_ba) and splits them.
struct gdn_proj {
    ggml_tensor * qkv = nullptr;  // F32 [n_ch, n_tok]: conv input, channels [q (S*H_k) | k (S*H_k) | v (S*H_v)]
    ggml_tensor * z = nullptr;    // F32 [S * H_v, n_tok]: output gate
    ggml_tensor * b = nullptr;    // F32 [H_v, n_tok]: beta = sigmoid(b)
    ggml_tensor * a = nullptr;    // F32 [H_v, n_tok]: log decay g = softplus(a + dt_bias) * ssm_a
};

// The GDN block from its projections: short conv (and its state), L2-normalised q/k, the delta rule
// over the layer's state (or the tape on a verify), per-head RMSNorm gated by SiLU(z), ssm_out.
// v_grouped: value head h reads key head h / (H_v / H_k) (Qwen3-Next; HF's repeat_interleave), so
// q/k are repeated to H_v heads first; otherwise key head h % H_k (Qwen3.5's tiled order, which
// the GDN ops broadcast themselves). Returns F32 [n_embd, n_tokens].
ggml_tensor * gdn_block(graph_inputs & g, int il, const layer_weights & w, const gdn_proj & p, bool v_grouped);

// Qwen3.5's Gated DeltaNet mixer: the W_qkv, W_z, W_beta, W_alpha projections, then gdn_block.
// x: F32 [n_embd, n_tokens] (after attn_norm). Returns F32 [n_embd, n_tokens].
ggml_tensor * gdn_mixer(graph_inputs & g, int il, const layer_weights & w, ggml_tensor * x);

}  // namespace dfn
