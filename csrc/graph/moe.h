// The routed mixture-of-experts FFN the MoE architectures share (qwen3moe; qwen35moe and qwen3next
// add a shared expert around it).
#pragma once

#include "graph/build_context.h"
#include "gguf/gguf_file.h"
#include "models/model.h"

#include "ggml.h"

namespace dfn {

// Reads `<arch>.expert_count`, `expert_used_count`, `expert_feed_forward_length`,
// `expert_shared_feed_forward_length` (absent: no shared expert) and `expert_weights_norm`
// (default true, as llama.cpp's qwen3moe / qwen35moe graphs always renormalise) into hp, and checks
// them: 1 <= used <= count <= k_max_experts, the widths in [1, k_max_dim].
void read_moe_hparams(const gguf_file & f, target_hparams & hp);

// The router and stacked experts of layer il (and the shared expert with its gate when
// hp.n_ff_shexp > 0), shapes and types checked against hp.
void load_moe(gguf_file & F, int il, const target_hparams & hp, layer_weights & L);

// Routed SwiGLU experts, per token: p = softmax(W_router x) over the experts, the n_expert_used
// largest (ggml_argsort_top_k, descending), weights p_sel (/ sum p_sel when expert_weights_norm),
// out = sum_j w_j down_j(silu(gate_j x) * up_j x), summed in that descending order.
// Every step is per token (router matmul() is batch-invariant, softmax, sort; the experts through
// moe_experts_op, the batch-invariant kernel per expert: moe_experts.h), so a token's experts and
// its sum do not depend on the rest of the batch. Where moe_experts_op does not apply (a device,
// matmul="ggml", a weight type the kernel does not take) the experts go through ggml_mul_mat_id,
// which is not batch-invariant for the K- and IQ-quants (moe_experts.h).
// With a shared expert (w.ffn_gate_shexp): out += sigmoid(w_gate_shexp . x) * SwiGLU_shexp(x), after the
// routed sum (Qwen3.5-MoE, Qwen3-Next).
// x: F32 [n_embd, n_tokens] -> F32 [n_embd, n_tokens].
ggml_tensor * moe_ffn(const build_context & b, ggml_tensor * x, const layer_weights & w, const target_hparams & hp);

// A layer's FFN: routed experts (moe_ffn) when it has them, else SwiGLU (graph.h: ffn_swiglu).
ggml_tensor * ffn_block(const build_context & b, ggml_tensor * x, const layer_weights & w, const target_hparams & hp);

constexpr int64_t k_max_experts = 1 << 12;

}  // namespace dfn
