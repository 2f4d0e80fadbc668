// Qwen3-Next target (GGUF arch "qwen3next": Qwen3-Next-80B-A3B, Qwen3-Coder-Next): Qwen3.5's hybrid
// of Gated DeltaNet layers and gated full attention, with routed experts and a gated shared expert
// in every layer. What differs from Qwen3.5 (models/qwen35.cpp), as llama.cpp's converter writes it:
//   - GDN value heads stay in HF's grouped order (value head h belongs to key head h / r), so q/k
//     are repeated to the value heads (gdn_block's v_grouped) instead of broadcast by tiling;
//   - beta and alpha come from one fused projection ssm_ba, per key head [b x r | a x r];
//   - attention uses NeoX RoPE on the first rope.dimension_count dims (partial, one position).
// Norm weights are stored as (1 + w) by the converter, as for Qwen3.5.
#include "base/common.h"
#include "kernels/cpu/matmul/matmul.h"
#include "graph/graph.h"
#include "models/model.h"
#include "graph/moe.h"

namespace dfn {

namespace {

static const char * W = "load_gguf";

class qwen3next_model : public target_model {
public:
    explicit qwen3next_model(std::unique_ptr<gguf_file> f) : target_model(std::move(f)) {
        read_common_hparams(/*ff_required=*/false);
        gguf_file & F = *file_;
        read_moe_hparams(F, hp_);
        // llama.cpp: the shared expert is as wide as feed_forward_length when its own key is absent
        if (hp_.n_ff_shexp == 0) hp_.n_ff_shexp = hp_.n_ff;
        DFN_REQUIRE(hp_.n_ff_shexp > 0, W, "'", F.path(), "': qwen3next needs a shared expert: ",
                    "expert_shared_feed_forward_length (or feed_forward_length) must be > 0");
        read_gdn_hparams(F, hp_);

        load_common_tensors();
        const int64_t E = hp_.n_embd, H_v = hp_.ssm_n_v_heads;
        for (int il = 0; il < hp_.n_layer; ++il) {
            layer_weights & L = layers[il];
            auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
            L.attn_norm = F.tensor(n("attn_norm"), {E}, TENSOR_ROLE_F32);
            L.post_attn_norm = F.tensor(n("post_attention_norm"), {E}, TENSOR_ROLE_F32);
            if (hp_.is_gdn[il]) {
                DFN_REQUIRE(!F.has_tensor(n("ssm_in")), W, "'", F.path(), "': '", n("ssm_in"), "' (the fused qkvz ",
                            "projection of older llama.cpp converters) is not supported; convert the checkpoint ",
                            "again (attn_qkv + attn_gate)");
                load_gdn_layer(F, il, hp_, L);
                L.ssm_ba = F.tensor(n("ssm_ba"), {E, 2 * H_v}, TENSOR_ROLE_MATMUL);
            } else {
                load_attention(F, il, E, hp_.head_dim, hp_.n_head, hp_.n_head_kv, 2, L);  // [q | gate] per head
            }
            load_moe(F, il, hp_, L);
        }
    }

    ggml_tensor * build_forward(graph_inputs & g) const override {
        ggml_context * ctx = g.ctx;
        const rope_fn rope_qk = [&](ggml_tensor * x) {
            return rope_neox(g, x, g.pos, hp_.n_rot, hp_);
        };
        ggml_tensor * cur = ggml_get_rows(ctx, tok_embd, g.tokens);  // [n_embd, n_tok]
        for (int il = 0; il < hp_.n_layer; ++il) {
            const layer_weights & L = layers[il];
            ggml_tensor * inp = cur;
            ggml_tensor * x = rms_norm(g, cur, L.attn_norm);
            x = hp_.is_gdn[il] ? gdn(g, il, L, x) : gated_attention(g, il, L, x, rope_qk);
            cur = ggml_add(ctx, x, inp);

            ggml_tensor * ffn_inp = cur;
            cur = ggml_add(ctx, moe_ffn(g, rms_norm(g, cur, L.post_attn_norm), L, hp_), ffn_inp);
            g.tap(il, cur);
        }
        return rms_norm(g, cur, output_norm);
    }

private:
    // The GDN projections in Qwen3-Next's layout, then the shared block with grouped value heads.
    ggml_tensor * gdn(graph_inputs & g, int il, const layer_weights & L, ggml_tensor * x) const {
        ggml_context * ctx = g.ctx;
        const int64_t n_tok = g.n_tokens, H_k = hp_.ssm_n_k_heads, H_v = hp_.ssm_n_v_heads, r = H_v / H_k;
        gdn_proj p;
        p.qkv = matmul(g, L.wqkv, x);  // [n_ch, n_tok]
        p.z = matmul(g, L.wgate, x);   // [S * H_v, n_tok]
        // per key head j: [b_{j*r} .. b_{j*r+r-1} | a_{j*r} .. a_{j*r+r-1}], so the split keeps
        // the value heads in their grouped order
        ggml_tensor * ba = ggml_reshape_3d(ctx, matmul(g, L.ssm_ba, x), 2 * r, H_k, n_tok);  // [2r, H_k, n_tok]
        const size_t es = ggml_element_size(ba);
        ggml_tensor * b = ggml_view_3d(ctx, ba, r, H_k, n_tok, ba->nb[1], ba->nb[2], 0);
        ggml_tensor * a = ggml_view_3d(ctx, ba, r, H_k, n_tok, ba->nb[1], ba->nb[2], r * es);
        p.b = ggml_cont_2d(ctx, b, H_v, n_tok);  // [H_v, n_tok]
        p.a = ggml_cont_2d(ctx, a, H_v, n_tok);  // [H_v, n_tok]
        return gdn_block(g, il, L, p, /*v_grouped=*/true);
    }
};

}  // namespace

std::unique_ptr<target_model> make_qwen3next(std::unique_ptr<gguf_file> f) {
    return std::make_unique<qwen3next_model>(std::move(f));
}

}  // namespace dfn
