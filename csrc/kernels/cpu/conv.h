// The GDN layers' causal depthwise conv + SiLU over [conv state; this batch], as one ggml CPU
// custom op: what ggml_concat (of a transposed batch) + ggml_ssm_conv + ggml_silu do in three
// nodes, without building the concatenation.
#pragma once

#include "ggml.h"

#include <cstdint>

namespace dfn {

// state: F32 [d_conv - 1, n_ch] (the last inputs, oldest first); x: F32 [n_ch, n_tok] (rows may be
// strided); w: F32 [d_conv, n_ch]. Returns F32 [n_ch, n_tok]:
//   out[t][c] = silu(sum_{j < d_conv} w[c][j] * in_c[t + j]),  in_c = [state[c][:], x[:][c]].
// update_state: the op also moves the state to the last d_conv - 1 inputs (a decode step; a verify
// leaves it to commit()).
bool conv_silu_supported(const ggml_tensor * state, const ggml_tensor * x, const ggml_tensor * w);
ggml_tensor * conv_silu_op(ggml_context * ctx, ggml_tensor * state, ggml_tensor * x, ggml_tensor * w, bool update_state);

// Over a tree (tree verify): token t is a node whose parent is parents[t] < t (-1: the root;
// parents I32 [n_tok]). Its window is its own path: the last d_conv - 1 inputs before it along
// root..parent, above the root the state (oldest first), then itself; each output is the same
// sum as conv_silu_op's for that path, in the same order, so it is the AR step's bit for bit.
// The state is left alone (commit() moves it along the accepted path).
ggml_tensor * conv_silu_tree_op(ggml_context * ctx, ggml_tensor * state, ggml_tensor * x, ggml_tensor * w,
                                ggml_tensor * parents);
void conv_silu_tree_channels(const float * state, const float * x, int64_t ldx, const int32_t * parents, const float * w,
                             float * out, int64_t d_conv, int64_t n_ch, int64_t n_tok, int64_t c0, int64_t c1);

// The kernel, for channels [c0, c1) (tests): state [n_ch][d_conv-1], x[t * ldx + c], w [n_ch][d_conv],
// out [n_tok][n_ch].
void conv_silu_channels(float * state, bool update_state, const float * x, int64_t ldx, const float * w, float * out,
                        int64_t d_conv, int64_t n_ch, int64_t n_tok, int64_t c0, int64_t c1);

}  // namespace dfn
