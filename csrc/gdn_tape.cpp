#include "gdn_tape.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace dfn {

namespace {

// The two state updates shared by record and replay: the same code in the same order is what
// makes replay bitwise equal to the state the record pass held.
inline void decay(float * M, int64_t n, float eg) {
    for (int64_t i = 0; i < n; ++i) M[i] *= eg;
}

inline void rank1(float * M, const float * k, const float * u, int64_t S) {
    for (int64_t j = 0; j < S; ++j) {
        float * row = M + j * S;
        const float uj = u[j];
        for (int64_t i = 0; i < S; ++i) row[i] += uj * k[i];
    }
}

inline float dot(const float * a, const float * b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

}  // namespace

void gdn_tape_record(const gdn_inputs & in, const float * state0, float * o, gdn_tape_view tape, int64_t S,
                     int64_t H_k, int64_t H_v, int64_t T, int64_t h0, int64_t h1) {
    thread_local std::vector<float> work;
    work.resize((size_t) S * S);
    float * M = work.data();
    const float scale = 1.0f / sqrtf((float) S);
    for (int64_t h = h0; h < h1; ++h) {
        const int64_t hk = h % H_k;
        std::memcpy(M, state0 + h * S * S, (size_t) S * S * sizeof(float));
        for (int64_t t = 0; t < T; ++t) {
            const float * q = in.q + hk * in.q_s1 + t * in.q_s2;
            const float * k = in.k + hk * in.k_s1 + t * in.k_s2;
            const float * v = in.v + h * in.v_s1 + t * in.v_s2;
            const float gt = in.g[h + t * in.g_s1];
            const float bt = in.beta[h + t * in.b_s1];
            float * tk = tape.k + S * (h + H_v * t);
            float * tu = tape.u + S * (h + H_v * t);
            tape.g[h + H_v * t] = gt;
            std::memcpy(tk, k, (size_t) S * sizeof(float));

            decay(M, S * S, expf(gt));
            for (int64_t j = 0; j < S; ++j) tu[j] = (v[j] - dot(M + j * S, tk, S)) * bt;
            rank1(M, tk, tu, S);
            float * ot = o + S * (h + H_v * t);
            for (int64_t j = 0; j < S; ++j) ot[j] = dot(M + j * S, q, S) * scale;
        }
    }
}

void gdn_tape_replay(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n, int64_t h0,
                     int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
        float * M = state + h * S * S;
        for (int64_t t = 0; t < n; ++t) {
            decay(M, S * S, expf(tape.g[h + H_v * t]));
            rank1(M, tape.k + S * (h + H_v * t), tape.u + S * (h + H_v * t), S);
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
    for (int i = 1; i < n_threads; ++i) {
        const int64_t a = i * per, b = std::min(H_v, a + per);
        if (a < b) pool.emplace_back(gdn_tape_replay, state, tape, S, H_v, n, a, b);
    }
    gdn_tape_replay(state, tape, S, H_v, n, 0, std::min(H_v, per));
    for (auto & th : pool) th.join();
}

namespace {

void record_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * g = dst->src[3];
    const ggml_tensor * b = dst->src[4];
    const ggml_tensor * st = dst->src[5];
    const int64_t S = v->ne[0], H_v = v->ne[1], T = v->ne[2], H_k = q->ne[1];
    const int64_t f = sizeof(float);

    gdn_inputs in;
    in.q = (const float *) q->data; in.q_s1 = q->nb[1] / f; in.q_s2 = q->nb[2] / f;
    in.k = (const float *) k->data; in.k_s1 = k->nb[1] / f; in.k_s2 = k->nb[2] / f;
    in.v = (const float *) v->data; in.v_s1 = v->nb[1] / f; in.v_s2 = v->nb[2] / f;
    in.g = (const float *) g->data; in.g_s1 = g->nb[2] / f;
    in.beta = (const float *) b->data; in.b_s1 = b->nb[2] / f;

    float * out = (float *) dst->data;
    const int64_t n_o = S * H_v * T;
    gdn_tape_view tape = {out + n_o, out + 2 * n_o, out + 3 * n_o};

    const int64_t per = (H_v + nth - 1) / nth;
    const int64_t h0 = ith * per, h1 = std::min(H_v, h0 + per);
    if (h0 < h1) gdn_tape_record(in, (const float *) st->data, out, tape, S, H_k, H_v, T, h0, h1);
}

}  // namespace

ggml_tensor * gdn_tape_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                 ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state) {
    const int64_t S = v->ne[0], H_v = v->ne[1], T = v->ne[2];
    ggml_tensor * args[6] = {q, k, v, g, beta, state};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, 3 * S * H_v * T + H_v * T, 1, 1, 1, args, 6, record_op,
                          GGML_N_TASKS_MAX, nullptr);
}

}  // namespace dfn
