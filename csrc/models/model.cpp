#include "models/model.h"

#include "base/common.h"

#include <cmath>

namespace dfn {

static const char * W = "load_gguf";

std::unique_ptr<target_model> target_model::open(const std::string & path) {
    auto f = std::make_unique<gguf_file>(path);
    DFN_REQUIRE(f->has_key("general.architecture"), W, "'", path, "' has no general.architecture key");
    const std::string arch = f->arch();
    if (arch == "llama") return make_llama(std::move(f));
    if (arch == "qwen3") return make_qwen3(std::move(f));
    if (arch == "qwen3moe") return make_qwen3moe(std::move(f));
    if (arch == "qwen35") return make_qwen35(std::move(f));
    if (arch == "qwen35moe") return make_qwen35moe(std::move(f));
    if (arch == "qwen3next") return make_qwen3next(std::move(f));
    throw input_error(cat("[", W, "] '", path, "': unsupported target architecture '", arch,
                          "' (supported: llama, qwen3, qwen3moe, qwen35, qwen35moe, qwen3next)"));
}

block_hparams read_block_hparams(const gguf_file & f, const std::string & arch, int64_t max_layers, bool ff_required) {
    auto key = [&](const char * suffix) { return arch + "." + suffix; };
    block_hparams hp;
    hp.n_layer = f.get_u32(key("block_count"));
    hp.n_embd = f.get_u32(key("embedding_length"));
    hp.n_ff = ff_required ? f.get_u32(key("feed_forward_length")) : f.get_u32(key("feed_forward_length"), 0);
    hp.n_head = f.get_u32(key("attention.head_count"));
    hp.n_head_kv = f.get_u32(key("attention.head_count_kv"), (uint32_t) hp.n_head);
    hp.head_dim = f.get_u32(key("attention.key_length"), hp.n_head ? (uint32_t) (hp.n_embd / hp.n_head) : 0);
    hp.n_ctx_train = f.get_u32(key("context_length"), 4096);
    hp.rms_eps = f.get_f32(key("attention.layer_norm_rms_epsilon"), 1e-6f);
    hp.rope_base = f.get_f32(key("rope.freq_base"), 10000.0f);

    const std::string & path = f.path();
    DFN_REQUIRE(hp.n_layer > 0 && hp.n_layer <= max_layers, W, "'", path, "': bad block_count ", hp.n_layer);
    DFN_REQUIRE(hp.n_embd > 0 && (hp.n_ff > 0 || !ff_required) && hp.n_embd <= k_max_dim && hp.n_ff <= k_max_dim, W, "'", path,
                "': embedding_length ", hp.n_embd, " and feed_forward_length ", hp.n_ff, " must be in [1, ", k_max_dim, "]");
    DFN_REQUIRE(hp.n_head > 0 && hp.n_head_kv > 0 && hp.n_head <= k_max_heads && hp.n_head % hp.n_head_kv == 0, W,
                "'", path, "': head_count ", hp.n_head, " must be a positive multiple of head_count_kv ",
                hp.n_head_kv, " and at most ", k_max_heads);
    DFN_REQUIRE(hp.head_dim > 0 && hp.head_dim <= k_max_dim && hp.head_dim % 2 == 0, W, "'", path, "': key_length ",
                hp.head_dim, " must be even and in [2, ", k_max_dim, "]");
    DFN_REQUIRE(hp.rms_eps >= 0.0f, W, "'", path, "': attention.layer_norm_rms_epsilon ", hp.rms_eps, " must be >= 0");
    DFN_REQUIRE(hp.rope_base > 0.0f, W, "'", path, "': rope.freq_base ", hp.rope_base, " must be > 0");
    DFN_REQUIRE(hp.n_ctx_train >= 1 && hp.n_ctx_train <= INT32_MAX, W, "'", path, "': context_length ", hp.n_ctx_train,
                " must be in [1, 2^31)");
    hp.rope = read_rope_scaling(f, arch, hp.n_ctx_train);
    return hp;
}

rope_scaling read_rope_scaling(const gguf_file & f, const std::string & arch, int64_t n_ctx_train) {
    const std::string pre = arch + ".rope.scaling.", &path = f.path();
    static const char * yarn_keys[] = {"original_context_length", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast",
                                       "yarn_beta_slow"};
    // every key under rope.scaling. is one we apply, or the load fails: a model never runs with
    // positions other than those it was trained with
    for (const std::string & k : f.keys_with_prefix(pre)) {
        const std::string name = k.substr(pre.size());
        bool known = name == "type" || name == "factor" || name == "attn_factor" || name == "finetuned";
        for (const char * y : yarn_keys) known = known || name == y;
        if (name == "yarn_log_multiplier") {
            DFN_REQUIRE(f.get_f32(k) == 0.0f, W, "'", path, "': key '", k, "' = ", f.get_f32(k), " is not supported "
                        "(YaRN with mscale_all_dim, as DeepSeek uses it, is not implemented)");
            known = true;
        }
        DFN_REQUIRE(known, W, "'", path, "': RoPE scaling key '", k, "' is not supported (supported: type, factor, ",
                    "attn_factor, finetuned, original_context_length, yarn_ext_factor, yarn_attn_factor, ",
                    "yarn_beta_fast, yarn_beta_slow)");
    }

    // llama.cpp: an absent type means "linear" (by `factor` when there is one, so no scaling
    // without it); "none" never scales
    const std::string type = f.get_str(pre + "type", "linear");
    DFN_REQUIRE(type == "none" || type == "linear" || type == "yarn", W, "'", path, "': ", pre, "type '", type,
                "' is not supported (supported: none, linear, yarn)");
    const bool yarn = type == "yarn";
    if (!yarn) {
        for (const char * y : yarn_keys) {
            DFN_REQUIRE(!f.has_key(pre + y), W, "'", path, "': key '", pre, y, "' needs ", pre, "type 'yarn', not '",
                        type, "'");
        }
    }
    float factor = f.has_key(pre + "factor") ? f.get_f32(pre + "factor") : f.get_f32(arch + ".rope.scale_linear", 0.0f);
    DFN_REQUIRE(factor >= 0.0f, W, "'", path, "': ", pre, "factor ", factor, " must be > 0");
    if (factor == 0.0f || type == "none") factor = 1.0f;  // llama.cpp: 0 is "not set"

    rope_scaling r;
    r.freq_scale = 1.0f / factor;
    r.n_ctx_orig = yarn ? f.get_u32(pre + "original_context_length", (uint32_t) n_ctx_train) : n_ctx_train;
    DFN_REQUIRE(r.n_ctx_orig >= 1 && r.n_ctx_orig <= INT32_MAX, W, "'", path, "': ", pre, "original_context_length ",
                r.n_ctx_orig, " must be in [1, 2^31)");
    r.ext_factor = f.get_f32(pre + "yarn_ext_factor", yarn ? 1.0f : 0.0f);
    DFN_REQUIRE(r.ext_factor >= 0.0f, W, "'", path, "': ", pre, "yarn_ext_factor ", r.ext_factor, " must be >= 0");
    r.beta_fast = f.get_f32(pre + "yarn_beta_fast", 32.0f);
    r.beta_slow = f.get_f32(pre + "yarn_beta_slow", 1.0f);
    DFN_REQUIRE(r.beta_fast > 0.0f && r.beta_slow > 0.0f, W, "'", path, "': ", pre, "yarn_beta_fast ", r.beta_fast,
                " and yarn_beta_slow ", r.beta_slow, " must be > 0");

    // The magnitude of cos/sin: HF's attention_factor (yarn_attn_factor, as llama.cpp's converter
    // writes it), by default HF's get_mscale(factor) = 1 + 0.1 ln(factor) for factor > 1 (what
    // llama.cpp computes), times llama.cpp's rope.scaling.attn_factor. ggml multiplies by
    // 1 + 0.1 ln(factor) itself whenever ext_factor != 0: divide that out.
    const float mscale = yarn && r.ext_factor != 0.0f && factor > 1.0f ? 1.0f + 0.1f * logf(factor) : 1.0f;
    const float attn = f.get_f32(pre + "yarn_attn_factor", mscale) * f.get_f32(pre + "attn_factor", 1.0f);
    DFN_REQUIRE(attn > 0.0f, W, "'", path, "': ", pre, "attn_factor and yarn_attn_factor must be > 0");
    const float ggml_mscale = r.ext_factor != 0.0f ? 1.0f + 0.1f * logf(factor) : 1.0f;
    DFN_REQUIRE(ggml_mscale > 0.0f, W, "'", path, "': ", pre, "factor ", factor, " is too small for yarn");
    r.attn_factor = attn / ggml_mscale;
    return r;
}

void target_model::read_common_hparams(bool ff_required) {
    const gguf_file & f = *file_;
    hp_.arch = f.arch();
    hp_.n_tokenizer_tokens = f.arr_len("tokenizer.ggml.tokens");
    static_cast<block_hparams &>(hp_) = read_block_hparams(f, hp_.arch, 1024, ff_required);
    // llama.cpp's converter appends a checkpoint's multi-token-prediction layers (Qwen3.5's `mtp.*`)
    // as the last `nextn_predict_layers` blocks; llama.cpp's own forward pass stops before them,
    // and so does ours: their tensors are never read
    const uint32_t n_nextn = f.get_u32(key("nextn_predict_layers"), 0);
    DFN_REQUIRE(n_nextn < hp_.n_layer, W, "'", f.path(), "': nextn_predict_layers ", n_nextn,
                " must be less than block_count ", hp_.n_layer);
    hp_.n_layer -= n_nextn;
    hp_.n_rot = f.get_u32(key("rope.dimension_count"), (uint32_t) hp_.head_dim);
    const uint32_t v_len = f.get_u32(key("attention.value_length"), (uint32_t) hp_.head_dim);
    DFN_REQUIRE(v_len == hp_.head_dim, W, "'", f.path(), "': value_length ", v_len, " != key_length ", hp_.head_dim);
    DFN_REQUIRE(hp_.n_rot > 0 && hp_.n_rot <= hp_.head_dim && hp_.n_rot % 2 == 0, W, "'", f.path(),
                "': rope.dimension_count ", hp_.n_rot, " must be even and within head dim ", hp_.head_dim);

    DFN_REQUIRE(f.has_tensor("token_embd.weight"), W, "'", f.path(), "': missing tensor 'token_embd.weight'");
}

void target_model::load_common_tensors() {
    gguf_file & f = *file_;
    // n_vocab comes from the embedding's shape; every other tensor is checked against hparams.
    {
        ggml_tensor * t = f.tensor("token_embd.weight", {}, TENSOR_ROLE_EMBEDDING, false);
        hp_.n_vocab = t ? t->ne[1] : 0;
        DFN_REQUIRE(t && t->ne[0] == hp_.n_embd && t->ne[2] == 1 && hp_.n_vocab > 0, W, "'", f.path(),
                    "': token_embd.weight has shape [", t ? t->ne[0] : 0, ", ", hp_.n_vocab,
                    "], expected [", hp_.n_embd, ", n_vocab]");
    }
    tok_embd = f.tensor("token_embd.weight", {hp_.n_embd, hp_.n_vocab}, TENSOR_ROLE_EMBEDDING);
    output_norm = f.tensor("output_norm.weight", {hp_.n_embd}, TENSOR_ROLE_F32);
    output = f.tensor("output.weight", {hp_.n_embd, hp_.n_vocab}, TENSOR_ROLE_MATMUL, false);
    if (!output) output = f.tensor("token_embd.weight", {hp_.n_embd, hp_.n_vocab}, TENSOR_ROLE_MATMUL);  // tied
    layers.resize(hp_.n_layer);
}

void load_attention(gguf_file & F, int il, int64_t E, int64_t hd, int64_t n_head, int64_t n_head_kv, int64_t q_mult,
                    layer_weights & L, bool qk_norm) {
    auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
    if (!F.has_tensor(n("attn_q")) && F.has_tensor(n("attn_qkv"))) {  // llama.cpp's --fuse-qkv
        L.wqkv_fused = F.tensor(n("attn_qkv"), {E, hd * (q_mult * n_head + 2 * n_head_kv)}, TENSOR_ROLE_MATMUL);
    } else {
        L.wq = F.tensor(n("attn_q"), {E, q_mult * hd * n_head}, TENSOR_ROLE_MATMUL);
        L.wk = F.tensor(n("attn_k"), {E, hd * n_head_kv}, TENSOR_ROLE_MATMUL);
        L.wv = F.tensor(n("attn_v"), {E, hd * n_head_kv}, TENSOR_ROLE_MATMUL);
    }
    L.wo = F.tensor(n("attn_output"), {hd * n_head, E}, TENSOR_ROLE_MATMUL);
    if (!qk_norm) return;
    L.q_norm = F.tensor(n("attn_q_norm"), {hd}, TENSOR_ROLE_F32);
    L.k_norm = F.tensor(n("attn_k_norm"), {hd}, TENSOR_ROLE_F32);
}

void load_ffn(gguf_file & F, int il, int64_t E, int64_t n_ff, layer_weights & L) {
    auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
    L.ffn_gate = F.tensor(n("ffn_gate"), {E, n_ff}, TENSOR_ROLE_MATMUL);
    L.ffn_up = F.tensor(n("ffn_up"), {E, n_ff}, TENSOR_ROLE_MATMUL);
    L.ffn_down = F.tensor(n("ffn_down"), {n_ff, E}, TENSOR_ROLE_MATMUL);
}

void read_gdn_hparams(const gguf_file & F, target_hparams & hp) {
    const std::string & P = F.path();
    auto key = [&](const char * suffix) { return hp.arch + "." + suffix; };
    hp.ssm_d_conv = F.get_u32(key("ssm.conv_kernel"));
    const int64_t d_inner = F.get_u32(key("ssm.inner_size"));
    hp.ssm_head_dim = F.get_u32(key("ssm.state_size"));
    hp.ssm_n_v_heads = F.get_u32(key("ssm.time_step_rank"));
    hp.ssm_n_k_heads = F.get_u32(key("ssm.group_count"));
    DFN_REQUIRE(hp.ssm_d_conv >= 2, W, "'", P, "': ssm.conv_kernel ", hp.ssm_d_conv, " must be >= 2");
    DFN_REQUIRE(hp.ssm_d_conv <= 1024, W, "'", P, "': ssm.conv_kernel ", hp.ssm_d_conv, " must be <= 1024");
    DFN_REQUIRE(hp.ssm_head_dim > 0 && hp.ssm_n_v_heads > 0 && hp.ssm_n_k_heads > 0 && hp.ssm_head_dim <= k_max_dim &&
                hp.ssm_n_v_heads <= k_max_heads && hp.ssm_n_k_heads <= k_max_heads, W, "'", P,
                "': ssm.state_size, ssm.time_step_rank and ssm.group_count must be > 0 (and at most ", k_max_dim,
                ", ", k_max_heads, ", ", k_max_heads, ")");
    DFN_REQUIRE(hp.ssm_n_v_heads % hp.ssm_n_k_heads == 0, W, "'", P, "': value heads ", hp.ssm_n_v_heads,
                " must be a multiple of key heads ", hp.ssm_n_k_heads);
    DFN_REQUIRE(d_inner == hp.ssm_head_dim * hp.ssm_n_v_heads, W, "'", P, "': ssm.inner_size ", d_inner,
                " != value head dim x value heads; GDN needs d_k == d_v (", hp.ssm_head_dim, " x ",
                hp.ssm_n_v_heads, ")");

    // Layer pattern: explicit per-layer flags, else every interval-th layer is attention.
    hp.is_gdn.assign(hp.n_layer, false);
    const auto recurrent = F.get_int_arr(key("attention.recurrent_layers"));
    if (!recurrent.empty()) {
        DFN_REQUIRE((int64_t) recurrent.size() >= hp.n_layer, W, "'", P, "': attention.recurrent_layers has ",
                    recurrent.size(), " entries for ", hp.n_layer, " layers");
        for (int il = 0; il < hp.n_layer; ++il) hp.is_gdn[il] = recurrent[il] != 0;
    } else {
        const uint32_t interval = F.get_u32(key("full_attention_interval"), 4);
        DFN_REQUIRE(interval >= 1, W, "'", P, "': full_attention_interval must be >= 1");
        for (int il = 0; il < hp.n_layer; ++il) hp.is_gdn[il] = (il + 1) % interval != 0;
    }
}

void load_gdn_layer(gguf_file & F, int il, const target_hparams & hp, layer_weights & L) {
    auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
    const int64_t E = hp.n_embd, S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads, n_ch = hp.ssm_conv_channels();
    const tensor_role MM = TENSOR_ROLE_MATMUL, V32 = TENSOR_ROLE_F32;
    L.wqkv = F.tensor(n("attn_qkv"), {E, n_ch}, MM);
    L.wgate = F.tensor(n("attn_gate"), {E, S * H_v}, MM);
    L.ssm_conv1d = F.tensor(n("ssm_conv1d"), {hp.ssm_d_conv, n_ch}, V32);
    L.ssm_dt = F.tensor(cat("blk.", il, ".ssm_dt.bias"), {H_v}, V32);
    L.ssm_a = F.tensor(cat("blk.", il, ".ssm_a"), {H_v}, V32);
    L.ssm_norm = F.tensor(n("ssm_norm"), {S}, V32);
    L.ssm_out = F.tensor(n("ssm_out"), {S * H_v, E}, MM);
}

void load_qwen3_layer(gguf_file & F, int il, int64_t E, int64_t hd, int64_t n_head, int64_t n_head_kv,
                      int64_t n_ff, layer_weights & L) {
    auto n = [il](const char * s) { return cat("blk.", il, ".", s, ".weight"); };
    L.attn_norm = F.tensor(n("attn_norm"), {E}, TENSOR_ROLE_F32);
    load_attention(F, il, E, hd, n_head, n_head_kv, 1, L);
    L.ffn_norm = F.tensor(n("ffn_norm"), {E}, TENSOR_ROLE_F32);
    load_ffn(F, il, E, n_ff, L);
}

}  // namespace dfn
