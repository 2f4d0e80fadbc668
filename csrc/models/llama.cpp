// Llama 3.x dense target (GGUF arch "llama"): pre-norm attention without q/k norms, NORM RoPE
// (the converter permutes W_q / W_k rows to adjacent pairs, as llama.cpp's does), optional
// per-frequency divisors (rope_freqs: Llama 3.1's llama3 scaling), SwiGLU FFN.
#include "base/common.h"
#include "graph/graph.h"
#include "models/model.h"

namespace dfn {

namespace {

static const char * W = "load_gguf";

class llama_model : public target_model {
public:
    explicit llama_model(std::unique_ptr<gguf_file> f) : target_model(std::move(f)) {
        read_common_hparams();
        gguf_file & F = *file_;
        // Rope scalings that are keys (linear, yarn, ...) would change positions; none is built here.
        const std::string scaling = F.get_str(key("rope.scaling.type"), "none");
        DFN_REQUIRE(scaling == "none", W, "'", F.path(), "': rope.scaling.type '", scaling,
                    "' is not supported for llama (only the rope_freqs tensor of Llama 3.1's llama3 scaling)");
        load_common_tensors();
        rope_freqs = F.tensor("rope_freqs.weight", {hp_.n_rot / 2}, TENSOR_ROLE_F32, false);  // F32 [n_rot / 2]
        const int64_t E = hp_.n_embd;
        for (int il = 0; il < hp_.n_layer; ++il) {
            layer_weights & L = layers[il];
            L.attn_norm = F.tensor(cat("blk.", il, ".attn_norm.weight"), {E}, TENSOR_ROLE_F32);
            load_attention(F, il, E, hp_.head_dim, hp_.n_head, hp_.n_head_kv, 1, L, /*qk_norm=*/false);
            L.ffn_norm = F.tensor(cat("blk.", il, ".ffn_norm.weight"), {E}, TENSOR_ROLE_F32);
            load_ffn(F, il, E, hp_.n_ff, L);
        }
    }

    ggml_tensor * build_forward(graph_inputs & g) const override {
        ggml_context * ctx = g.ctx;
        const rope_fn rope_qk = [&](ggml_tensor * x) {
            return rope_norm(g, x, g.pos, rope_freqs, hp_.n_rot, hp_.n_ctx_train, hp_.rope_base);
        };

        ggml_tensor * cur = ggml_get_rows(ctx, tok_embd, g.tokens);  // [n_embd, n_tok]
        for (int il = 0; il < hp_.n_layer; ++il) {
            const layer_weights & L = layers[il];
            ggml_tensor * inp = cur;

            cur = ggml_add(ctx, self_attention(g, il, L, rms_norm(g, cur, L.attn_norm), rope_qk), inp);

            ggml_tensor * ffn_inp = cur;
            cur = ggml_add(ctx, ffn_swiglu(g, rms_norm(g, cur, L.ffn_norm), L), ffn_inp);
            g.tap(il, cur);
        }
        return rms_norm(g, cur, output_norm);
    }

private:
    ggml_tensor * rope_freqs = nullptr;  // F32 [n_rot / 2] or null
};

}  // namespace

std::unique_ptr<target_model> make_llama(std::unique_ptr<gguf_file> f) {
    return std::make_unique<llama_model>(std::move(f));
}

}  // namespace dfn
