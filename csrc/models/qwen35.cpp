// Qwen3.5 hybrid target (GGUF arch "qwen35"): Gated DeltaNet layers with a short conv, and
// every full_attention_interval-th layer gated full attention with partial multi-section RoPE.
// Norm weights are stored as (1 + w) by the converter, so every norm here is x_hat * w.
// Also Qwen3.5-MoE (GGUF arch "qwen35moe"): the same layers with the routed FFN and its shared
// expert (moe.h) in place of the dense SwiGLU.
#include "../common.h"
#include "../matmul.h"
#include "../graph.h"
#include "../model.h"
#include "../moe.h"

#include <cmath>

namespace dfn {

namespace {

static const char * W = "load_gguf";

class qwen35_model : public target_model {
public:
    qwen35_model(std::unique_ptr<gguf_file> f, bool moe) : target_model(std::move(f)) {
        read_common_hparams(/*ff_required=*/!moe);
        gguf_file & F = *file_;
        if (moe) read_moe_hparams(F, hp_);
        const std::string & P = F.path();

        const auto sections = F.get_int_arr(key("rope.dimension_sections"));
        int64_t sum = 0;
        for (size_t i = 0; i < sections.size() && i < 4; ++i) {
            DFN_REQUIRE(sections[i] >= 0 && sections[i] <= hp_.n_rot, W, "'", P, "': rope.dimension_sections[", i,
                        "] = ", sections[i], " is outside [0, rope.dimension_count]");
            hp_.rope_sections[i] = (int) sections[i];
            sum += sections[i];
        }
        // Multi-section RoPE divides by the section total: zero sections would not be a model.
        DFN_REQUIRE(sum > 0 && sum * 2 <= hp_.n_rot, W, "'", P, "': rope.dimension_sections must be set and sum to at most",
                    " rope.dimension_count / 2 = ", hp_.n_rot / 2, " (sum ", sum, ")");

        hp_.ssm_d_conv = F.get_u32(key("ssm.conv_kernel"));
        const int64_t d_inner = F.get_u32(key("ssm.inner_size"));
        hp_.ssm_head_dim = F.get_u32(key("ssm.state_size"));
        hp_.ssm_n_v_heads = F.get_u32(key("ssm.time_step_rank"));
        hp_.ssm_n_k_heads = F.get_u32(key("ssm.group_count"));
        DFN_REQUIRE(hp_.ssm_d_conv >= 2, W, "'", P, "': ssm.conv_kernel ", hp_.ssm_d_conv, " must be >= 2");
        DFN_REQUIRE(hp_.ssm_d_conv <= 1024, W, "'", P, "': ssm.conv_kernel ", hp_.ssm_d_conv, " must be <= 1024");
        DFN_REQUIRE(hp_.ssm_head_dim > 0 && hp_.ssm_n_v_heads > 0 && hp_.ssm_n_k_heads > 0 && hp_.ssm_head_dim <= k_max_dim &&
                    hp_.ssm_n_v_heads <= k_max_heads && hp_.ssm_n_k_heads <= k_max_heads, W, "'", P,
                    "': ssm.state_size, ssm.time_step_rank and ssm.group_count must be > 0 (and at most ", k_max_dim,
                    ", ", k_max_heads, ", ", k_max_heads, ")");
        DFN_REQUIRE(hp_.ssm_n_v_heads % hp_.ssm_n_k_heads == 0, W, "'", P, "': value heads ", hp_.ssm_n_v_heads,
                    " must be a multiple of key heads ", hp_.ssm_n_k_heads);
        DFN_REQUIRE(d_inner == hp_.ssm_head_dim * hp_.ssm_n_v_heads, W, "'", P, "': ssm.inner_size ", d_inner,
                    " != value head dim x value heads; GDN needs d_k == d_v (", hp_.ssm_head_dim, " x ",
                    hp_.ssm_n_v_heads, ")");

        // Layer pattern: explicit per-layer flags, else every interval-th layer is attention.
        hp_.is_gdn.assign(hp_.n_layer, false);
        const auto recurrent = F.get_int_arr(key("attention.recurrent_layers"));
        if (!recurrent.empty()) {
            DFN_REQUIRE((int64_t) recurrent.size() >= hp_.n_layer, W, "'", P, "': attention.recurrent_layers has ",
                        recurrent.size(), " entries for ", hp_.n_layer, " layers");
            for (int il = 0; il < hp_.n_layer; ++il) hp_.is_gdn[il] = recurrent[il] != 0;
        } else {
            const uint32_t interval = F.get_u32(key("full_attention_interval"), 4);
            DFN_REQUIRE(interval >= 1, W, "'", P, "': full_attention_interval must be >= 1");
            for (int il = 0; il < hp_.n_layer; ++il) hp_.is_gdn[il] = (il + 1) % interval != 0;
        }

        load_common_tensors();
        const int64_t E = hp_.n_embd, hd = hp_.head_dim;
        const int64_t S = hp_.ssm_head_dim, n_ch = hp_.ssm_conv_channels(), H_v = hp_.ssm_n_v_heads;
        const tensor_role MM = TENSOR_ROLE_MATMUL, V32 = TENSOR_ROLE_F32;
        for (int il = 0; il < hp_.n_layer; ++il) {
            layer_weights & L = layers[il];
            auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
            L.attn_norm = F.tensor(n("attn_norm"), {E}, V32);
            L.post_attn_norm = F.tensor(n("post_attention_norm"), {E}, V32);
            if (hp_.is_gdn[il]) {
                L.wqkv = F.tensor(n("attn_qkv"), {E, n_ch}, MM);
                L.wgate = F.tensor(n("attn_gate"), {E, S * H_v}, MM);
                L.ssm_conv1d = F.tensor(n("ssm_conv1d"), {hp_.ssm_d_conv, n_ch}, V32);
                L.ssm_dt = F.tensor(cat("blk.", il, ".ssm_dt.bias"), {H_v}, V32);
                L.ssm_a = F.tensor(cat("blk.", il, ".ssm_a"), {H_v}, V32);
                L.ssm_beta = F.tensor(n("ssm_beta"), {E, H_v}, MM);
                L.ssm_alpha = F.tensor(n("ssm_alpha"), {E, H_v}, MM);
                L.ssm_norm = F.tensor(n("ssm_norm"), {S}, V32);
                L.ssm_out = F.tensor(n("ssm_out"), {S * H_v, E}, MM);
            } else {
                load_attention(F, il, E, hd, hp_.n_head, hp_.n_head_kv, 2, L);  // [q | gate] per head
            }
            if (moe) {
                load_moe(F, il, hp_, L);
            } else {
                load_ffn(F, il, E, hp_.n_ff, L);
            }
        }
    }

    // Multi-section RoPE takes 4 sections of n positions each; text uses its position in the
    // first three and 0 in the fourth.
    int n_pos_per_token() const override { return 4; }
    void fill_positions(int64_t n_past, int64_t n, int32_t * pos) const override {
        for (int64_t i = 0; i < n; ++i) {
            for (int s = 0; s < 4; ++s) pos[s * n + i] = s < 3 ? (int32_t) (n_past + i) : 0;
        }
    }
    void fill_positions_at(const int64_t * p, int64_t n, int32_t * pos) const override {
        for (int64_t i = 0; i < n; ++i) {
            for (int s = 0; s < 4; ++s) pos[s * n + i] = s < 3 ? (int32_t) p[i] : 0;
        }
    }

    ggml_tensor * build_forward(graph_inputs & g) const override {
        ggml_context * ctx = g.ctx;
        ggml_tensor * cur = ggml_get_rows(ctx, tok_embd, g.tokens);  // [n_embd, n_tok]
        for (int il = 0; il < hp_.n_layer; ++il) {
            const layer_weights & L = layers[il];
            ggml_tensor * inp = cur;
            ggml_tensor * x = rms_norm(g, cur, L.attn_norm);
            x = hp_.is_gdn[il] ? gdn_mixer(g, il, L, x) : gated_attention(g, il, L, x);
            cur = ggml_add(ctx, x, inp);

            ggml_tensor * ffn_inp = cur;
            cur = ggml_add(ctx, ffn_block(g, rms_norm(g, cur, L.post_attn_norm), L, hp_), ffn_inp);
            g.tap(il, cur);
        }
        return rms_norm(g, cur, output_norm);
    }

private:
    // W_q emits [q | gate] per head; output = attn(q, k, v) * sigmoid(gate).
    ggml_tensor * gated_attention(graph_inputs & g, int il, const layer_weights & L, ggml_tensor * x) const {
        ggml_context * ctx = g.ctx;
        const int64_t hd = hp_.head_dim, n_tok = g.n_tokens, n_head = hp_.n_head;
        const qkv_proj p = project_qkv(g, L, x);
        ggml_tensor * qg = p.q;  // [2 * hd * n_head, n_tok]
        const size_t es = ggml_element_size(qg);
        ggml_tensor * q = ggml_view_3d(ctx, qg, hd, n_head, n_tok, 2 * hd * es, qg->nb[1], 0);
        ggml_tensor * gate = ggml_view_3d(ctx, qg, hd, n_head, n_tok, 2 * hd * es, qg->nb[1], hd * es);
        gate = ggml_cont_2d(ctx, gate, hd * n_head, n_tok);

        ggml_tensor * k = p.k, * v = p.v;
        q = rope(g, rms_norm(g, q, L.q_norm));
        k = rope(g, rms_norm(g, k, L.k_norm));

        ggml_tensor * a = attention_kv(g, il, q, k, v, 1.0f / sqrtf((float) hd));  // [hd * n_head, n_tok]
        return matmul(g, L.wo, ggml_mul(ctx, a, ggml_sigmoid(ctx, gate)));
    }

    ggml_tensor * rope(graph_inputs & g, ggml_tensor * x) const {
        return rope_multi(g, x, g.pos, hp_.n_rot, hp_.rope_sections, GGML_ROPE_TYPE_IMROPE, hp_);
    }
};

}  // namespace

std::unique_ptr<target_model> make_qwen35(std::unique_ptr<gguf_file> f) {
    return std::make_unique<qwen35_model>(std::move(f), /*moe=*/false);
}

std::unique_ptr<target_model> make_qwen35moe(std::unique_ptr<gguf_file> f) {
    return std::make_unique<qwen35_model>(std::move(f), /*moe=*/true);
}

}  // namespace dfn
