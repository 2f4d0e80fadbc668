// Attention for a few query tokens (decode, verify), as a ggml custom op on the CPU.
//
// ggml_flash_attn_ext on the CPU walks every key once per query row and head, converting and
// rescaling as it goes: a verify of 6 tokens spent 0.9 ms in it where an AR step spent 0.14 ms.
// Here a unit (a KV head and a run of tokens) converts each K and V row once for all its query
// rows, and each query row is computed alone with a fixed order of operations (16-lane dot products, a two-pass
// softmax over the keys in order, P.V summed over the keys in order), so its bits do not depend
// on the other tokens in the batch or on the thread split: verify equals the AR step bitwise.
#pragma once

#include "graph/build_context.h"

#include "ggml.h"

namespace dfn {

// Tokens up to which attention() takes the op (beyond: ggml_flash_attn_ext).
// (64: a tree verify of up to 64 nodes runs here, so it is bitwise too.)
constexpr int64_t k_attn_max_tokens = 64;

// q: F32 [hd, n_head, n_tokens]; K, V: F16 or F32 views [hd, n_kv_head, n_kv] (rows may be
// strided); mask: F16 [n_kv, n_tokens] (0 or -inf). Returns F32 [hd, n_head, n_tokens]:
// softmax(scale * q.K^T + mask) V per head, head h reading KV head h / (n_head / n_kv_head).
//
// gather (tree verify): each query row first gathers its kept keys (mask 0) in key order and
// runs the softmax sum and P.V over that gathered list. The softmax sum runs in 16 lanes by key
// index, so a tree node's keys at rows n_past + node would land in other lanes than the AR step
// of its path has them in (rows n_past + depth); gathered, the kept keys of a node sit at exactly
// the AR step's indices (committed rows, then its ancestors in order, then itself), and the
// operations are the AR step's, bit for bit. On a causal prefix mask gathering is the identity.
bool attn_op_supported(const ggml_tensor * q, const ggml_tensor * K, const ggml_tensor * V, const ggml_tensor * mask);
ggml_tensor * attn_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * K, ggml_tensor * V, ggml_tensor * mask,
                      float scale, bool gather = false);

// What the graph builders call (target KV-cache attention, the drafter's ring attention): attn_op
// when b asks for our own kernels (build_context.h) and it applies, else ggml_flash_attn_ext with
// F32 accumulation. Same arguments; returns F32 [hd * n_head, n_tokens].
ggml_tensor * attention(const build_context & b, ggml_tensor * q, ggml_tensor * K, ggml_tensor * V, ggml_tensor * mask,
                        float scale, bool gather = false);

}  // namespace dfn
