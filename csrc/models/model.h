// Target model interface: hparams, weights, and the graph builder each architecture implements.
#pragma once

#include "gguf/gguf_file.h"

#include "ggml.h"

#include <memory>
#include <string>
#include <vector>

namespace dfn {

// RoPE frequency scaling, from `<arch>.rope.scaling.*` as llama.cpp reads them (read_rope_scaling),
// in the form ggml_rope_ext / ggml_rope_multi take it. Identity: no scaling.
//   linear: every frequency divided by `factor` (HF rope_type "linear").
//   yarn:   YaRN (HF rope_type "yarn"): dims below the beta_fast correction dim keep their
//           frequency, dims above beta_slow's are divided by `factor`, a linear ramp between
//           (ext_factor scales the ramp; 1 = HF's); cos/sin scaled by HF's attention_factor.
struct rope_scaling {
    float freq_scale = 1.0f;   // 1 / rope.scaling.factor
    float ext_factor = 0.0f;   // yarn_ext_factor (yarn: default 1); 0: pure interpolation
    // What ggml gets: with ext_factor != 0 ggml multiplies cos/sin by 1 + 0.1 ln(1/freq_scale)
    // itself, so this is the wanted magnitude divided by that (see read_rope_scaling).
    float attn_factor = 1.0f;
    float beta_fast = 32.0f;   // yarn_beta_fast
    float beta_slow = 1.0f;    // yarn_beta_slow
    int64_t n_ctx_orig = 0;    // rope.scaling.original_context_length (default: context_length)
};

// The transformer-block keys every architecture, the DFlash drafter included, stores under
// "<arch>.": read and range-checked once (read_block_hparams).
struct block_hparams {
    int64_t n_layer = 0;
    int64_t n_embd = 0;
    int64_t n_ff = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;     // attention.key_length (n_embd / n_head when absent)
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-6f;
    float rope_base = 10000.0f;
    rope_scaling rope;
};

struct target_hparams : block_hparams {
    std::string arch;
    int64_t n_vocab = 0;
    int64_t n_tokenizer_tokens = -1;  // tokenizer.ggml.tokens entries; -1 without a tokenizer
    int64_t n_rot = 0;
    int rope_sections[4] = {0, 0, 0, 0};

    // routed experts (MoE archs only)
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_ff_exp = 0;
    int64_t n_ff_shexp = 0;           // shared expert width; 0: no shared expert
    bool expert_weights_norm = true;  // renormalise the top-k router probabilities to sum 1

    // Gated DeltaNet (hybrid archs only)
    int64_t ssm_d_conv = 0;     // conv kernel width
    int64_t ssm_head_dim = 0;   // d_k == d_v per head (ggml_gated_delta_net needs them equal)
    int64_t ssm_n_k_heads = 0;  // key heads (groups)
    int64_t ssm_n_v_heads = 0;  // value heads; a multiple of ssm_n_k_heads (tiled broadcast)
    std::vector<bool> is_gdn;   // per layer: GDN (true) or full attention (false)

    int64_t ssm_conv_channels() const { return ssm_head_dim * (2 * ssm_n_k_heads + ssm_n_v_heads); }
    int64_t ssm_d_inner() const { return ssm_head_dim * ssm_n_v_heads; }
    bool layer_is_gdn(int il) const { return !is_gdn.empty() && is_gdn[il]; }
};

// Per-layer weights; an architecture fills what it uses.
struct layer_weights {
    ggml_tensor * attn_norm = nullptr;       // F32 [n_embd]
    ggml_tensor * post_attn_norm = nullptr;  // F32 [n_embd] (qwen35: the pre-FFN norm)
    ggml_tensor * ffn_norm = nullptr;        // F32 [n_embd] (qwen3)

    // full attention
    ggml_tensor * wq = nullptr;  // [n_embd, head_dim * n_head (x2 with gate)]
    ggml_tensor * wk = nullptr;  // [n_embd, head_dim * n_head_kv]
    ggml_tensor * wv = nullptr;  // [n_embd, head_dim * n_head_kv]
    ggml_tensor * wo = nullptr;  // [head_dim * n_head, n_embd]
    // llama.cpp's `convert_hf_to_gguf.py --fuse-qkv`: one attn_qkv with the rows of W_q, W_k, W_v in
    // turn, [n_embd, head_dim * (q_mult * n_head + 2 * n_head_kv)]; wq, wk, wv are then null
    ggml_tensor * wqkv_fused = nullptr;
    ggml_tensor * q_norm = nullptr;  // F32 [head_dim]
    ggml_tensor * k_norm = nullptr;  // F32 [head_dim]

    // Gated DeltaNet
    ggml_tensor * wqkv = nullptr;       // [n_embd, conv_channels]
    ggml_tensor * wgate = nullptr;      // [n_embd, d_inner]   (z)
    ggml_tensor * ssm_conv1d = nullptr; // F32 [d_conv, conv_channels]
    ggml_tensor * ssm_dt = nullptr;     // F32 [n_v_heads]   dt bias
    ggml_tensor * ssm_a = nullptr;      // F32 [n_v_heads]   -exp(A_log)
    ggml_tensor * ssm_beta = nullptr;   // [n_embd, n_v_heads]
    ggml_tensor * ssm_alpha = nullptr;  // [n_embd, n_v_heads]
    ggml_tensor * ssm_ba = nullptr;     // [n_embd, 2 * n_v_heads]  Qwen3-Next's fused beta/alpha, per key head [b x r | a x r]
    ggml_tensor * ssm_norm = nullptr;   // F32 [head_dim]
    ggml_tensor * ssm_out = nullptr;    // [d_inner, n_embd]

    // SwiGLU FFN
    ggml_tensor * ffn_gate = nullptr;  // [n_embd, n_ff]
    ggml_tensor * ffn_up = nullptr;    // [n_embd, n_ff]
    ggml_tensor * ffn_down = nullptr;  // [n_ff, n_embd]

    // routed experts (moe.h)
    ggml_tensor * ffn_gate_inp = nullptr;   // F32 [n_embd, n_expert]  router
    ggml_tensor * ffn_gate_exps = nullptr;  // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_up_exps = nullptr;    // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_down_exps = nullptr;  // [n_ff_exp, n_embd, n_expert]
    ggml_tensor * ffn_gate_inp_shexp = nullptr;  // [n_embd]  shared expert's gate (sigmoid)
    ggml_tensor * ffn_gate_shexp = nullptr;      // [n_embd, n_ff_shexp]
    ggml_tensor * ffn_up_shexp = nullptr;        // [n_embd, n_ff_shexp]
    ggml_tensor * ffn_down_shexp = nullptr;      // [n_ff_shexp, n_embd]
};

// Upper bounds on hparams read from a file: far above any real model, low enough that products
// like head_dim * n_head stay exact in int64 and in ggml's int32 op parameters.
constexpr int64_t k_max_dim = 1 << 20;    // n_embd, n_ff, head_dim, ssm sizes
constexpr int64_t k_max_heads = 1 << 14;  // attention and GDN head counts

// Reads `<arch>.block_count`, embedding / feed-forward / head sizes, context_length, the RMSNorm
// epsilon and the RoPE base, and checks them (sizes within k_max_*, heads a multiple of the KV
// heads, head_dim even, epsilon >= 0 as ggml's rms_norm asserts, RoPE base > 0, training context in
// [1, 2^31)); throws input_error naming the file otherwise. max_layers bounds block_count.
// Without ff_required, a missing feed_forward_length reads as 0 (MoE models without a dense FFN).
block_hparams read_block_hparams(const gguf_file & f, const std::string & arch, int64_t max_layers,
                                 bool ff_required = true);

// `<arch>.rope.scaling.*`: type "none", "linear" or "yarn" (absent: llama.cpp's default, linear by
// `factor` if there is one, else none), factor (or the old `rope.scale_linear`), attn_factor, and
// for yarn original_context_length and yarn_{ext_factor, attn_factor, beta_fast, beta_slow}.
// Throws input_error naming the key for any other type ("longrope", ...), any other scaling key
// (yarn_log_multiplier != 0, alpha, ...), yarn keys without yarn, and values out of range.
// `finetuned` is metadata only and is accepted.
rope_scaling read_rope_scaling(const gguf_file & f, const std::string & arch, int64_t n_ctx_train);

// The attention weights of layer il: W_q [n_embd, q_mult * head_dim * n_head] (q_mult 2: Qwen3.5's
// [q | gate] per head), W_k, W_v [n_embd, head_dim * n_head_kv] (or, in a file without attn_q, the
// fused attn_qkv: layer_weights::wqkv_fused), W_o [head_dim * n_head, n_embd] and
// the q/k RMSNorm weights F32 [head_dim] (unless qk_norm is false: Llama has none); shapes and types checked.
void load_attention(gguf_file & F, int il, int64_t n_embd, int64_t head_dim, int64_t n_head, int64_t n_head_kv,
                    int64_t q_mult, layer_weights & L, bool qk_norm = true);
// The SwiGLU FFN of layer il: gate, up [n_embd, n_ff], down [n_ff, n_embd].
void load_ffn(gguf_file & F, int il, int64_t n_embd, int64_t n_ff, layer_weights & L);

// Gated DeltaNet hybrids (qwen35, qwen35moe, qwen3next): `ssm.conv_kernel`, `ssm.inner_size`,
// `ssm.state_size`, `ssm.time_step_rank`, `ssm.group_count` and the layer pattern
// (`attention.recurrent_layers`, else every `full_attention_interval`-th layer is attention) into
// hp, checked (d_k == d_v, value heads a multiple of key heads).
void read_gdn_hparams(const gguf_file & f, target_hparams & hp);
// The GDN tensors of layer il every hybrid shares: attn_qkv [n_embd, conv_channels], attn_gate (z)
// [n_embd, d_inner], ssm_conv1d, ssm_dt.bias, ssm_a, ssm_norm, ssm_out. The beta/alpha projections
// differ per arch and are left to it.
void load_gdn_layer(gguf_file & F, int il, const target_hparams & hp, layer_weights & L);

// Layer il of a Qwen3-style block as Qwen3 targets and DFlash drafters store it: attention with
// q/k RMSNorm (attn_norm before it, ffn_norm after it) and a SwiGLU FFN. Shapes are checked.
void load_qwen3_layer(gguf_file & F, int il, int64_t n_embd, int64_t head_dim, int64_t n_head,
                      int64_t n_head_kv, int64_t n_ff, layer_weights & L);

struct graph_inputs;  // graph.h

class target_model {
public:
    virtual ~target_model() = default;

    // Opens `path`, reads and validates hparams and tensor shapes; data is not read yet.
    static std::unique_ptr<target_model> open(const std::string & path);

    void load_weights(ggml_backend_buffer_type_t buft, bool use_mmap) { file_->load_weights(buft, use_mmap); }
    void load_weights(const gguf_file::placement & place, bool use_mmap) { file_->load_weights(place, use_mmap); }

    // Builds the forward pass of g.n_tokens tokens into g.gf; returns the final hidden
    // states after output_norm, F32 [n_embd, n_tokens]. Taps and caches are wired by `g`.
    virtual ggml_tensor * build_forward(graph_inputs & g) const = 0;

    // Positions per token in the `pos` input, I32 [n_tokens * n_pos_per_token()].
    virtual int n_pos_per_token() const { return 1; }
    // That input for tokens at positions n_past .. n_past + n - 1.
    virtual void fill_positions(int64_t n_past, int64_t n, int32_t * pos) const {
        for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t) (n_past + i);
    }

    // The same input for tokens at the text positions p[0 .. n) (tree verify: n_past + depth).
    virtual void fill_positions_at(const int64_t * p, int64_t n, int32_t * pos) const {
        for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t) p[i];
    }

    const target_hparams & hparams() const { return hp_; }
    const gguf_file & file() const { return *file_; }

    ggml_tensor * tok_embd = nullptr;     // [n_embd, n_vocab]
    ggml_tensor * output_norm = nullptr;  // F32 [n_embd]
    ggml_tensor * output = nullptr;       // [n_embd, n_vocab] (== tok_embd when tied)
    std::vector<layer_weights> layers;

protected:
    explicit target_model(std::unique_ptr<gguf_file> f) : file_(std::move(f)) {}
    void read_common_hparams(bool ff_required = true);
    void load_common_tensors();
    std::string key(const char * suffix) const { return hp_.arch + "." + suffix; }

    std::unique_ptr<gguf_file> file_;
    target_hparams hp_;
};

std::unique_ptr<target_model> make_llama(std::unique_ptr<gguf_file> f);
std::unique_ptr<target_model> make_qwen3(std::unique_ptr<gguf_file> f);
std::unique_ptr<target_model> make_qwen3moe(std::unique_ptr<gguf_file> f);
std::unique_ptr<target_model> make_qwen35(std::unique_ptr<gguf_file> f);
std::unique_ptr<target_model> make_qwen35moe(std::unique_ptr<gguf_file> f);
std::unique_ptr<target_model> make_qwen3next(std::unique_ptr<gguf_file> f);

}  // namespace dfn
