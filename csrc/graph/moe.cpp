#include "graph/moe.h"
#include "graph/graph.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/matmul/quantize_act.h"
#include "kernels/cpu/matmul/wide_gemm.h"
#include "kernels/cpu/moe_experts.h"

#include "base/common.h"

namespace dfn {

static const char * W = "load_gguf";

void read_moe_hparams(const gguf_file & f, target_hparams & hp) {
    const std::string a = hp.arch + ".";
    hp.n_expert = f.get_u32(a + "expert_count");
    hp.n_expert_used = f.get_u32(a + "expert_used_count");
    hp.n_ff_exp = f.get_u32(a + "expert_feed_forward_length");
    hp.n_ff_shexp = f.get_u32(a + "expert_shared_feed_forward_length", 0);
    hp.expert_weights_norm = f.get_bool(a + "expert_weights_norm", true);
    DFN_REQUIRE(hp.n_expert >= 1 && hp.n_expert <= k_max_experts, W, "'", f.path(), "': expert_count ", hp.n_expert,
                " must be in [1, ", k_max_experts, "]");
    DFN_REQUIRE(hp.n_expert_used >= 1 && hp.n_expert_used <= hp.n_expert, W, "'", f.path(), "': expert_used_count ",
                hp.n_expert_used, " must be in [1, expert_count ", hp.n_expert, "]");
    DFN_REQUIRE(hp.n_ff_exp >= 1 && hp.n_ff_exp <= k_max_dim, W, "'", f.path(), "': expert_feed_forward_length ",
                hp.n_ff_exp, " must be in [1, ", k_max_dim, "]");
    DFN_REQUIRE(hp.n_ff_shexp <= k_max_dim, W, "'", f.path(), "': expert_shared_feed_forward_length ", hp.n_ff_shexp,
                " must be at most ", k_max_dim);
}

void load_moe(gguf_file & F, int il, const target_hparams & hp, layer_weights & L) {
    auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
    const int64_t E = hp.n_embd, n_ff = hp.n_ff_exp, n_exp = hp.n_expert;
    // The router stays F32 (llama.cpp's converter keeps it so); matmul() reads it as any matmul weight.
    L.ffn_gate_inp = F.tensor(n("ffn_gate_inp"), {E, n_exp}, TENSOR_ROLE_MATMUL);
    L.ffn_gate_exps = F.tensor(n("ffn_gate_exps"), {E, n_ff, n_exp}, TENSOR_ROLE_MATMUL);
    L.ffn_up_exps = F.tensor(n("ffn_up_exps"), {E, n_ff, n_exp}, TENSOR_ROLE_MATMUL);
    L.ffn_down_exps = F.tensor(n("ffn_down_exps"), {n_ff, E, n_exp}, TENSOR_ROLE_MATMUL);
    if (hp.n_ff_shexp == 0) return;
    const int64_t n_sh = hp.n_ff_shexp;
    L.ffn_gate_inp_shexp = F.tensor(n("ffn_gate_inp_shexp"), {E}, TENSOR_ROLE_MATMUL);
    L.ffn_gate_shexp = F.tensor(n("ffn_gate_shexp"), {E, n_sh}, TENSOR_ROLE_MATMUL);
    L.ffn_up_shexp = F.tensor(n("ffn_up_shexp"), {E, n_sh}, TENSOR_ROLE_MATMUL);
    L.ffn_down_shexp = F.tensor(n("ffn_down_shexp"), {n_sh, E}, TENSOR_ROLE_MATMUL);
}

// The stacked experts W times each token's selected experts (ids), ggml_mul_mat_id's shapes
// (moe_experts.h). moe_experts_op where it applies, as matmul() takes matmul_op: our kernels (not on
// a device, not matmul="ggml"), W of a type the kernel takes in host memory, and at most
// k_matmul_max_cols tokens (AR steps, verify passes, drafts), or wider (prompt chunks) where the
// wide GEMM takes W's type (wide_gemm.h); else ggml_mul_mat_id.
static ggml_tensor * experts_matmul(const build_context & b, ggml_tensor * W, ggml_tensor * x, ggml_tensor * ids) {
    const bool wide_ok = q8_kind_of(W->type) != q8_kind::none && matmul_wide_available();
    if (b.own_kernels() && (ids->ne[1] <= k_matmul_max_cols || wide_ok || b.any_width) && moe_experts_supported(W, x, ids))
        return moe_experts_op(b.ctx, W, x, ids, b.dispatch);
    return ggml_mul_mat_id(b.ctx, W, x, ids);
}

ggml_tensor * moe_ffn(const build_context & b, ggml_tensor * x, const layer_weights & w, const target_hparams & hp) {
    ggml_context * ctx = b.ctx;
    const int64_t n_embd = x->ne[0], n_tok = x->ne[1], n_exp = hp.n_expert, n_used = hp.n_expert_used;

    ggml_tensor * probs = ggml_soft_max(ctx, matmul(b, w.ffn_gate_inp, x));  // [n_expert, n_tok]
    ggml_tensor * sel = ggml_argsort_top_k(ctx, probs, (int) n_used);         // I32 [n_used, n_tok]
    ggml_tensor * wsel = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, n_exp, n_tok), sel);  // [1, n_used, n_tok]
    if (hp.expert_weights_norm) {
        ggml_tensor * sum = ggml_sum_rows(ctx, ggml_reshape_2d(ctx, wsel, n_used, n_tok));  // [1, n_tok]
        wsel = ggml_div(ctx, wsel, ggml_reshape_3d(ctx, sum, 1, 1, n_tok));
    }

    ggml_tensor * x3 = ggml_reshape_3d(ctx, x, n_embd, 1, n_tok);
    ggml_tensor * gate = experts_matmul(b, w.ffn_gate_exps, x3, sel);  // [n_ff_exp, n_used, n_tok]
    ggml_tensor * up = experts_matmul(b, w.ffn_up_exps, x3, sel);      // [n_ff_exp, n_used, n_tok]
    ggml_tensor * y = experts_matmul(b, w.ffn_down_exps, ggml_swiglu_split(ctx, gate, up), sel);  // [n_embd, n_used, n_tok]
    y = ggml_mul(ctx, y, wsel);

    // sum over the selected experts, in their (descending) order
    ggml_tensor * out = nullptr;
    for (int64_t j = 0; j < n_used; ++j) {
        ggml_tensor * yj = ggml_view_2d(ctx, y, n_embd, n_tok, y->nb[2], j * y->nb[1]);  // [n_embd, n_tok]
        out = out ? ggml_add(ctx, out, yj) : ggml_cont(ctx, yj);
    }
    if (!w.ffn_gate_shexp) return out;

    ggml_tensor * sh = ggml_swiglu_split(ctx, matmul(b, w.ffn_gate_shexp, x), matmul(b, w.ffn_up_shexp, x));  // [n_ff_shexp, n_tok]
    sh = matmul(b, w.ffn_down_shexp, sh);                                            // [n_embd, n_tok]
    ggml_tensor * sh_gate = ggml_sigmoid(ctx, matmul(b, w.ffn_gate_inp_shexp, x));  // [1, n_tok]
    return ggml_add(ctx, out, ggml_mul(ctx, sh, sh_gate));
}

ggml_tensor * ffn_block(const build_context & b, ggml_tensor * x, const layer_weights & w, const target_hparams & hp) {
    return w.ffn_gate_exps ? moe_ffn(b, x, w, hp) : ffn_swiglu(b, x, w);
}

}  // namespace dfn
