#include "graph/graph.h"
#include "kernels/cpu/attn.h"
#include "kernels/cpu/conv.h"
#include "kernels/cpu/gdn_snapshots.h"
#include "kernels/cpu/matmul/matmul.h"

#include "base/common.h"
#include "kernels/cpu/gdn_tape.h"

#include "ggml-backend.h"

#include <cmath>

namespace dfn {

void graph_inputs::tap(int il, ggml_tensor * cur) {
    for (size_t i = 0; i < tap_layers.size(); ++i) {
        if (tap_layers[i] == il) {
            taps[i] = cur;
            ggml_set_output(cur);
            ggml_build_forward_expand(gf, cur);
        }
    }
}

graph_inputs graph_inputs::segment(const seq_segment & s) const {
    graph_inputs g;
    static_cast<build_context &>(g) = *this;
    g.hp = hp;
    g.cache = s.cache;
    g.n_tokens = s.n_tokens;
    g.n_past = s.n_past;
    g.n_kv = s.n_kv;
    g.tokens = tokens;
    g.pos = pos;
    g.kq_mask = s.kq_mask;
    g.record_tape = s.record_tape;
    g.tree_parents = s.tree_parents;
    return g;
}

ggml_tensor * columns_view(const build_context & b, ggml_tensor * x, int dim, int64_t c0, int64_t n) {
    int64_t ne[4] = {x->ne[0], x->ne[1], x->ne[2], x->ne[3]};
    ne[dim] = n;
    return ggml_view_4d(b.ctx, x, ne[0], ne[1], ne[2], ne[3], x->nb[1], x->nb[2], x->nb[3], c0 * x->nb[dim]);
}

ggml_tensor * join_segments(const build_context & b, std::vector<ggml_tensor *> parts, int dim) {
    // pairwise, so each column is copied log2(n) times rather than up to n times
    while (parts.size() > 1) {
        std::vector<ggml_tensor *> next;
        for (size_t i = 0; i + 1 < parts.size(); i += 2) next.push_back(ggml_concat(b.ctx, parts[i], parts[i + 1], dim));
        if (parts.size() % 2) next.push_back(parts.back());
        parts.swap(next);
    }
    return parts[0];
}

ggml_tensor * rms_norm(const build_context & b, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(b.ctx, ggml_rms_norm(b.ctx, x, eps), w);
}

ggml_tensor * rope_neox(const build_context & b, ggml_tensor * x, ggml_tensor * pos, int64_t n_rot,
                        const block_hparams & hp) {
    const rope_scaling & r = hp.rope;
    return ggml_rope_ext(b.ctx, x, pos, nullptr, (int) n_rot, GGML_ROPE_TYPE_NEOX, (int) r.n_ctx_orig, hp.rope_base,
                         r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow);
}

ggml_tensor * rope_multi(const build_context & b, ggml_tensor * x, ggml_tensor * pos, int64_t n_rot,
                         const int sections[4], int mode, const block_hparams & hp) {
    const rope_scaling & r = hp.rope;
    int s[4] = {sections[0], sections[1], sections[2], sections[3]};  // ggml takes a non-const array
    return ggml_rope_multi(b.ctx, x, pos, nullptr, (int) n_rot, s, mode, (int) r.n_ctx_orig, hp.rope_base,
                           r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow);
}

ggml_tensor * rope_norm(const build_context & b, ggml_tensor * x, ggml_tensor * pos, ggml_tensor * freq_factors,
                        int64_t n_rot, int64_t n_ctx_train, float base) {
    return ggml_rope_ext(b.ctx, x, pos, freq_factors, (int) n_rot, GGML_ROPE_TYPE_NORMAL, (int) n_ctx_train, base,
                         1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
}

ggml_tensor * ffn_swiglu(const build_context & b, ggml_tensor * x, const layer_weights & w) {
    ggml_tensor * gate = matmul(b, w.ffn_gate, x);  // [n_ff, n_tokens]
    ggml_tensor * up = matmul(b, w.ffn_up, x);      // [n_ff, n_tokens]
    return matmul(b, w.ffn_down, ggml_swiglu_split(b.ctx, gate, up));
}

ggml_tensor * kv_rows(const build_context & b, ggml_tensor * t, int64_t row0, int64_t n) {
    return ggml_view_3d(b.ctx, t, t->ne[0], t->ne[1], n, t->nb[1], t->nb[2], row0 * t->nb[2]);
}

void write_kv_rows(const build_context & b, ggml_tensor * t, ggml_tensor * src, int64_t row0) {
    ggml_build_forward_expand(b.gf, ggml_cpy(b.ctx, src, kv_rows(b, t, row0, src->ne[2])));
}

ggml_tensor * attention_kv(graph_inputs & g, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float scale) {
    if (!g.segs.empty()) {
        // several sequences: each segment's tokens over its own cache, as its own pass would
        std::vector<ggml_tensor *> out;
        for (const graph_inputs::seq_segment & s : g.segs) {
            graph_inputs gs = g.segment(s);
            out.push_back(attention_kv(gs, il, segment_view(g, q, 2, s), segment_view(g, k, 2, s), segment_view(g, v, 2, s),
                                       scale));  // [hd * n_head, n_tokens_s]
        }
        return join_segments(g, out, 1);
    }
    const kv_layer & c = g.cache->kv[il];

    // Append this batch's K/V at rows n_past .. n_past + n_tokens - 1.
    write_kv_rows(g, c.k, k, g.n_past);
    write_kv_rows(g, c.v, v, g.n_past);

    // The live prefix, rows 0 .. n_kv - 1 (this batch included).
    ggml_tensor * K = kv_rows(g, c.k, 0, g.n_kv);  // [hd, n_kv_head, n_kv]
    ggml_tensor * V = kv_rows(g, c.v, 0, g.n_kv);

    // a tree's nodes gather their kept keys, so each computes its path's AR step bit for bit
    return attention(g, q, K, V, g.kq_mask, scale, /*gather=*/g.tree_parents != nullptr);  // [hd * n_head, n_tokens]
}

qkv_proj project_qkv(graph_inputs & g, const layer_weights & L, ggml_tensor * x) {
    ggml_context * ctx = g.ctx;
    const int64_t hd = g.hp->head_dim, n_kv = g.hp->n_head_kv, n_tok = g.n_tokens;
    if (!L.wqkv_fused) {
        return {matmul(g, L.wq, x), ggml_reshape_3d(ctx, matmul(g, L.wk, x), hd, n_kv, n_tok),
                ggml_reshape_3d(ctx, matmul(g, L.wv, x), hd, n_kv, n_tok)};
    }
    ggml_tensor * qkv = matmul(g, L.wqkv_fused, x);  // [q_rows + 2 * hd * n_kv, n_tok]
    const int64_t q_rows = qkv->ne[0] - 2 * hd * n_kv;
    const size_t es = ggml_element_size(qkv), nb1 = qkv->nb[1];
    return {ggml_view_2d(ctx, qkv, q_rows, n_tok, nb1, 0),
            ggml_view_3d(ctx, qkv, hd, n_kv, n_tok, hd * es, nb1, q_rows * es),
            ggml_view_3d(ctx, qkv, hd, n_kv, n_tok, hd * es, nb1, (q_rows + hd * n_kv) * es)};
}

ggml_tensor * self_attention(graph_inputs & g, int il, const layer_weights & L, ggml_tensor * x, const rope_fn & rope) {
    ggml_context * ctx = g.ctx;
    const int64_t hd = g.hp->head_dim, n_tok = g.n_tokens;
    const qkv_proj p = project_qkv(g, L, x);
    const size_t es = ggml_element_size(p.q);
    ggml_tensor * q = ggml_view_3d(ctx, p.q, hd, g.hp->n_head, n_tok, hd * es, p.q->nb[1], 0);
    ggml_tensor * k = p.k, * v = p.v;
    if (L.q_norm) q = rms_norm(g, q, L.q_norm);
    if (L.k_norm) k = rms_norm(g, k, L.k_norm);
    return matmul(g, L.wo, attention_kv(g, il, rope(q), rope(k), v, 1.0f / sqrtf((float) hd)));
}

namespace {

// Causal depthwise conv + SiLU over [conv state; this batch], then keep the last d_conv-1 inputs
// (a verify keeps its inputs on the tape instead: the conv state moves when commit() says).
// qkv: F32 [n_ch, n_tok]. Returns F32 [n_ch, n_tok] (ggml path: [n_ch, n_tok, 1]).
ggml_tensor * gdn_conv(graph_inputs & g, const gdn_layer & st, const layer_weights & w, ggml_tensor * qkv) {
    ggml_context * ctx = g.ctx;
    const int64_t n_tok = g.n_tokens, n_ch = g.hp->ssm_conv_channels(), d_conv = g.hp->ssm_d_conv;
    if (g.record_tape) {
        ggml_tensor * dst = ggml_view_2d(ctx, st.tape_qkv, n_ch, n_tok, st.tape_qkv->nb[1], 0);
        ggml_build_forward_expand(g.gf, ggml_cpy(ctx, qkv, dst));
    }
    if (g.tree_parents) {
        // over a tree: each node's window is its ancestors' inputs (no ggml op does that)
        DFN_REQUIRE(conv_silu_supported(st.conv, qkv, w.ssm_conv1d), "verify",
                    "tree verify needs the GDN conv state and weights as F32 in host memory");
        return conv_silu_tree_op(ctx, st.conv, qkv, w.ssm_conv1d, g.tree_parents);
    }
    if (g.own_kernels() && conv_silu_supported(st.conv, qkv, w.ssm_conv1d)) {
        return conv_silu_op(ctx, st.conv, qkv, w.ssm_conv1d, /*update_state=*/!g.record_tape);
    }
    ggml_tensor * conv_state = ggml_reshape_3d(ctx, st.conv, d_conv - 1, n_ch, 1);
    ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, ggml_reshape_3d(ctx, qkv, n_ch, n_tok, 1)), 0);
    // conv_in: [d_conv - 1 + n_tok, n_ch, 1]
    if (!g.record_tape) {
        ggml_tensor * conv_last = ggml_view_3d(ctx, conv_in, d_conv - 1, n_ch, 1, conv_in->nb[1], conv_in->nb[2],
                                               n_tok * ggml_element_size(conv_in));
        ggml_build_forward_expand(g.gf, ggml_cpy(ctx, conv_last, conv_state));
    }
    return ggml_silu(ctx, ggml_ssm_conv(ctx, conv_in, w.ssm_conv1d));  // [n_ch, n_tok, 1]
}

// A verify on a device: the outputs of ggml_gated_delta_net over the batch from the layer's state,
// which stays as it was; the op's inputs (k, v, g, beta) go to the tape, from which commit replays
// the kept prefix through the same op (target_session::commit_on_device).
ggml_tensor * gdn_device_record(graph_inputs & g, const gdn_layer & st, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                ggml_tensor * gate, ggml_tensor * beta) {
    ggml_context * ctx = g.ctx;
    const int64_t n_tok = g.n_tokens, S = g.hp->ssm_head_dim, H_v = g.hp->ssm_n_v_heads, H_k = k->ne[1];
    const size_t es = sizeof(float);
    DFN_REQUIRE(st.tape_beta, "verify", "the GDN tape is not in device form");
    ggml_tensor * state = ggml_reshape_4d(ctx, st.ssm, S, S, H_v, 1);
    ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, gate, beta, state, 1);
    ggml_tensor * o = ggml_view_4d(ctx, res, S, H_v, n_tok, 1, S * es, S * H_v * es, S * H_v * n_tok * es, 0);
    auto to_tape = [&](ggml_tensor * src, ggml_tensor * dst, int64_t per_tok) {
        ggml_tensor * d = ggml_view_1d(ctx, dst, per_tok * n_tok, 0);
        ggml_build_forward_expand(g.gf, ggml_cpy(ctx, src, ggml_reshape_4d(ctx, d, src->ne[0], src->ne[1], n_tok, 1)));
    };
    const_cast<gdn_layer &>(st).tape_k_heads = H_k;
    to_tape(k, st.tape_k, S * H_k);
    to_tape(v, st.tape_u, S * H_v);
    to_tape(gate, st.tape_g, H_v);
    to_tape(beta, st.tape_beta, H_v);
    return o;
}

// A verify under the snapshot-rollback baseline (runtime/rollback.h; the cache holds st.snapshots):
// the state after every token goes to st.snapshots, from which commit copies one back. On the CPU
// the baseline's record op (gdn_snapshots.h) packs [outputs | tape k | tape u | tape g] and the tape
// is copied to the cache; on a device ggml_gated_delta_net packs its K snapshots (most recent first).
ggml_tensor * gdn_snapshot_record(graph_inputs & g, const gdn_layer & st, ggml_tensor * q, ggml_tensor * k,
                                  ggml_tensor * v, ggml_tensor * gate, ggml_tensor * beta, bool host) {
    ggml_context * ctx = g.ctx;
    const int64_t n_tok = g.n_tokens, S = g.hp->ssm_head_dim, H_v = g.hp->ssm_n_v_heads;
    const int64_t n_o = S * H_v * n_tok, n_state = S * S * H_v;
    const size_t es = sizeof(float);
    ggml_tensor * state = ggml_reshape_4d(ctx, st.ssm, S, S, H_v, 1);
    auto copy = [&](ggml_tensor * src, int64_t n, int64_t off, ggml_tensor * dst) {
        ggml_build_forward_expand(g.gf, ggml_cpy(ctx, ggml_view_1d(ctx, src, n, off * es), ggml_view_1d(ctx, dst, n, 0)));
    };
    ggml_tensor * res = nullptr;
    if (host) {
        res = gdn_snapshot_record_op(ctx, q, k, v, gate, beta, state, st.snapshots);
        copy(res, n_o, n_o, st.tape_k);
        copy(res, n_o, 2 * n_o, st.tape_u);
        copy(res, H_v * n_tok, 3 * n_o, st.tape_g);
    } else {
        res = ggml_gated_delta_net(ctx, q, k, v, gate, beta, state, n_tok);
        copy(res, n_state * n_tok, n_o, st.snapshots);
    }
    return ggml_view_4d(ctx, res, S, H_v, n_tok, 1, S * es, S * H_v * es, n_o * es, 0);
}

// The delta rule over the batch from the layer's state: q, k F32 [S, H_k, n_tok, 1], v F32
// [S, H_v, n_tok, 1], gate, beta F32 [1, H_v, n_tok, 1]. Advances the state, or on a verify
// records the tape and leaves the state alone. Returns o F32 [S, H_v, n_tok, 1].
ggml_tensor * gdn_recurrence(graph_inputs & g, const gdn_layer & st, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                             ggml_tensor * gate, ggml_tensor * beta) {
    ggml_context * ctx = g.ctx;
    const int64_t n_tok = g.n_tokens, S = g.hp->ssm_head_dim, H_v = g.hp->ssm_n_v_heads;
    const size_t es = sizeof(float);
    ggml_tensor * state = ggml_reshape_4d(ctx, st.ssm, S, S, H_v, 1);
    // the CPU's custom ops; a device runs ggml's op (the same one its commit replays through)
    const bool host = !g.device && ggml_backend_buffer_is_host(st.ssm->buffer);
    if (g.tree_parents) {
        // over a tree: each node from its parent's state, the tape per node (gdn_tape.h)
        DFN_REQUIRE(host && !st.snapshots, "verify", "tree verify needs the GDN state in host memory and tape rollback");
        ggml_tensor * o = gdn_tree_record_op(ctx, q, k, v, gate, beta, state, st.tape_k, st.tape_u, st.tape_g,
                                             &g.cache->tree);
        return ggml_reshape_4d(ctx, o, S, H_v, n_tok, 1);
    }
    if (g.record_tape && st.snapshots) return gdn_snapshot_record(g, st, q, k, v, gate, beta, host);
    if (g.record_tape && host) {
        // the tape goes straight to the cache's tape tensors
        ggml_tensor * o = gdn_tape_record_op(ctx, q, k, v, gate, beta, state, st.tape_k, st.tape_u, st.tape_g,
                                             g.cache->replay_n);
        return ggml_reshape_4d(ctx, o, S, H_v, n_tok, 1);
    }
    if (g.record_tape) return gdn_device_record(g, st, q, k, v, gate, beta);
    if (host) {
        // CPU: the same kernel as the verify pass, so AR and speculative states agree bitwise
        ggml_tensor * o = gdn_forward_op(ctx, q, k, v, gate, beta, state, st.tape_k, st.tape_u, st.tape_g,
                                         g.cache->replay_n);
        return ggml_reshape_4d(ctx, o, S, H_v, n_tok, 1);  // state advanced in place
    }
    // a device: ggml's op over the batch, its final state written back
    ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, gate, beta, state, 1);
    // res packs [outputs S*H_v*n_tok | final state S*S*H_v]
    ggml_tensor * o = ggml_view_4d(ctx, res, S, H_v, n_tok, 1, S * es, S * H_v * es, S * H_v * n_tok * es, 0);
    ggml_tensor * new_state = ggml_view_1d(ctx, res, S * S * H_v, S * H_v * n_tok * es);
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx, new_state, ggml_reshape_1d(ctx, st.ssm, S * S * H_v)));
    return o;
}

}  // namespace

ggml_tensor * gated_attention(graph_inputs & g, int il, const layer_weights & L, ggml_tensor * x, const rope_fn & rope) {
    ggml_context * ctx = g.ctx;
    const int64_t hd = g.hp->head_dim, n_tok = g.n_tokens, n_head = g.hp->n_head;
    const qkv_proj p = project_qkv(g, L, x);  // W_q emits [q | gate] per head
    ggml_tensor * qg = p.q;                   // [2 * hd * n_head, n_tok] (a view of a fused qkv: row stride nb[1])
    const size_t es = ggml_element_size(qg);
    ggml_tensor * q = ggml_view_3d(ctx, qg, hd, n_head, n_tok, 2 * hd * es, qg->nb[1], 0);
    ggml_tensor * gate = ggml_view_3d(ctx, qg, hd, n_head, n_tok, 2 * hd * es, qg->nb[1], hd * es);
    gate = ggml_cont_2d(ctx, gate, hd * n_head, n_tok);

    ggml_tensor * k = p.k, * v = p.v;
    q = rope(rms_norm(g, q, L.q_norm));
    k = rope(rms_norm(g, k, L.k_norm));

    ggml_tensor * a = attention_kv(g, il, q, k, v, 1.0f / sqrtf((float) hd));  // [hd * n_head, n_tok]
    return matmul(g, L.wo, ggml_mul(ctx, a, ggml_sigmoid(ctx, gate)));
}

namespace {

// One sequence's conv, L2-normalised q/k and delta rule over its state (or tape): qkv F32 [n_ch, n_tok],
// gate, beta F32 [1, H_v, n_tok, 1]. Returns o F32 [S, H_v, n_tok, 1].
ggml_tensor * gdn_sequence(graph_inputs & g, int il, const layer_weights & w, ggml_tensor * qkv, ggml_tensor * gate,
                           ggml_tensor * beta, bool v_grouped) {
    ggml_context * ctx = g.ctx;
    const target_hparams & hp = *g.hp;
    const gdn_layer & st = g.cache->gdn[il];
    const int64_t n_tok = g.n_tokens;
    const int64_t S = hp.ssm_head_dim, H_k = hp.ssm_n_k_heads, H_v = hp.ssm_n_v_heads;

    ggml_tensor * conv_out = gdn_conv(g, st, w, qkv);  // [n_ch, n_tok]
    const size_t es = ggml_element_size(conv_out);
    const size_t row = conv_out->nb[1];
    ggml_tensor * q = ggml_view_4d(ctx, conv_out, S, H_k, n_tok, 1, S * es, row, row * n_tok, 0);
    ggml_tensor * k = ggml_view_4d(ctx, conv_out, S, H_k, n_tok, 1, S * es, row, row * n_tok, S * H_k * es);
    ggml_tensor * v = ggml_view_4d(ctx, conv_out, S, H_v, n_tok, 1, S * es, row, row * n_tok, 2 * S * H_k * es);

    // L2 normalisation as rms_norm scaled by 1/sqrt(S): x / sqrt(sum x^2 + eps).
    q = ggml_scale(ctx, ggml_rms_norm(ctx, q, hp.rms_eps / (float) S), 1.0f / sqrtf((float) S));
    k = ggml_scale(ctx, ggml_rms_norm(ctx, k, hp.rms_eps / (float) S), 1.0f / sqrtf((float) S));
    if (v_grouped && H_v != H_k) {
        // key head j serves value heads j*r .. j*r + r-1: [S, H_k] -> [S, r, H_k] -> [S, H_v]
        const int64_t r = H_v / H_k;
        auto repeat = [&](ggml_tensor * t) {
            t = ggml_repeat_4d(ctx, ggml_reshape_4d(ctx, t, S, 1, H_k, n_tok), S, r, H_k, n_tok);
            return ggml_reshape_4d(ctx, t, S, H_v, n_tok, 1);
        };
        q = repeat(q);
        k = repeat(k);
    }

    return gdn_recurrence(g, st, q, k, v, gate, beta);  // [S, H_v, n_tok, 1]
}

}  // namespace

ggml_tensor * gdn_block(graph_inputs & g, int il, const layer_weights & w, const gdn_proj & p, bool v_grouped) {
    ggml_context * ctx = g.ctx;
    const target_hparams & hp = *g.hp;
    const int64_t n_tok = g.n_tokens;
    const int64_t S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads;

    ggml_tensor * beta = ggml_reshape_4d(ctx, ggml_sigmoid(ctx, p.b), 1, H_v, n_tok, 1);
    // g = softplus(a + dt_bias) * ssm_a, with ssm_a = -exp(A_log): the log of the decay.
    ggml_tensor * gate = ggml_mul(ctx, ggml_softplus(ctx, ggml_add(ctx, p.a, w.ssm_dt)), w.ssm_a);
    gate = ggml_reshape_4d(ctx, gate, 1, H_v, n_tok, 1);

    ggml_tensor * o = nullptr;  // [S, H_v, n_tok, 1]
    if (g.segs.empty()) {
        o = gdn_sequence(g, il, w, p.qkv, gate, beta, v_grouped);
    } else {
        // several sequences: each segment from its own conv and recurrent state (or tape)
        std::vector<ggml_tensor *> out;
        for (const graph_inputs::seq_segment & s : g.segs) {
            graph_inputs gs = g.segment(s);
            out.push_back(gdn_sequence(gs, il, w, segment_view(g, p.qkv, 1, s), segment_view(g, gate, 2, s),
                                       segment_view(g, beta, 2, s), v_grouped));
        }
        o = join_segments(g, out, 2);
    }

    // Per-head RMSNorm of the output, gated by SiLU(z).
    ggml_tensor * z4 = ggml_reshape_4d(ctx, p.z, S, H_v, n_tok, 1);
    o = ggml_mul(ctx, rms_norm(g, o, w.ssm_norm), ggml_silu(ctx, z4));
    o = ggml_reshape_2d(ctx, o, S * H_v, n_tok);
    return matmul(g, w.ssm_out, o);  // [n_embd, n_tok]
}

ggml_tensor * gdn_mixer(graph_inputs & g, int il, const layer_weights & w, ggml_tensor * x) {
    gdn_proj p;
    p.qkv = matmul(g, w.wqkv, x);      // [n_ch, n_tok]
    p.z = matmul(g, w.wgate, x);       // [S * H_v, n_tok]
    p.b = matmul(g, w.ssm_beta, x);    // [H_v, n_tok]
    p.a = matmul(g, w.ssm_alpha, x);   // [H_v, n_tok]
    return gdn_block(g, il, w, p, /*v_grouped=*/false);
}

}  // namespace dfn
