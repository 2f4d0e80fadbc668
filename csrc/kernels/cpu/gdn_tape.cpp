#include "kernels/cpu/gdn_tape.h"
#include "kernels/cpu/gdn_snapshots.h"
#include "base/alloc.h"

#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/vmath.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace dfn {

namespace {

// Hot loops: DFN_MULTIVERSION (cpu_isa.h) compiles them for AVX-512 / AVX2 / baseline.

// The state update of one token, shared word for word by the forward kernels and replay: an
// explicit fmaf so every build and clone rounds it the same way. This is what makes a replayed
// state bitwise equal to the state a forward pass reaches, and so speculative == AR exactly.
#define DFN_GDN_UPDATE(row, i, uj, k, eg) fmaf((uj), (k)[i], (eg) * (row)[i])

// One token on one head, row by row (row j of M is column j of S, contiguous in k):
//   d = S_j . k;  u_j = beta (v_j - e d);  S_j = e S_j + u_j k;  o_j = S_j . q / sqrt(S)
// The decay is folded into the row pass: one sweep over the state per token. The dot products
// run in one fixed order on every ISA: 32 lanes in two vectors of 16 (two independent chains keep
// the FMA units busy), element i on lane i % 32 as an fmaf chain, then lane l + 16 added to lane
// l and sum16; gdn_tape.cpp is built with -ffp-contract=off, so nothing else is fused either.
struct lanes32 {
    float a[16] = {}, b[16] = {};  // lanes 0..15, 16..31
    float & operator[](int64_t l) { return l < 16 ? a[l] : b[l - 16]; }
    float sum() {
        for (int l = 0; l < 16; ++l) a[l] += b[l];
        return sum16(a);
    }
};

DFN_MULTIVERSION(void, forward_token,
                 (float * __restrict M, const float * __restrict k, const float * __restrict q,
                  const float * __restrict v, float * __restrict u, float * __restrict o, float eg, float beta,
                  float scale, int64_t S),
                 (M, k, q, v, u, o, eg, beta, scale, S)) {
    const int64_t S32 = S / 32 * 32;
    for (int64_t j = 0; j < S; ++j) {
        float * __restrict row = M + j * S;
        lanes32 d;
        for (int64_t i0 = 0; i0 < S32; i0 += 32) {
#pragma omp simd
            for (int l = 0; l < 16; ++l) {
                d.a[l] = fmaf(row[i0 + l], k[i0 + l], d.a[l]);
                d.b[l] = fmaf(row[i0 + 16 + l], k[i0 + 16 + l], d.b[l]);
            }
        }
        for (int64_t i = S32; i < S; ++i) d[i - S32] = fmaf(row[i], k[i], d[i - S32]);
        const float uj = beta * (v[j] - eg * d.sum());
        lanes32 od;
        for (int64_t i0 = 0; i0 < S32; i0 += 32) {
#pragma omp simd
            for (int l = 0; l < 16; ++l) {
                const float x0 = DFN_GDN_UPDATE(row, i0 + l, uj, k, eg);
                const float x1 = DFN_GDN_UPDATE(row, i0 + 16 + l, uj, k, eg);
                row[i0 + l] = x0;
                row[i0 + 16 + l] = x1;
                od.a[l] = fmaf(x0, q[i0 + l], od.a[l]);
                od.b[l] = fmaf(x1, q[i0 + 16 + l], od.b[l]);
            }
        }
        for (int64_t i = S32; i < S; ++i) {
            const float x = DFN_GDN_UPDATE(row, i, uj, k, eg);
            row[i] = x;
            od[i - S32] = fmaf(x, q[i], od[i - S32]);
        }
        u[j] = uj;
        o[j] = od.sum() * scale;
    }
}

// S = e S + k u^T on one head: forward_token's state update without the dot products.
DFN_MULTIVERSION(void, replay_token,
                 (float * __restrict M, const float * __restrict k, const float * __restrict u, float eg, int64_t S),
                 (M, k, u, eg, S)) {
    for (int64_t j = 0; j < S; ++j) {
        float * __restrict row = M + j * S;
        const float uj = u[j];
#pragma omp simd
        for (int64_t i = 0; i < S; ++i) row[i] = DFN_GDN_UPDATE(row, i, uj, k, eg);
    }
}

// T tokens of head h on the state M (in place). With a tape, k/u/g are recorded; with
// snapshots, the state after every token.
void forward_head(const gdn_inputs & in, float * M, float * o, float * u_scratch, const gdn_tape_view * tape,
                  int64_t h, int64_t S, int64_t H_k, int64_t H_v, int64_t T, float * snapshots = nullptr) {
    const int64_t hk = h % H_k;
    const float scale = 1.0f / sqrtf((float) S);
    for (int64_t t = 0; t < T; ++t) {
        const float gt = in.g[h + t * in.g_s1];
        const float * k = in.k + hk * in.k_s1 + t * in.k_s2;
        float * u = u_scratch;
        if (tape) {
            tape->g[h + H_v * t] = gt;
            float * tk = tape->k + S * (h + H_v * t);
            std::memcpy(tk, k, (size_t) S * sizeof(float));
            k = tk;
            u = tape->u + S * (h + H_v * t);
        }
        forward_token(M, k, in.q + hk * in.q_s1 + t * in.q_s2, in.v + h * in.v_s1 + t * in.v_s2, u,
                      o + S * (h + H_v * t), expf(gt), in.beta[h + t * in.b_s1], scale, S);
        if (snapshots) std::memcpy(snapshots + (t * H_v + h) * S * S, M, (size_t) S * S * sizeof(float));
    }
}

// One node (tape slot t) of head h on the state M (in place): forward_head's step for one token,
// recording k, u, g at slot t.
void forward_node(const gdn_inputs & in, float * M, float * o, const gdn_tape_view & tape, int64_t h, int64_t t,
                  int64_t S, int64_t H_k, int64_t H_v) {
    const int64_t hk = h % H_k;
    const float gt = in.g[h + t * in.g_s1];
    tape.g[h + H_v * t] = gt;
    float * tk = tape.k + S * (h + H_v * t);
    std::memcpy(tk, in.k + hk * in.k_s1 + t * in.k_s2, (size_t) S * sizeof(float));
    forward_token(M, tk, in.q + hk * in.q_s1 + t * in.q_s2, in.v + h * in.v_s1 + t * in.v_s2,
                  tape.u + S * (h + H_v * t), o + S * (h + H_v * t), expf(gt), in.beta[h + t * in.b_s1],
                  1.0f / sqrtf((float) S), S);
}

// The depth-first walk of gdn_tape.h: M holds the parent's state on entry, node's on return
// unless restored by the caller; saves: the stack of branch-point states.
struct tree_walk {
    const gdn_inputs & in;
    float * o;
    const gdn_tape_view & tape;
    const std::vector<std::vector<int32_t>> & kids;
    int64_t h, S, H_k, H_v;
    float * saves;
    void visit(int32_t node, float * M, int64_t depth_saved) const {
        forward_node(in, M, o, tape, h, node, S, H_k, H_v);
        const std::vector<int32_t> & ks = kids[node];
        for (size_t i = 0; i < ks.size(); ++i) {
            if (i + 1 == ks.size()) {
                visit(ks[i], M, depth_saved);  // the last child takes the state as it is
                break;
            }
            float * sv = saves + depth_saved * S * S;
            std::memcpy(sv, M, (size_t) S * S * sizeof(float));
            visit(ks[i], M, depth_saved + 1);
            std::memcpy(M, sv, (size_t) S * S * sizeof(float));
        }
    }
};

}  // namespace

void gdn_tree_record(const gdn_inputs & in, const float * state0, float * o, gdn_tape_view tape, const int32_t * parents,
                     int64_t S, int64_t H_k, int64_t H_v, int64_t T, int64_t h0, int64_t h1) {
    // children by index, and the stack depth the walk needs: a child that is not its parent's
    // last pushes one state for its whole subtree
    thread_local std::vector<std::vector<int32_t>> kids;
    thread_local std::vector<int64_t> need;
    thread_local std::vector<float> work;
    kids.assign(T, {});
    need.assign(T, 0);
    int64_t n_saves = 0;
    for (int64_t t = 1; t < T; ++t) kids[parents[t]].push_back((int32_t) t);
    for (int64_t t = 1; t < T; ++t) {
        const std::vector<int32_t> & sib = kids[parents[t]];
        need[t] = need[parents[t]] + (sib.back() != t);
        n_saves = std::max(n_saves, need[t]);
    }
    if (!kernel_scratch(work, (size_t) (1 + n_saves) * S * S, "the GDN tree record")) return;  // thrown after
    for (int64_t h = h0; h < h1; ++h) {
        std::memcpy(work.data(), state0 + h * S * S, (size_t) S * S * sizeof(float));
        const tree_walk w{in, o, tape, kids, h, S, H_k, H_v, work.data() + S * S};
        w.visit(0, work.data(), 0);
    }
}

namespace {
// gdn_tape_record, and with `snapshots` the snapshot baseline's recording (gdn_snapshots.h).
void record_heads(const gdn_inputs & in, const float * state0, float * o, gdn_tape_view tape, int64_t S,
                  int64_t H_k, int64_t H_v, int64_t T, int64_t h0, int64_t h1, float * snapshots) {
    thread_local std::vector<float> work;
    if (!kernel_scratch(work, (size_t) S * S, "the GDN tape record")) return;  // noted; thrown after the compute
    for (int64_t h = h0; h < h1; ++h) {
        std::memcpy(work.data(), state0 + h * S * S, (size_t) S * S * sizeof(float));
        forward_head(in, work.data(), o, nullptr, &tape, h, S, H_k, H_v, T, snapshots);
    }
}
}  // namespace

void gdn_tape_record(const gdn_inputs & in, const float * state0, float * o, gdn_tape_view tape, int64_t S,
                     int64_t H_k, int64_t H_v, int64_t T, int64_t h0, int64_t h1) {
    record_heads(in, state0, o, tape, S, H_k, H_v, T, h0, h1, nullptr);
}

void gdn_forward(const gdn_inputs & in, float * state, float * o, int64_t S, int64_t H_k, int64_t H_v, int64_t T,
                 int64_t h0, int64_t h1) {
    thread_local std::vector<float> u;
    if (!kernel_scratch(u, (size_t) S, "the GDN forward")) return;  // noted; thrown after the compute
    for (int64_t h = h0; h < h1; ++h) forward_head(in, state + h * S * S, o, u.data(), nullptr, h, S, H_k, H_v, T);
}

void gdn_tape_replay(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n, int64_t h0,
                     int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
        for (int64_t t = 0; t < n; ++t) {
            replay_token(state + h * S * S, tape.k + S * (h + H_v * t), tape.u + S * (h + H_v * t),
                         expf(tape.g[h + H_v * t]), S);
        }
    }
}

void gdn_tape_replay_mt(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n, int n_threads) {
    n_threads = (int) std::max<int64_t>(1, std::min<int64_t>(n_threads, H_v));
    // Below ~1 MFLOP a thread costs more than it saves.
    if (n_threads == 1 || 2 * S * S * n * H_v < (1 << 20)) {
        gdn_tape_replay(state, tape, S, H_v, n, 0, H_v);
        return;
    }
    std::vector<std::thread> pool;
    const int64_t per = (H_v + n_threads - 1) / n_threads;
    try {
        pool.reserve(n_threads - 1);
        for (int i = 1; i < n_threads; ++i) {
            const int64_t a = i * per, b = std::min(H_v, a + per);
            if (a < b) pool.emplace_back(gdn_tape_replay, state, tape, S, H_v, n, a, b);
        }
    } catch (const std::exception &) {
        // no memory for another thread: the heads no thread took run below (the heads are
        // independent, so the bits are the same)
    }
    gdn_tape_replay(state, tape, S, H_v, n, 0, std::min(H_v, per));
    const int64_t h_rest = std::min(H_v, (int64_t) (pool.size() + 1) * per);
    if (h_rest < H_v) gdn_tape_replay(state, tape, S, H_v, n, h_rest, H_v);
    for (auto & th : pool) th.join();
}

namespace {

gdn_inputs op_inputs(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * g = dst->src[3], * b = dst->src[4];
    const int64_t f = sizeof(float);
    gdn_inputs in;
    in.q = (const float *) q->data; in.q_s1 = q->nb[1] / f; in.q_s2 = q->nb[2] / f;
    in.k = (const float *) k->data; in.k_s1 = k->nb[1] / f; in.k_s2 = k->nb[2] / f;
    in.v = (const float *) v->data; in.v_s1 = v->nb[1] / f; in.v_s2 = v->nb[2] / f;
    in.g = (const float *) g->data; in.g_s1 = g->nb[2] / f;
    in.beta = (const float *) b->data; in.b_s1 = b->nb[2] / f;
    return in;
}

void head_range(int64_t H_v, int ith, int nth, int64_t & h0, int64_t & h1) {
    const int64_t per = (H_v + nth - 1) / nth;
    h0 = std::min(H_v, ith * per);
    h1 = std::min(H_v, h0 + per);
}

// srcs: q, k, v, g, beta, state, then either tape_k, tape_u, tape_g (the cache's tape) or, for a
// packed recording, [snapshots] (ggml allows a custom op 9 sources); the deferred replay count
// travels in the userdata bits.
gdn_tape_view cache_tape(const ggml_tensor * dst) {
    if (!dst->src[8]) return {nullptr, nullptr, nullptr};  // no tape tensors: nothing to replay
    return {(float *) dst->src[6]->data, (float *) dst->src[7]->data, (float *) dst->src[8]->data};
}

void * replay_to_userdata(int64_t n) { return reinterpret_cast<void *>((uintptr_t) n); }
int64_t userdata_to_replay(const void * userdata) { return (int64_t) reinterpret_cast<uintptr_t>(userdata); }

// The AR pass: the state (src 5) is advanced in place; each thread owns whole heads.
// What thread ith of nth runs in a GDN op: the sizes (v is F32 [S, H_v, T], q and k [S, H_k, T]),
// its heads [h0, h1) and the state (src 5). False when the thread owns no head.
struct gdn_op_part {
    int64_t S = 0, H_v = 0, T = 0, H_k = 0, h0 = 0, h1 = 0;
    float * state = nullptr;
};

bool op_part(const ggml_tensor * dst, int ith, int nth, gdn_op_part & p) {
    const ggml_tensor * v = dst->src[2];
    p.S = v->ne[0], p.H_v = v->ne[1], p.T = v->ne[2], p.H_k = dst->src[0]->ne[1];
    head_range(p.H_v, ith, nth, p.h0, p.h1);
    p.state = (float *) dst->src[5]->data;
    return p.h0 < p.h1;
}

void forward_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    gdn_op_part p;
    if (!op_part(dst, ith, nth, p)) return;
    gdn_tape_replay(p.state, cache_tape(dst), p.S, p.H_v, userdata_to_replay(userdata), p.h0, p.h1);
    gdn_forward(op_inputs(dst), p.state, (float *) dst->data, p.S, p.H_k, p.H_v, p.T, p.h0, p.h1);
}

void record_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    gdn_op_part p;
    if (!op_part(dst, ith, nth, p)) return;
    float * out = (float *) dst->data;
    gdn_tape_view tape = cache_tape(dst);
    if (tape.k) {
        gdn_tape_replay(p.state, tape, p.S, p.H_v, userdata_to_replay(userdata), p.h0, p.h1);  // reads the old tape first
    } else {  // packed after the outputs (a cache off the host: the graph copies it there)
        const int64_t n_o = p.S * p.H_v * p.T;
        tape = {out + n_o, out + 2 * n_o, out + 3 * n_o};
    }
    float * snaps = !dst->src[8] && dst->src[6] ? (float *) dst->src[6]->data : nullptr;
    record_heads(op_inputs(dst), p.state, out, tape, p.S, p.H_k, p.H_v, p.T, p.h0, p.h1, snaps);
}

// srcs as record_op's with the cache's tape; the parents in the gdn_tree_pass of the userdata.
void tree_record_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    gdn_op_part p;
    if (!op_part(dst, ith, nth, p)) return;
    const gdn_tree_pass * pass = static_cast<const gdn_tree_pass *>(userdata);
    const gdn_tape_view tape = cache_tape(dst);
    gdn_tape_replay(p.state, tape, p.S, p.H_v, pass->replay_n, p.h0, p.h1);  // reads the old tape first
    gdn_tree_record(op_inputs(dst), p.state, (float *) dst->data, tape, pass->parents.data(), p.S, p.H_k, p.H_v, p.T,
                    p.h0, p.h1);
}

ggml_tensor * gdn_op(ggml_context * ctx, ggml_custom_op_t fn, const char * name, ggml_tensor * q, ggml_tensor * k,
                     ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k,
                     ggml_tensor * tape_u, ggml_tensor * tape_g, int64_t replay_n, ggml_tensor * snapshots) {
    const int64_t S = v->ne[0], H_v = v->ne[1], T = v->ne[2];
    GGML_ASSERT(!(tape_k && snapshots));  // graph.cpp: the snapshot baseline records packed
    ggml_tensor * args[9] = {q, k, v, g, beta, state, tape_k ? tape_k : snapshots, tape_u, tape_g};
    const int n_args = tape_k ? 9 : snapshots ? 7 : 6;
    // without tape tensors the recording packs the tape after the outputs
    const int64_t n = fn == record_op && !tape_k ? 3 * S * H_v * T + H_v * T : S * H_v * T;
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, n, 1, 1, 1, args, n_args, fn, GGML_N_TASKS_MAX,
                                       replay_to_userdata(replay_n));
    ggml_set_name(out, name);
    return out;
}

}  // namespace

ggml_tensor * gdn_tree_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                                 ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k, ggml_tensor * tape_u,
                                 ggml_tensor * tape_g, const gdn_tree_pass * pass) {
    ggml_tensor * args[9] = {q, k, v, g, beta, state, tape_k, tape_u, tape_g};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, v->ne[0] * v->ne[1] * v->ne[2], 1, 1, 1, args, 9,
                                       tree_record_op, GGML_N_TASKS_MAX, const_cast<gdn_tree_pass *>(pass));
    ggml_set_name(out, "gdn_tree_record");
    return out;
}

ggml_tensor * gdn_forward_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                             ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k, ggml_tensor * tape_u,
                             ggml_tensor * tape_g, int64_t replay_n) {
    return gdn_op(ctx, forward_op, "gdn_forward", q, k, v, g, beta, state, tape_k, tape_u, tape_g, replay_n, nullptr);
}

ggml_tensor * gdn_tape_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                 ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state, ggml_tensor * tape_k,
                                 ggml_tensor * tape_u, ggml_tensor * tape_g, int64_t replay_n) {
    return gdn_op(ctx, record_op, "gdn_record", q, k, v, g, beta, state, tape_k, tape_u, tape_g, replay_n, nullptr);
}

// ---- the snapshot-rollback baseline (gdn_snapshots.h) ----

ggml_tensor * gdn_snapshot_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                     ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state, ggml_tensor * snapshots) {
    return gdn_op(ctx, record_op, "gdn_record_snapshots", q, k, v, g, beta, state, nullptr, nullptr, nullptr, 0,
                  snapshots);
}

}  // namespace dfn
