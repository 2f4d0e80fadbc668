// Qwen3 dense target (GGUF arch "qwen3"): pre-norm attention with q/k RMSNorm, NeoX RoPE, SwiGLU FFN.
#include "base/common.h"
#include "kernels/cpu/matmul/matmul.h"
#include "graph/graph.h"
#include "models/model.h"

#include <cmath>

namespace dfn {

namespace {

class qwen3_model : public target_model {
public:
    explicit qwen3_model(std::unique_ptr<gguf_file> f) : target_model(std::move(f)) {
        read_common_hparams();
        load_common_tensors();
        for (int il = 0; il < hp_.n_layer; ++il) {
            load_qwen3_layer(*file_, il, hp_.n_embd, hp_.head_dim, hp_.n_head, hp_.n_head_kv, hp_.n_ff, layers[il]);
        }
    }

    ggml_tensor * build_forward(graph_inputs & g) const override {
        ggml_context * ctx = g.ctx;
        const rope_fn rope_qk = [&](ggml_tensor * x) { return rope(g, x); };

        ggml_tensor * cur = ggml_get_rows(ctx, tok_embd, g.tokens);  // [n_embd, n_tok]
        for (int il = 0; il < hp_.n_layer; ++il) {
            const layer_weights & L = layers[il];
            ggml_tensor * inp = cur;

            ggml_tensor * x = self_attention(g, il, L, rms_norm(g, cur, L.attn_norm), rope_qk);  // q/k RMSNorm inside
            cur = ggml_add(ctx, x, inp);

            ggml_tensor * ffn_inp = cur;
            cur = ggml_add(ctx, ffn_swiglu(g, rms_norm(g, cur, L.ffn_norm), L), ffn_inp);
            g.tap(il, cur);
        }
        return rms_norm(g, cur, output_norm);
    }

private:
    ggml_tensor * rope(graph_inputs & g, ggml_tensor * x) const {
        return rope_neox(g, x, g.pos, hp_.n_rot, hp_);
    }
};

}  // namespace

std::unique_ptr<target_model> make_qwen3(std::unique_ptr<gguf_file> f) {
    return std::make_unique<qwen3_model>(std::move(f));
}

}  // namespace dfn
