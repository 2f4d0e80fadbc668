// GDN tape: record (k_t, u_t, g_t) per token per value head during a verify pass, and replay
// the accepted prefix onto the saved state. See docs/architecture.md, "GDN tape".
//
// Per value head h (key head h % H_k: tiled broadcast, as ggml_gated_delta_net), state S (d_k x d_v):
//   S'  = exp(g_t) S
//   u_t = beta_t (v_t - S'^T k_t)
//   S   = S' + k_t u_t^T
//   o_t = S^T q_t / sqrt(d_k)
// State memory layout is ggml's: M[j * S + i] = S[i][j] (k index fastest), per head.
//
// This CPU file is the reference csrc/kernels/metal/gdn_tape.metal was written against (that
// kernel is not built: docs/architecture.md). Devices run ggml's own op instead (graph.cpp).
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dfn {

// Strided views of the inputs (strides in floats).
struct gdn_inputs {
    const float * q; int64_t q_s1, q_s2;  // [S, H_k, T]: element (i, hk, t) at i + hk*q_s1 + t*q_s2
    const float * k; int64_t k_s1, k_s2;  // [S, H_k, T]
    const float * v; int64_t v_s1, v_s2;  // [S, H_v, T]
    const float * g; int64_t g_s1;        // [H_v, T]: (h, t) at h + t*g_s1  (log decay)
    const float * beta; int64_t b_s1;     // [H_v, T]
};

struct gdn_tape_view {
    float * k;  // [S, H_v, T_cap]: element (i, h, t) at i + S*(h + H_v*t)
    float * u;  // [S, H_v, T_cap]
    float * g;  // [H_v, T_cap]:  (h, t) at h + H_v*t
};

// Runs T tokens from state0 (read only) for value heads [h0, h1): writes outputs o
// [S, H_v, T] (contiguous) and the tape. The state after the pass is not kept.
void gdn_tape_record(const gdn_inputs & in, const float * state0, float * o, gdn_tape_view tape,
                     int64_t S, int64_t H_k, int64_t H_v, int64_t T, int64_t h0, int64_t h1);

// The AR pass with the same arithmetic: state advanced in place by T tokens, outputs o.
void gdn_forward(const gdn_inputs & in, float * state, float * o, int64_t S, int64_t H_k, int64_t H_v, int64_t T,
                 int64_t h0, int64_t h1);

// state <- the state after the first n tokens of the tape, for value heads [h0, h1).
// Token by token with the forward kernels' own update (S = e^g S + k u^T), so the result is
// bitwise the state a forward pass over those n tokens reaches. (The closed form
// S_n = e^{G_n} S_0 + sum_t e^{G_n - G_t} k_t u_t^T has the same cost in flops but rounds
// differently, which a chaotic model amplifies into different greedy tokens.)
void gdn_tape_replay(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n,
                     int64_t h0, int64_t h1);

// Same, spread over n_threads threads.
void gdn_tape_replay_mt(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n, int n_threads);

// ---- GDN over a tree (tree verify) ----
//
// Node t of T (parents[t] < t, -1 for the root) must see the state after its own path only:
// S_t = U_t(S_parent(t)), with U_t the per-token update above (same forward_token, so a node's
// output and tape entry are the AR step's of its path, bit for bit); the root starts from the
// committed state S_c. The tape entry of node t, (k_t, u_t, g_t) at tape slot t, has its u_t
// computed against S_parent(t), so on commit the accepted path's entries, compacted into slots
// 0..n-1 in path order (target_session::commit_tree), replay onto S_c exactly as a chain's do.
//
// Memory: a state per node would be T * H_v * d_k * d_v floats (the cap another engine puts on
// its tree size). Here each head walks the tree depth-first (children by index) from one working
// state: descending into a child advances it in place; before descending into a child that is
// not its parent's last, the parent's state is pushed, and popped (copied back) to go on to the
// next sibling. Only branch points on the current path are held: per thread at most
// (1 + b) * d_k * d_v floats, b = the most such pushes on one root-to-leaf path (b <= depth <
// block size, and b <= leaves - 1), besides the tape's T * (d_k + d_v + 1) per head. Rebuilding
// a branch point from S_c by replaying the path's tape instead would need no stack at all but
// cost depth extra updates per branch: the copy (one read and one write of d_k * d_v floats per
// push and per pop) is cheaper than one update (a read and a write of the state plus two dot
// products per row) for every depth > 0, so the stack wins whenever memory allows, which at
// b * 64 KiB per head-thread (d = 128) it always does here. Compute: exactly T updates per head,
// as a chain verify of T tokens, plus (leaves - 1) push/pop copies.
void gdn_tree_record(const gdn_inputs & in, const float * state0, float * o, gdn_tape_view tape, const int32_t * parents,
                     int64_t S, int64_t H_k, int64_t H_v, int64_t T, int64_t h0, int64_t h1);

// The ggml CPU custom ops below first replay `replay_n` tokens of the cache's tape (tape_k,
// tape_u, tape_g: gdn_tape_view layout) into `state`, head by head on the thread that then runs
// that head (the deferred end of a commit; 0 = nothing pending).

// gdn_forward: returns o F32 [S*H_v*T]; advances `state` in place.
ggml_tensor * gdn_forward_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                             ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k, ggml_tensor * tape_u,
                             ggml_tensor * tape_g, int64_t replay_n);

// gdn_tape_record. q, k: [S, H_k, T, 1]; v: [S, H_v, T, 1]; g, beta: [1, H_v, T, 1]; state:
// [S, S, H_v] (not modified by the recording). Returns o F32 [S*H_v*T] and writes the tape of
// these T tokens to tape_k, tape_u, tape_g (after the replay has read the old one). With null
// tape tensors: no replay, and the result packs [o S*H_v*T | tape k S*H_v*T | tape u S*H_v*T |
// tape g H_v*T]. (The snapshot-rollback baseline's record op: gdn_snapshots.h.)
ggml_tensor * gdn_tape_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                 ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k,
                                 ggml_tensor * tape_u, ggml_tensor * tape_g, int64_t replay_n);

// What the tree op reads on the host besides its tensors: a ggml custom op takes at most 9
// sources and q, k, v, g, beta, state and the three tape tensors use them all, so the parents
// (and the deferred replay count) travel in a struct the cache owns (model_cache::tree), set by
// target_session::verify_tree before the graph runs and read only while it runs.
struct gdn_tree_pass {
    int64_t replay_n = 0;
    std::vector<int32_t> parents;  // [T]
};

// gdn_tree_record as a ggml op on the cache's tape (host memory only): q, k, v, g, beta, state
// as gdn_tape_record_op. Replays pass->replay_n first, as the chain record op.
ggml_tensor * gdn_tree_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                                 ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k, ggml_tensor * tape_u,
                                 ggml_tensor * tape_g, const gdn_tree_pass * pass);

}  // namespace dfn
