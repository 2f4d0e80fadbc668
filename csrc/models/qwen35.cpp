// Qwen3.5 hybrid target (GGUF arch "qwen35"): Gated DeltaNet layers with a short conv, and
// every full_attention_interval-th layer gated full attention with partial multi-section RoPE.
// Norm weights are stored as (1 + w) by the converter, so every norm here is x_hat * w.
// Also Qwen3.5-MoE (GGUF arch "qwen35moe"): the same layers with the routed FFN and its shared
// expert (moe.h) in place of the dense SwiGLU.
#include "base/common.h"
#include "kernels/cpu/matmul/matmul.h"
#include "graph/graph.h"
#include "models/model.h"
#include "graph/moe.h"

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

        read_gdn_hparams(F, hp_);

        load_common_tensors();
        const int64_t E = hp_.n_embd, hd = hp_.head_dim;
        const int64_t H_v = hp_.ssm_n_v_heads;
        const tensor_role MM = TENSOR_ROLE_MATMUL, V32 = TENSOR_ROLE_F32;
        for (int il = 0; il < hp_.n_layer; ++il) {
            layer_weights & L = layers[il];
            auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
            L.attn_norm = F.tensor(n("attn_norm"), {E}, V32);
            L.post_attn_norm = F.tensor(n("post_attention_norm"), {E}, V32);
            if (hp_.is_gdn[il]) {
                load_gdn_layer(F, il, hp_, L);
                L.ssm_beta = F.tensor(n("ssm_beta"), {E, H_v}, MM);
                L.ssm_alpha = F.tensor(n("ssm_alpha"), {E, H_v}, MM);
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
        const rope_fn rope_qk = [&](ggml_tensor * x) {
            return rope_multi(g, x, g.pos, hp_.n_rot, hp_.rope_sections, GGML_ROPE_TYPE_IMROPE, hp_);
        };
        ggml_tensor * cur = ggml_get_rows(ctx, tok_embd, g.tokens);  // [n_embd, n_tok]
        for (int il = 0; il < hp_.n_layer; ++il) {
            const layer_weights & L = layers[il];
            ggml_tensor * inp = cur;
            ggml_tensor * x = rms_norm(g, cur, L.attn_norm);
            x = hp_.is_gdn[il] ? gdn_mixer(g, il, L, x) : gated_attention(g, il, L, x, rope_qk);
            cur = ggml_add(ctx, x, inp);

            ggml_tensor * ffn_inp = cur;
            cur = ggml_add(ctx, ffn_block(g, rms_norm(g, cur, L.post_attn_norm), L, hp_), ffn_inp);
            g.tap(il, cur);
        }
        return rms_norm(g, cur, output_norm);
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
