// DFlash drafter (GGUF arch "dflash"): Qwen3-style layers whose attention reads, besides the
// block itself, context K/V made from fused target hidden states: RMSNorm(fc([h_l1; h_l2; ...])).
// The block [last, MASK x (B-1)] attends to context + block without a causal mask.
#include "base/alloc.h"
#include "base/common.h"
#include "kernels/cpu/attn.h"
#include "models/drafter.h"
#include "graph/graph.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/top1.h"

#include <algorithm>
#include <cmath>

namespace dfn {

static const char * W = "load_gguf";

// A larger recorded window is no window at all (and a likely corrupt file).
static const int64_t kMaxTrainedContext = int64_t(1) << 20;

// Drafter kinds llama.cpp's dflash architecture runs and this engine does not: a file with any of
// these keys or tensors is refused, naming the kind. Implementing a kind means loading what it
// adds and taking its row out of this table (DFlash 2 and DSpark's Markov head are loaded:
// load_dflash2, load_dspark). (Anything else in the file that the loader does not
// read is refused too, by gguf_file::check_all_used, with a generic message.)
struct unimplemented_kind {
    const char * kind;
    std::vector<const char *> keys;
    std::vector<const char *> tensors;  // "blk.*." stands for every layer
};
static const unimplemented_kind k_unimplemented_kinds[] = {
    {"DSpark on DeepSeek-V4 (hyper-connections)", {"dflash.hyper_connection.count"}, {}},
    {"a reduced draft vocabulary in llama.cpp's form (d2t; this engine reads dflash.draft_vocab)", {}, {"d2t"}},
};

// "blk.*.x" matches blk.<n>.x
static bool tensor_matches(const std::string & name, const std::string & pattern) {
    const std::string any = "blk.*.";
    if (pattern.compare(0, any.size(), any) != 0) return name == pattern;
    const size_t dot = name.find('.', 4);
    return name.compare(0, 4, "blk.") == 0 && dot != std::string::npos && name.substr(dot + 1) == pattern.substr(any.size());
}

static void refuse_unimplemented_kinds(const gguf_file & F) {
    const std::vector<ggml_tensor *> tensors = F.tensors();
    for (const unimplemented_kind & k : k_unimplemented_kinds) {
        for (const char * key : k.keys) {
            DFN_REQUIRE(!F.has_key(key), W, "'", F.path(), "' is a ", k.kind, " drafter (key '", key,
                        "'), which this engine does not implement");
        }
        for (const char * pattern : k.tensors) {
            for (const ggml_tensor * t : tensors) {
                DFN_REQUIRE(!tensor_matches(t->name, pattern), W, "'", F.path(), "' is a ", k.kind, " drafter (tensor '",
                            t->name, "'), which this engine does not implement");
            }
        }
    }
}

drafter_model::drafter_model(const std::string & path, const target_hparams & target) {
    file_ = std::make_unique<gguf_file>(path);
    gguf_file & F = *file_;
    const std::string arch = F.arch();
    DFN_REQUIRE(arch == "dflash", W, "'", path, "' is a '", arch, "' model, not a DFlash drafter (arch 'dflash')");
    auto key = [](const char * s) { return std::string("dflash.") + s; };
    refuse_unimplemented_kinds(F);

    static_cast<block_hparams &>(hp_) = read_block_hparams(F, "dflash", 256);
    // rope.dimension_count (partial RoPE), hidden_activation and rope.dimension_sections: read below
    // and in refuse_unimplemented
    const uint32_t v_len = F.get_u32(key("attention.value_length"), (uint32_t) hp_.head_dim);
    DFN_REQUIRE(v_len == hp_.head_dim, W, "'", path, "': attention.value_length ", v_len, " must equal key_length ",
                hp_.head_dim, " (other value sizes are not implemented for drafters)");
    hp_.block_size = drafter_block_size(F);
    hp_.causal = F.get_bool(key("attention.causal"), false);
    hp_.sliding_window = F.get_u32(key("attention.sliding_window"), 0);
    hp_.embedding_scale = F.get_f32(key("embedding_scale"), 0.0f);
    hp_.logit_scale = F.get_f32(key("logit_scale"), 0.0f);
    hp_.attn_scale = F.get_f32(key("attention.scale"), 0.0f);
    hp_.n_rot = F.get_u32(key("rope.dimension_count"), (uint32_t) hp_.head_dim);  // partial rotary: the first n_rot dims
    hp_.attn_value_scale = F.get_f32(key("attention.value_scale"), 0.0f);
    hp_.final_logit_softcapping = F.get_f32(key("final_logit_softcapping"), 0.0f);
    DFN_REQUIRE(hp_.final_logit_softcapping >= 0.0f, W, "'", path, "': dflash.final_logit_softcapping ",
                hp_.final_logit_softcapping, " must be > 0 (or 0: none)");
    if (F.has_key(key("trained_context_length"))) {
        hp_.trained_context = F.get_u32(key("trained_context_length"));  // negatives: out of range
        DFN_REQUIRE(hp_.trained_context >= 1 && hp_.trained_context <= kMaxTrainedContext, W, "'", path,
                    "': dflash.trained_context_length ", hp_.trained_context, " must be in [1, ", kMaxTrainedContext, "]");
    }
    const auto pattern = F.get_int_arr(key("attention.sliding_window_pattern"));  // ignored without a window, as llama.cpp does
    if (hp_.sliding_window > 0) {
        hp_.is_swa.assign(hp_.n_layer, pattern.empty());  // no pattern: every layer slides
        for (size_t i = 0; i < pattern.size() && i < hp_.is_swa.size(); ++i) hp_.is_swa[i] = pattern[i] != 0;
    }
    DFN_REQUIRE(F.has_key("tokenizer.ggml.mask_token_id"), W, "'", path, "': missing key 'tokenizer.ggml.mask_token_id'");
    hp_.mask_token_id = F.get_u32("tokenizer.ggml.mask_token_id");

    DFN_REQUIRE(hp_.n_embd == target.n_embd, W, "drafter hidden size ", hp_.n_embd, " != target hidden size ", target.n_embd);
    DFN_REQUIRE(hp_.n_head > 0 && hp_.n_head_kv > 0 && hp_.n_head <= k_max_heads && hp_.n_head % hp_.n_head_kv == 0, W,
                "'", path, "': head_count ", hp_.n_head, " must be a positive multiple of head_count_kv ", hp_.n_head_kv,
                " and at most ", k_max_heads);
    DFN_REQUIRE(hp_.head_dim > 0 && hp_.head_dim <= k_max_dim && hp_.head_dim % 2 == 0, W, "'", path,
                "': key_length must be even and in [2, ", k_max_dim, "]");
    DFN_REQUIRE(hp_.n_rot > 0 && hp_.n_rot <= hp_.head_dim && hp_.n_rot % 2 == 0, W, "'", path,
                "': rope.dimension_count ", hp_.n_rot, " must be even and within head dim ", hp_.head_dim);
    DFN_REQUIRE(hp_.n_ff > 0 && hp_.n_ff <= k_max_dim, W, "'", path, "': feed_forward_length ", hp_.n_ff,
                " must be in [1, ", k_max_dim, "]");
    DFN_REQUIRE(hp_.mask_token_id < target.n_vocab, W, "drafter mask token id ", hp_.mask_token_id,
                " is outside the target vocabulary [0, ", target.n_vocab, ")");

    for (int64_t id : F.get_int_arr(key("draft_vocab"))) {
        DFN_REQUIRE(id >= 0 && id < target.n_vocab, W, "'", path, "': draft_vocab id ", id,
                    " is outside the target vocabulary [0, ", target.n_vocab, ")");
        DFN_REQUIRE(hp_.draft_vocab.empty() || id > hp_.draft_vocab.back(), W, "'", path,
                    "': draft_vocab must be strictly ascending (", id, " after ", hp_.draft_vocab.back(), ")");
        hp_.draft_vocab.push_back((int32_t) id);
    }

    const uint32_t n_vocab_key = F.get_u32(key("vocab_size"), (uint32_t) target.n_vocab);
    DFN_REQUIRE(n_vocab_key == target.n_vocab, W, "'", path, "': dflash.vocab_size ", n_vocab_key,
                " != the target's vocabulary size ", target.n_vocab);
    const int64_t n_tok = F.arr_len("tokenizer.ggml.tokens");
    DFN_REQUIRE(n_tok < 0 || target.n_tokenizer_tokens < 0 || n_tok == target.n_tokenizer_tokens, W,
                "drafter vocabulary (", n_tok, " tokens) != target vocabulary (", target.n_tokenizer_tokens, " tokens)");

    const auto layers = F.get_int_arr(key("target_layers"));
    DFN_REQUIRE(!layers.empty(), W, "'", path, "': missing key 'dflash.target_layers'");
    for (int64_t l : layers) {
        // GGUF stores HF target_layer_ids + 1 (the input of the next layer); we tap outputs.
        DFN_REQUIRE(l >= 1 && l <= target.n_layer, W, "drafter target layer ", l - 1, " (GGUF target_layers ", l,
                    ") is outside the target's ", target.n_layer, " layers");
        hp_.tap_layers.push_back((int) l - 1);
    }

    const int64_t E = hp_.n_embd, hd = hp_.head_dim;
    fc = F.tensor("fc.weight", {hp_.n_feature_row(), E}, TENSOR_ROLE_MATMUL);
    enc_norm = F.tensor("enc.output_norm.weight", {E}, TENSOR_ROLE_F32);
    output_norm = F.tensor("output_norm.weight", {E}, TENSOR_ROLE_F32);
    tok_embd = F.tensor("token_embd.weight", {E, target.n_vocab}, TENSOR_ROLE_EMBEDDING, false);  // own, optional
    output = F.tensor("output.weight", {E, target.n_vocab}, TENSOR_ROLE_MATMUL, false);
    if (!output && tok_embd) output = tok_embd;  // llama.cpp: own embeddings without a head are the head too
    layers_.resize(hp_.n_layer);
    for (int il = 0; il < hp_.n_layer; ++il) {
        load_qwen3_layer(F, il, E, hd, hp_.n_head, hp_.n_head_kv, hp_.n_ff, layers_[il]);
    }
    load_dflash2(F, path, target);
    load_dspark(F, path, target);
    refuse_unimplemented(F, path);
    F.check_all_used("dflash");
}

// What llama.cpp's dflash loader reads and this drafter does not implement: a clear error naming
// the key or tensor, never a silent difference.
void drafter_model::refuse_unimplemented(gguf_file & F, const std::string & path) {
    const std::string act = F.get_str("dflash.hidden_activation", "silu");
    DFN_REQUIRE(act == "silu", W, "'", path, "': dflash.hidden_activation '", act, "' is not supported (silu only)");
    const auto sections = F.get_int_arr("dflash.rope.dimension_sections");
    for (size_t i = 1; i < sections.size(); ++i) {
        DFN_REQUIRE(sections[i] == 0, W, "'", path, "': dflash.rope.dimension_sections with more than the temporal "
                    "section (M-RoPE proper) is not supported");
    }
    DFN_REQUIRE(sections.empty() || sections[0] == hp_.n_rot / 2, W, "'", path, "': dflash.rope.dimension_sections[0] ",
                sections.empty() ? 0 : sections[0], " != rope.dimension_count / 2");
    for (const char * name : {"rope_freqs.weight", "fc.scale", "output.scale", "markov_w1.scale"}) {
        DFN_REQUIRE(!F.has_tensor(name), W, "'", path, "': tensor '", name, "' is not supported");
    }
    static const char * per_layer[] = {"post_attention_norm.weight", "post_ffw_norm.weight", "layer_output_scale.weight",
                                       "attn_sinks.weight",          "attn_q.scale",         "attn_k.scale",
                                       "attn_v.scale",               "attn_output.scale",    "ffn_gate.scale",
                                       "ffn_up.scale",               "ffn_down.scale",       "rope_freqs.weight"};
    for (int il = 0; il < hp_.n_layer; ++il) {
        for (const char * t : per_layer) {
            const std::string name = cat("blk.", il, ".", t);
            DFN_REQUIRE(!F.has_tensor(name), W, "'", path, "': tensor '", name, "' is not supported");
        }
    }
}

// DSpark with a DFlash (Qwen3 / Llama layer) backbone: the tensors llama.cpp's dflash loader
// creates when the file has markov_w1.weight. Its DeepSeek-V4 backbone is refused by name.
void drafter_model::load_dspark(gguf_file & F, const std::string & path, const target_hparams & target) {
    DFN_REQUIRE(!F.has_key("dflash.hyper_connection.count"), W, "'", path,
                "': a DSpark drafter with a DeepSeek-V4 backbone (dflash.hyper_connection.count) is not supported");
    DFN_REQUIRE(!F.has_tensor("d2t"), W, "'", path,
                "': tensor 'd2t' (llama.cpp's reduced draft vocabulary) is not supported");
    // llama.cpp's converter writes both keys for a DSpark drafter (conversion/qwen.py)
    const bool anchor_key = F.has_key("dflash.sample_from_anchor"), conf_key = F.has_key("dflash.has_confidence_head");
    hp_.sample_from_anchor = F.get_bool("dflash.sample_from_anchor", true);
    const bool says_conf = F.get_bool("dflash.has_confidence_head", false);
    markov_w1 = F.tensor("markov_w1.weight", {}, TENSOR_ROLE_EMBEDDING, false);  // [rank, n_vocab]
    if (!markov_w1) {
        DFN_REQUIRE(!F.has_tensor("markov_w2.weight") && !F.has_tensor("conf_proj.weight"), W, "'", path,
                    "': markov_w2 / conf_proj without markov_w1.weight");
        DFN_REQUIRE(!anchor_key && !conf_key, W, "'", path, "': ",
                    anchor_key ? "dflash.sample_from_anchor" : "dflash.has_confidence_head",
                    " (a DSpark key) without markov_w1.weight");
        return;
    }
    DFN_REQUIRE(!hp_.has_selector(), W, "'", path, "': a DSpark Markov head with a DFlash 2 selector is not supported");
    DFN_REQUIRE(hp_.draft_vocab.empty(), W, "'", path, "': dflash.draft_vocab with a DSpark Markov head is not supported");
    const int64_t R = markov_w1->ne[0], E = hp_.n_embd;
    DFN_REQUIRE(ggml_n_dims(markov_w1) == 2 && markov_w1->ne[1] == target.n_vocab && R <= k_max_dim, W, "'", path,
                "': markov_w1.weight must be [rank <= ", k_max_dim, ", ", target.n_vocab, "]");
    hp_.markov_rank = R;
    markov_w2 = F.tensor("markov_w2.weight", {R, target.n_vocab}, TENSOR_ROLE_MATMUL);
    markov_w2_s = F.tensor("markov_w2.scale", {1}, TENSOR_ROLE_F32, false);
    conf_proj = F.tensor("conf_proj.weight", {E + R, 1}, TENSOR_ROLE_MATMUL, false);
    conf_proj_b = F.tensor("conf_proj.bias", {1}, TENSOR_ROLE_F32, false);
    hp_.has_confidence = conf_proj != nullptr;
    DFN_REQUIRE(!conf_key || says_conf == hp_.has_confidence, W, "'", path, "': dflash.has_confidence_head is ",
                says_conf ? "true" : "false", " but conf_proj.weight is ", hp_.has_confidence ? "there" : "absent");
    DFN_REQUIRE(conf_proj || !conf_proj_b, W, "'", path, "': conf_proj.bias without conf_proj.weight");
    // B - 1 drafts from block_size rows at most (llama.cpp leaves the Markov head out past them)
    DFN_REQUIRE(!hp_.sample_from_anchor || hp_.block_size >= 2, W, "'", path, "': block_size too small");
}

// DFlash 2: the keys and tensors llama.cpp's dflash loader reads when the file has
// selector_hidden.weight, checked as it checks them (src/models/dflash.cpp, load_arch_tensors).
void drafter_model::load_dflash2(gguf_file & F, const std::string & path, const target_hparams & target) {
    auto key = [](const char * s) { return std::string("dflash.") + s; };
    const bool has = F.has_tensor("selector_hidden.weight");
    for (const char * k : {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}) {
        DFN_REQUIRE(has || !F.has_key(key(k)), W, "'", path, "': dflash.", k,
                    " without the selector tensors (selector_hidden.weight)");
    }
    if (!has) return;
    hp_.conv_kernel = F.get_u32(key("conv_kernel_size"), 0);
    hp_.conv_group = F.get_u32(key("conv_group_size"), 0);
    hp_.selector_rank = F.get_u32(key("selector_rank"), 0);
    hp_.selector_top_k = F.get_u32(key("selector_top_k"), 0);
    const int64_t E = hp_.n_embd, K = hp_.conv_kernel, k = hp_.selector_top_k, R = hp_.selector_rank;
    DFN_REQUIRE(K > 0 && hp_.conv_group > 0 && R > 0 && k > 0, W, "'", path,
                "': a DFlash 2 drafter (selector_hidden.weight) needs dflash.conv_kernel_size, conv_group_size, selector_rank and "
                "selector_top_k > 0");
    DFN_REQUIRE(E % hp_.conv_group == 0, W, "'", path, "': hidden size ", E, " is not a multiple of dflash.conv_group_size ",
                hp_.conv_group);
    DFN_REQUIRE(E >= k * (k + 1), W, "'", path, "': hidden size ", E, " < selector_top_k * (selector_top_k + 1) = ",
                k * (k + 1), " (llama.cpp packs the selector's lattice into hidden-size rows)");
    DFN_REQUIRE(k <= target.n_vocab && K <= k_max_gguf_block_size, W, "'", path, "': selector_top_k ", k,
                " or conv_kernel_size ", K, " out of range");
    DFN_REQUIRE(hp_.draft_vocab.empty(), W, "'", path, "': dflash.draft_vocab with a DFlash 2 selector is not supported");
    selector_prev = F.tensor("selector_predecessor.weight", {R, target.n_vocab}, TENSOR_ROLE_EMBEDDING);
    selector_next = F.tensor("selector_successor.weight", {R, target.n_vocab}, TENSOR_ROLE_EMBEDDING);
    selector_hidden = F.tensor("selector_hidden.weight", {E, R}, TENSOR_ROLE_MATMUL);
    const int64_t projected = 2 * K * (E / hp_.conv_group);
    conv_.resize(hp_.n_layer);
    for (int il = 0; il < hp_.n_layer; ++il) {
        const std::string p = cat("blk.", il, ".");
        conv_[il].attn_base = F.tensor(p + "attn_conv_base", {E, K, 2}, TENSOR_ROLE_F32);
        conv_[il].attn_proj = F.tensor(p + "attn_conv_proj.weight", {E, projected}, TENSOR_ROLE_MATMUL);
        conv_[il].ffn_base = F.tensor(p + "ffn_conv_base", {E, K, 2}, TENSOR_ROLE_F32);
        conv_[il].ffn_proj = F.tensor(p + "ffn_conv_proj.weight", {E, projected}, TENSOR_ROLE_MATMUL);
    }
}

int64_t drafter_block_size(const gguf_file & F) {
    DFN_REQUIRE(F.arch() == "dflash", W, "'", F.path(), "' is a '", F.arch(), "' model, not a DFlash drafter (arch 'dflash')");
    const int64_t b = F.get_u32("dflash.block_size", 16);
    DFN_REQUIRE(b >= 2 && b <= k_max_gguf_block_size, W, "'", F.path(), "': block_size ", b, " must be in [2, ",
                k_max_gguf_block_size, "]");
    return b;
}

void drafter_model::gather_draft_head(const ggml_tensor * lm_head, ggml_backend_buffer_type_t buft) {
    if (hp_.draft_vocab.empty() || draft_head) return;
    const int64_t n = (int64_t) hp_.draft_vocab.size();
    head_ctx_.reset(init_meta_ctx(1, W));
    ggml_tensor * head = ggml_new_tensor_2d(head_ctx_.get(), lm_head->type, lm_head->ne[0], n);  // [n_embd, n_draft_vocab]
    ggml_set_name(head, "draft_head.weight");
    head_buf_.reset(alloc_ctx_tensors(head_ctx_.get(), buft, W, "the draft vocabulary's lm_head"));
    draft_head = head;
    std::vector<uint8_t> row(lm_head->nb[1]);
    for (int64_t i = 0; i < n; ++i) {
        ggml_backend_tensor_get(lm_head, row.data(), (size_t) hp_.draft_vocab[i] * lm_head->nb[1], row.size());
        ggml_backend_tensor_set(draft_head, row.data(), (size_t) i * draft_head->nb[1], row.size());
    }
}

ggml_tensor * drafter_model::scale_logits(const build_context & b, ggml_tensor * logits) const {
    ggml_context * ctx = b.ctx;
    if (hp_.logit_scale != 0.0f && hp_.logit_scale != 1.0f) logits = ggml_scale(ctx, logits, hp_.logit_scale);
    if (hp_.final_logit_softcapping > 0.0f) {
        const float c = hp_.final_logit_softcapping;
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / c)), c);
    }
    return logits;
}

ggml_tensor * drafter_model::norm(const build_context & b, ggml_tensor * x, ggml_tensor * w) const {
    return rms_norm(b, x, w, hp_.rms_eps);
}

ggml_tensor * drafter_model::rope(const build_context & b, ggml_tensor * x, ggml_tensor * pos) const {
    return rope_neox(b, x, pos, hp_.n_rot, hp_);
}

void drafter_model::build_encode(const build_context & b, ggml_tensor * feats, ggml_tensor * pos, feature_ring & ring,
                                 int64_t slot0) const {
    ggml_context * ctx = b.ctx;
    const int64_t m = feats->ne[1], hd = hp_.head_dim, n_kv = hp_.n_head_kv;
    ggml_tensor * h = norm(b, matmul(b, fc, feats), enc_norm);  // [n_embd, m]
    for (int il = 0; il < hp_.n_layer; ++il) {
        const layer_weights & L = layers_[il];
        ggml_tensor * K = ggml_reshape_3d(ctx, matmul(b, L.wk, h), hd, n_kv, m);  // [hd, n_kv, m]
        ggml_tensor * V = ggml_reshape_3d(ctx, matmul(b, L.wv, h), hd, n_kv, m);
        K = rope(b, norm(b, K, L.k_norm), pos);
        write_kv_rows(b, ring.k[il], K, slot0);
        write_kv_rows(b, ring.v[il], V, slot0);
    }
}

// Columns r0 .. R-1 of each of the n_blk blocks of R columns of t [n, n_blk R] (contiguous), in
// block order: [n, n_blk (R - r0)] (for n_blk 1, a view). A 1-D t [n_blk R] (positions): its
// elements alike (r0 > 0 means R >= 2, so a 2-D t is never taken for 1-D).
static ggml_tensor * block_rows_from(ggml_context * ctx, ggml_tensor * t, int64_t n_blk, int64_t R, int64_t r0) {
    if (!r0) return t;
    const bool is_1d = ggml_n_dims(t) == 1;
    const int64_t n = is_1d ? 1 : t->ne[0];
    const size_t col = is_1d ? ggml_element_size(t) : t->nb[1];
    if (n_blk == 1) {
        return is_1d ? ggml_view_1d(ctx, t, R - r0, r0 * col) : ggml_view_2d(ctx, t, n, R - r0, col, r0 * col);
    }
    ggml_tensor * v = ggml_cont(ctx, ggml_view_3d(ctx, t, n, R - r0, n_blk, col, R * col, r0 * col));  // [n, R - r0, n_blk]
    return is_1d ? ggml_reshape_1d(ctx, v, n_blk * (R - r0)) : ggml_reshape_2d(ctx, v, n, n_blk * (R - r0));
}

ggml_tensor * drafter_model::build_conv(const build_context & b, ggml_tensor * x, ggml_tensor * dyn,
                                        ggml_tensor * base, int side, int64_t R) const {
    ggml_context * ctx = b.ctx;
    const int64_t E = x->ne[0], N = x->ne[1], n_blk = N / R, K = hp_.conv_kernel, gs = hp_.conv_group, G = E / gs;
    if (!ggml_is_contiguous(x)) x = ggml_cont(ctx, x);
    if (!ggml_is_contiguous(dyn)) dyn = ggml_cont(ctx, dyn);
    // this side's per-token coefficients [G, K, N] of dyn viewed as [G, K, 2, N], one per channel group
    ggml_tensor * coeff = ggml_view_3d(ctx, dyn, G, K, N, G * sizeof(float), dyn->nb[1], side * K * G * sizeof(float));
    coeff = ggml_repeat_4d(ctx, ggml_reshape_4d(ctx, ggml_cont(ctx, coeff), 1, G, K, N), gs, G, K, N);
    ggml_tensor * base_side = ggml_reshape_4d(ctx, ggml_view_1d(ctx, base, E * K, side * base->nb[2]), gs, G, K, 1);
    ggml_tensor * w = ggml_add(ctx, coeff, base_side);  // [gs, G, K, N]: tap weights per channel and token
    ggml_tensor * out = nullptr;
    for (int64_t tap = 0; tap < std::min(K, R); ++tap) {  // taps >= R read only the zero padding
        ggml_tensor * xs = x;  // x[t - tap] within each block: its rows shifted down, zeros on top
        if (tap > 0 && n_blk == 1) {
            xs = ggml_pad_ext(ctx, ggml_view_2d(ctx, x, E, R - tap, x->nb[1], 0), 0, 0, (int) tap, 0, 0, 0, 0, 0);
        } else if (tap > 0) {
            xs = ggml_view_3d(ctx, x, E, R - tap, n_blk, x->nb[1], R * x->nb[1], 0);  // [E, R - tap, n_blk]
            xs = ggml_reshape_2d(ctx, ggml_pad_ext(ctx, xs, 0, 0, (int) tap, 0, 0, 0, 0, 0), E, N);
        }
        ggml_tensor * wt = ggml_view_4d(ctx, w, gs, G, 1, N, w->nb[1], w->nb[2], w->nb[3], tap * w->nb[2]);
        ggml_tensor * term = ggml_mul(ctx, ggml_reshape_2d(ctx, ggml_cont(ctx, wt), E, N), xs);
        out = out ? ggml_add(ctx, out, term) : term;
    }
    return out;
}

ggml_tensor * drafter_model::build_block(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos,
                                         ggml_tensor * mask, ggml_tensor * mask_swa, const feature_ring & ring,
                                         int64_t n_ctx, ggml_tensor * target_tok_embd) const {
    return build_blocks(b, tokens, pos, {{&ring, n_ctx, mask, mask_swa}}, target_tok_embd);
}

ggml_tensor * drafter_model::build_blocks(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos,
                                          const std::vector<block_ring> & blocks, ggml_tensor * target_tok_embd) const {
    ggml_context * ctx = b.ctx;
    const int64_t n_blk = (int64_t) blocks.size(), R = tokens->ne[0] / n_blk, hd = hp_.head_dim, n_kv = hp_.n_head_kv;
    const float scale = hp_.attn_scale != 0.0f ? hp_.attn_scale : 1.0f / sqrtf((float) hd);
    const bool conv = !conv_.empty();
    const int64_t first = hp_.first_draft_row();  // rows first.. of each block draft
    ggml_tensor * x = ggml_get_rows(ctx, tok_embd ? tok_embd : target_tok_embd, tokens);  // [n_embd, n_blk R]
    if (hp_.embedding_scale != 0.0f) x = ggml_scale(ctx, x, hp_.embedding_scale);
    // block s's columns [c0, c0 + n) of t along its token dimension `dim` (one block: all of t)
    auto cols = [&](ggml_tensor * t, int dim, int64_t c0, int64_t n) { return n_blk == 1 ? t : columns_view(b, t, dim, c0, n); };
    for (int il = 0; il < hp_.n_layer; ++il) {
        const layer_weights & L = layers_[il];
        // In the last layer, row 0 (`last`) of each block only lends its K/V when it drafts
        // nothing: its query, attention output and FFN would feed nothing, so those run on rows
        // 1 .. R-1 (Rq of them). DFlash 2's convolutions mix rows, so there every row runs.
        const int64_t r0 = il + 1 == hp_.n_layer && !conv ? first : 0, Rq = R - r0;
        auto rows = [&](ggml_tensor * t) { return block_rows_from(ctx, t, n_blk, R, r0); };
        ggml_tensor * inp = rows(x);
        ggml_tensor * xn = norm(b, x, L.attn_norm);
        ggml_tensor * dyn_attn = nullptr;
        if (conv) {
            dyn_attn = matmul(b, conv_[il].attn_proj, xn);  // [2 * K * n_groups, n_blk R]
            xn = build_conv(b, xn, dyn_attn, conv_[il].attn_base, 0, R);
        }
        ggml_tensor * Q = ggml_reshape_3d(ctx, matmul(b, L.wq, rows(xn)), hd, hp_.n_head, n_blk * Rq);  // [hd, n_head, n_blk Rq]
        ggml_tensor * K = ggml_reshape_3d(ctx, matmul(b, L.wk, xn), hd, n_kv, n_blk * R);               // [hd, n_kv, n_blk R]
        ggml_tensor * V = ggml_reshape_3d(ctx, matmul(b, L.wv, xn), hd, n_kv, n_blk * R);
        Q = rope(b, norm(b, Q, L.q_norm), rows(pos));
        K = rope(b, norm(b, K, L.k_norm), pos);

        std::vector<ggml_tensor *> out;
        for (int64_t s = 0; s < n_blk; ++s) {
            const block_ring & blk = blocks[s];
            const feature_ring & ring = *blk.ring;
            // [ring slots 0 .. n_ctx-1 ; block]: the block's K/V go to the slots after the context
            // (computed before the attention: ggml runs nodes in order); slot order is irrelevant
            // without a causal mask
            write_kv_rows(b, ring.k[il], cols(K, 2, s * R, R), blk.n_ctx);
            write_kv_rows(b, ring.v[il], cols(V, 2, s * R, R), blk.n_ctx);
            ggml_tensor * m = layer_is_swa(il) ? blk.mask_swa : blk.mask;
            const int64_t n_att = m->ne[0];  // >= n_ctx + R: the mask hides the slots past the block
            ggml_tensor * Ka = kv_rows(b, ring.k[il], 0, n_att);  // [hd, n_kv, n_att]
            ggml_tensor * Va = kv_rows(b, ring.v[il], 0, n_att);
            if (r0) m = ggml_view_2d(ctx, m, m->ne[0], Rq, m->nb[1], r0 * m->nb[1]);
            out.push_back(attention(b, cols(Q, 2, s * Rq, Rq), Ka, Va, m, scale));  // [hd * n_head, Rq]
        }
        ggml_tensor * o = matmul(b, L.wo, join_segments(b, out, 1));  // [n_embd, n_blk Rq]
        if (hp_.attn_value_scale != 0.0f) o = ggml_scale(ctx, o, hp_.attn_value_scale);
        if (conv) o = build_conv(b, o, dyn_attn, conv_[il].attn_base, 1, R);
        x = ggml_add(ctx, o, inp);

        ggml_tensor * fn = norm(b, x, L.ffn_norm);
        if (conv) {
            ggml_tensor * dyn_ffn = matmul(b, conv_[il].ffn_proj, fn);
            fn = build_conv(b, fn, dyn_ffn, conv_[il].ffn_base, 0, R);
            x = ggml_add(ctx, build_conv(b, ffn_swiglu(b, fn, L), dyn_ffn, conv_[il].ffn_base, 1, R), x);
        } else {
            x = ggml_add(ctx, ffn_swiglu(b, fn, L), x);
        }
    }
    x = norm(b, x, output_norm);
    return conv ? block_rows_from(ctx, x, n_blk, R, first) : x;  // the drafting rows
}

ggml_tensor * drafter_model::build_draft_logits(const build_context & b, ggml_tensor * lm_head, ggml_tensor * h,
                                                ggml_tensor * tokens, int64_t n_blk, ggml_tensor ** conf) const {
    ggml_tensor * logits = matmul(b, lm_head, h);  // [n_cols, n_blk (B-1)]
    if (conf) *conf = nullptr;
    if (!hp_.has_markov()) return scale_logits(b, logits);
    const int64_t n = h->ne[1] / n_blk, R = tokens->ne[0] / n_blk;
    auto cols = [&](ggml_tensor * t, int dim, int64_t c0, int64_t m) { return n_blk == 1 ? t : columns_view(b, t, dim, c0, m); };
    std::vector<ggml_tensor *> out, confs;
    for (int64_t s = 0; s < n_blk; ++s) {
        ggml_tensor * c = nullptr;
        out.push_back(build_markov(b, cols(logits, 1, s * n, n), cols(h, 1, s * n, n), cols(tokens, 0, s * R, R), &c));
        if (c) confs.push_back(c);
    }
    if (conf && !confs.empty()) *conf = join_segments(b, confs, 1);
    return scale_logits(b, join_segments(b, out, 1));
}

ggml_tensor * drafter_model::build_markov(const build_context & b, ggml_tensor * logits, ggml_tensor * h,
                                          ggml_tensor * tokens, ggml_tensor ** conf) const {
    ggml_context * ctx = b.ctx;
    const int64_t V = logits->ne[0], n = logits->ne[1];
    ggml_tensor * prev = ggml_view_1d(ctx, tokens, 1, 0);  // I32 [1]: the anchor
    ggml_tensor * out = nullptr;
    *conf = nullptr;
    for (int64_t i = 0; i < n; ++i) {
        ggml_tensor * w1_prev = ggml_get_rows(ctx, markov_w1, prev);  // [R, 1]
        ggml_tensor * bias = matmul(b, markov_w2, w1_prev);           // [V, 1]
        if (markov_w2_s) bias = ggml_mul(ctx, bias, markov_w2_s);
        ggml_tensor * col = ggml_add(ctx, ggml_view_2d(ctx, logits, V, 1, logits->nb[1], i * logits->nb[1]), bias);
        out = out ? ggml_concat(ctx, out, col, 1) : col;
        if (conf_proj) {
            ggml_tensor * hi = ggml_cont(ctx, ggml_view_2d(ctx, h, h->ne[0], 1, h->nb[1], i * h->nb[1]));
            ggml_tensor * c = ggml_mul_mat(ctx, conf_proj, ggml_concat(ctx, hi, w1_prev, 0));  // [1, 1]
            if (conf_proj_b) c = ggml_add(ctx, c, conf_proj_b);
            c = ggml_sigmoid(ctx, c);
            *conf = *conf ? ggml_concat(ctx, *conf, c, 1) : c;
        }
        if (i + 1 < n) prev = ggml_argmax(ctx, col);  // I32 [1]
    }
    return out;
}

ggml_tensor * drafter_model::build_selector(const build_context & b, ggml_tensor * h, ggml_tensor * logits,
                                            ggml_tensor * tokens) const {
    ggml_context * ctx = b.ctx;
    const int64_t n = h->ne[1], k = hp_.selector_top_k, R = hp_.selector_rank;
    ggml_tensor * cand = ggml_top_k(ctx, logits, (int) k);  // I32 [k, n]
    ggml_tensor * unary = ggml_reshape_2d(  // the candidates' logits [k, n]
        ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, logits->ne[0], n), cand), k, n);
    ggml_tensor * gate = matmul(b, selector_hidden, h);  // [R, n]
    // predecessors [k, n]: row 0's is the anchor (k times), row r's row r-1's candidates
    ggml_tensor * pred = ggml_repeat_4d(ctx, ggml_view_1d(ctx, tokens, 1, 0), k, 1, 1, 1);
    if (n > 1) pred = ggml_concat(ctx, pred, ggml_view_2d(ctx, cand, k, n - 1, cand->nb[1], 0), 1);
    ggml_tensor * succ = ggml_reshape_3d(ctx, ggml_get_rows(ctx, selector_next, ggml_reshape_1d(ctx, cand, k * n)), R, k, n);
    ggml_tensor * cond = ggml_reshape_3d(ctx, ggml_get_rows(ctx, selector_prev, ggml_reshape_1d(ctx, ggml_cont(ctx, pred), k * n)),
                                         R, k, n);
    cond = ggml_mul(ctx, cond, ggml_reshape_3d(ctx, gate, R, 1, n));  // [R, k (pred), n]
    ggml_tensor * score = ggml_mul_mat(ctx, succ, cond);              // [k (succ), k (pred), n]
    score = ggml_add(ctx, score, ggml_reshape_3d(ctx, unary, k, 1, n));
    return ggml_concat(ctx, ggml_cast(ctx, cand, GGML_TYPE_F32), ggml_reshape_2d(ctx, score, k * k, n), 0);
}

// softmax of k scores s[] at index i (1 / sum exp(s_j - s_i), llama.cpp's p_min form); throws on a non-finite score
static float softmax_at(const float * s, int64_t k, int64_t i, int64_t pos) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
        if (!std::isfinite(s[j])) throw_non_finite_logits("draft", pos);
        sum += std::exp(s[j] - s[i]);
    }
    return 1.0f / sum;
}

void walk_lattice(const float * lattice, int64_t n, int64_t k, int32_t * tok, float * p, int64_t pos0) {
    const int64_t row = k * (k + 1);
    int64_t pred = 0;
    for (int64_t r = 0; r < n; ++r) {
        const float * c = lattice + r * row;
        const float * s = c + k + pred * k;
        pred = std::max_element(s, s + k) - s;
        const float pr = softmax_at(s, k, pred, pos0 + r);  // also the finiteness check
        if (p) p[r] = pr;
        tok[r] = (int32_t) c[pred];
    }
}

void lattice_probs(const float * lattice, int64_t n, int64_t k, int32_t * cand, float * cond_p, int64_t pos0) {
    const int64_t row = k * (k + 1);
    for (int64_t r = 0; r < n; ++r) {
        const float * c = lattice + r * row;
        for (int64_t j = 0; j < k; ++j) cand[r * k + j] = (int32_t) c[j];
        for (int64_t q = 0; q < k; ++q) {
            const float * s = c + k + q * k;
            for (int64_t j = 0; j < k; ++j) cond_p[(r * k + q) * k + j] = softmax_at(s, k, j, pos0 + r);
        }
    }
}

}  // namespace dfn
