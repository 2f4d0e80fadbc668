// Qwen3-MoE target (GGUF arch "qwen3moe", Qwen3-30B-A3B's shape): Qwen3's attention (q/k RMSNorm,
// NeoX RoPE) and routed SwiGLU experts in every layer (moe.h).
#include "base/common.h"
#include "graph/graph.h"
#include "models/model.h"
#include "graph/moe.h"

namespace dfn {

namespace {

class qwen3moe_model : public target_model {
public:
    explicit qwen3moe_model(std::unique_ptr<gguf_file> f) : target_model(std::move(f)) {
        read_common_hparams();
        read_moe_hparams(*file_, hp_);
        load_common_tensors();
        gguf_file & F = *file_;
        const int64_t E = hp_.n_embd;
        for (int il = 0; il < hp_.n_layer; ++il) {
            layer_weights & L = layers[il];
            L.attn_norm = F.tensor(cat("blk.", il, ".attn_norm.weight"), {E}, TENSOR_ROLE_F32);
            load_attention(F, il, E, hp_.head_dim, hp_.n_head, hp_.n_head_kv, 1, L);
            L.ffn_norm = F.tensor(cat("blk.", il, ".ffn_norm.weight"), {E}, TENSOR_ROLE_F32);
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
            cur = ggml_add(ctx, self_attention(g, il, L, rms_norm(g, cur, L.attn_norm), rope_qk), cur);
            cur = ggml_add(ctx, moe_ffn(g, rms_norm(g, cur, L.ffn_norm), L, hp_), cur);
            g.tap(il, cur);
        }
        return rms_norm(g, cur, output_norm);
    }
};

}  // namespace

std::unique_ptr<target_model> make_qwen3moe(std::unique_ptr<gguf_file> f) {
    return std::make_unique<qwen3moe_model>(std::move(f));
}

}  // namespace dfn
