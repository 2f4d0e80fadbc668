// The routed experts' matmuls of a MoE FFN (moe.h: moe_ffn) through the batch-invariant matmul
// kernel (matmul.h), grouped by expert.
//
// What ggml_mul_mat_id computes, with matmul.h's contract per output: y[:, j, t] = W_e x_(j, t) for
// the expert e = ids[j, t] of token t's slot j. Each expert's routed columns are gathered and
// multiplied by the rows kernel on that expert's weight slice, so every output is one fixed sequence
// of float operations of its expert row and its column alone -- not of how many tokens the batch
// holds, which of them share the expert, the thread split or the instruction set -- and a verify
// pass computes a token's experts exactly as its AR step. ggml_mul_mat_id does not: on the CPU it
// takes ggml's tiled K-quant kernel (Q2_K..Q6_K, IQ4_XS and the other IQ types) for an expert from 8
// routed columns on, whose sums are ordered otherwise than its one-column dot products (rounding,
// ~1e-6 relative, which the activations' Q8 codes and the top-k routing downstream turn into logit
// jumps of 0.1-1 in a random model).
//
// Threads: each runs the same routing pass (the columns per expert, in token then slot order), then
// takes a contiguous share of the work units (expert, block of 48 rows) weighted by the expert's
// column count; a unit's outputs do not depend on who computes them.
#pragma once

#include "ggml.h"

namespace dfn {

struct matmul_dispatch;

// True when moe_experts_op can compute the product: W a matmul_weight_type (matmul.h), 3-D with
// contiguous rows in a host buffer (or not yet allocated); x F32 3-D with contiguous rows,
// x->ne[0] == W->ne[0], x->ne[1] 1 or ids->ne[0]; ids I32 2-D, ids->ne[1] == x->ne[2].
bool moe_experts_supported(const ggml_tensor * W, const ggml_tensor * x, const ggml_tensor * ids);

// ggml CPU custom op "moe_experts", ggml_mul_mat_id's shapes:
//   W    [K, M, n_expert]    the stacked experts (gate / up: [n_embd, n_ff_exp, n_expert];
//                            down: [n_ff_exp, n_embd, n_expert])
//   x    F32 [K, n_x, n_tok] n_x 1: token t's activations for each of its slots (gate, up);
//                            n_x n_used: slot j's own (down)
//   ids  I32 [n_used, n_tok] the selected experts of each token
//   ->   F32 [M, n_used, n_tok]: y[:, j, t] = W[:, :, ids[j, t]] x[:, j or 0, t]
// An id outside [0, n_expert) gives NaN outputs for its slot. Each expert's columns run at the
// dispatch's level for W's type and their count (nullptr: isa_in_use()); dispatch must outlive the
// graph (the runner's own does).
ggml_tensor * moe_experts_op(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x, ggml_tensor * ids,
                             const matmul_dispatch * dispatch = nullptr);

}  // namespace dfn
