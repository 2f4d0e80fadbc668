// DFlash drafter (GGUF arch "dflash"): Qwen3-style layers whose attention reads, besides the
// block itself, context K/V made from fused target hidden states: RMSNorm(fc([h_l1; h_l2; ...])).
// The block [last, MASK x (B-1)] attends to context + block without a causal mask.
#include "../alloc.h"
#include "../common.h"
#include "../attn.h"
#include "../matmul.h"
#include "../drafter.h"

#include <cmath>

namespace dfn {

static const char * W = "load_gguf";

drafter_model::drafter_model(const std::string & path, const target_hparams & target) {
    file_ = std::make_unique<gguf_file>(path);
    const gguf_file & F = *file_;
    const std::string arch = F.arch();
    DFN_REQUIRE(arch == "dflash", W, "'", path, "' is a '", arch, "' model, not a DFlash drafter (arch 'dflash')");
    auto key = [](const char * s) { return std::string("dflash.") + s; };

    hp_.n_layer = F.get_u32(key("block_count"));
    hp_.n_embd = F.get_u32(key("embedding_length"));
    hp_.n_ff = F.get_u32(key("feed_forward_length"));
    hp_.n_head = F.get_u32(key("attention.head_count"));
    hp_.n_head_kv = F.get_u32(key("attention.head_count_kv"), (uint32_t) hp_.n_head);
    hp_.head_dim = F.get_u32(key("attention.key_length"), hp_.n_head ? (uint32_t) (hp_.n_embd / hp_.n_head) : 0);
    hp_.rms_eps = F.get_f32(key("attention.layer_norm_rms_epsilon"), 1e-6f);
    hp_.rope_base = F.get_f32(key("rope.freq_base"), 10000.0f);
    hp_.n_ctx_train = F.get_u32(key("context_length"), 4096);
    hp_.block_size = F.get_u32(key("block_size"), 16);
    hp_.causal = F.get_bool(key("attention.causal"), false);
    hp_.sliding_window = F.get_u32(key("attention.sliding_window"), 0);
    hp_.embedding_scale = F.get_f32(key("embedding_scale"), 0.0f);
    if (hp_.sliding_window > 0) {
        const auto pattern = F.get_int_arr(key("attention.sliding_window_pattern"));
        hp_.is_swa.assign(F.get_u32(key("block_count")), pattern.empty());  // no pattern: every layer slides
        for (size_t i = 0; i < pattern.size() && i < hp_.is_swa.size(); ++i) hp_.is_swa[i] = pattern[i] != 0;
    }
    DFN_REQUIRE(F.has_key("tokenizer.ggml.mask_token_id"), W, "'", path, "': missing key 'tokenizer.ggml.mask_token_id'");
    hp_.mask_token_id = F.get_u32("tokenizer.ggml.mask_token_id");

    DFN_REQUIRE(hp_.n_layer >= 1 && hp_.n_layer <= 256, W, "'", path, "': bad block_count ", hp_.n_layer);
    DFN_REQUIRE(hp_.n_embd == target.n_embd, W, "drafter hidden size ", hp_.n_embd, " != target hidden size ", target.n_embd);
    DFN_REQUIRE(hp_.n_head > 0 && hp_.n_head_kv > 0 && hp_.n_head % hp_.n_head_kv == 0, W, "'", path,
                "': head_count ", hp_.n_head, " must be a positive multiple of head_count_kv ", hp_.n_head_kv);
    DFN_REQUIRE(hp_.head_dim > 0 && hp_.head_dim % 2 == 0, W, "'", path, "': key_length must be even and > 0");
    DFN_REQUIRE(hp_.block_size >= 2, W, "'", path, "': block_size ", hp_.block_size, " must be >= 2");
    DFN_REQUIRE(hp_.mask_token_id < target.n_vocab, W, "drafter mask token id ", hp_.mask_token_id,
                " is outside the target vocabulary [0, ", target.n_vocab, ")");

    for (int64_t id : F.get_int_arr(key("draft_vocab"))) {
        DFN_REQUIRE(id >= 0 && id < target.n_vocab, W, "'", path, "': draft_vocab id ", id,
                    " is outside the target vocabulary [0, ", target.n_vocab, ")");
        DFN_REQUIRE(hp_.draft_vocab.empty() || id > hp_.draft_vocab.back(), W, "'", path,
                    "': draft_vocab must be strictly ascending (", id, " after ", hp_.draft_vocab.back(), ")");
        hp_.draft_vocab.push_back((int32_t) id);
    }

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

    const int64_t E = hp_.n_embd, hd = hp_.head_dim, n_taps = (int64_t) hp_.tap_layers.size();
    fc = F.tensor("fc.weight", {n_taps * E, E});
    enc_norm = F.tensor("enc.output_norm.weight", {E});
    output_norm = F.tensor("output_norm.weight", {E});
    if (F.has_tensor("token_embd.weight")) tok_embd = F.tensor("token_embd.weight", {E, target.n_vocab});
    if (F.has_tensor("output.weight")) output = F.tensor("output.weight", {E, target.n_vocab});
    layers_.resize(hp_.n_layer);
    for (int il = 0; il < hp_.n_layer; ++il) {
        load_qwen3_layer(F, il, E, hd, hp_.n_head, hp_.n_head_kv, hp_.n_ff, layers_[il]);
    }
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

ggml_tensor * drafter_model::norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w) const {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, hp_.rms_eps), w);
}

ggml_tensor * drafter_model::rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos) const {
    return ggml_rope_ext(ctx, x, pos, nullptr, (int) hp_.head_dim, GGML_ROPE_TYPE_NEOX, (int) hp_.n_ctx_train,
                         hp_.rope_base, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
}

void drafter_model::build_encode(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * feats, ggml_tensor * pos,
                                 feature_ring & ring, int64_t slot0) const {
    const int64_t m = feats->ne[1], hd = hp_.head_dim, n_kv = hp_.n_head_kv;
    ggml_tensor * h = norm(ctx, matmul(ctx, fc, feats), enc_norm);  // [n_embd, m]
    for (int il = 0; il < hp_.n_layer; ++il) {
        const layer_weights & L = layers_[il];
        ggml_tensor * K = ggml_reshape_3d(ctx, matmul(ctx, L.wk, h), hd, n_kv, m);
        ggml_tensor * V = ggml_reshape_3d(ctx, matmul(ctx, L.wv, h), hd, n_kv, m);
        K = rope(ctx, norm(ctx, K, L.k_norm), pos);
        ggml_tensor * kd = ring.k[il], * vd = ring.v[il];
        ggml_build_forward_expand(gf, ggml_cpy(ctx, K, ggml_view_3d(ctx, kd, hd, n_kv, m, kd->nb[1], kd->nb[2], slot0 * kd->nb[2])));
        ggml_build_forward_expand(gf, ggml_cpy(ctx, V, ggml_view_3d(ctx, vd, hd, n_kv, m, vd->nb[1], vd->nb[2], slot0 * vd->nb[2])));
    }
}

ggml_tensor * drafter_model::build_block(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * tokens, ggml_tensor * pos,
                                         ggml_tensor * mask, ggml_tensor * mask_swa, const feature_ring & ring,
                                         int64_t n_ctx, ggml_tensor * target_tok_embd) const {
    const int64_t B = tokens->ne[0], hd = hp_.head_dim, n_kv = hp_.n_head_kv;
    const float scale = 1.0f / sqrtf((float) hd);
    ggml_tensor * x = ggml_get_rows(ctx, tok_embd ? tok_embd : target_tok_embd, tokens);  // [n_embd, B]
    if (hp_.embedding_scale != 0.0f) x = ggml_scale(ctx, x, hp_.embedding_scale);
    for (int il = 0; il < hp_.n_layer; ++il) {
        const layer_weights & L = layers_[il];
        // In the last layer, row 0 (`last`) only lends its K/V: its query, attention output and
        // FFN would feed nothing, so those run on rows 1 .. B-1 (Bq of them).
        const int64_t r0 = il + 1 == hp_.n_layer ? 1 : 0, Bq = B - r0;
        auto rows = [&](ggml_tensor * t) {  // rows r0.. of a 2-D [n, B] tensor
            return r0 ? ggml_view_2d(ctx, t, t->ne[0], Bq, t->nb[1], r0 * t->nb[1]) : t;
        };
        ggml_tensor * inp = rows(x);
        ggml_tensor * xn = norm(ctx, x, L.attn_norm);
        ggml_tensor * Q = ggml_reshape_3d(ctx, matmul(ctx, L.wq, rows(xn)), hd, hp_.n_head, Bq);
        ggml_tensor * K = ggml_reshape_3d(ctx, matmul(ctx, L.wk, xn), hd, n_kv, B);
        ggml_tensor * V = ggml_reshape_3d(ctx, matmul(ctx, L.wv, xn), hd, n_kv, B);
        Q = rope(ctx, norm(ctx, Q, L.q_norm), r0 ? ggml_view_1d(ctx, pos, Bq, r0 * ggml_element_size(pos)) : pos);
        K = rope(ctx, norm(ctx, K, L.k_norm), pos);

        // [ring slots 0 .. n_ctx-1 ; block]: the block's K/V go to the slots after the context
        // (computed before the attention: ggml runs nodes in order); slot order is irrelevant
        // without a causal mask
        ggml_tensor * rk = ring.k[il], * rv = ring.v[il];
        ggml_build_forward_expand(gf, ggml_cpy(ctx, K, ggml_view_3d(ctx, rk, hd, n_kv, B, rk->nb[1], rk->nb[2], n_ctx * rk->nb[2])));
        ggml_build_forward_expand(gf, ggml_cpy(ctx, V, ggml_view_3d(ctx, rv, hd, n_kv, B, rv->nb[1], rv->nb[2], n_ctx * rv->nb[2])));
        const int64_t n_att = mask->ne[0];  // >= n_ctx + B: the mask hides the slots past the block
        ggml_tensor * Ka = ggml_view_3d(ctx, rk, hd, n_kv, n_att, rk->nb[1], rk->nb[2], 0);  // [hd, n_kv, n_att]
        ggml_tensor * Va = ggml_view_3d(ctx, rv, hd, n_kv, n_att, rv->nb[1], rv->nb[2], 0);
        ggml_tensor * a = attention(ctx, Q, Ka, Va, rows(layer_is_swa(il) ? mask_swa : mask), scale);  // [hd * n_head, Bq]
        x = ggml_add(ctx, matmul(ctx, L.wo, a), inp);

        ggml_tensor * f = norm(ctx, x, L.ffn_norm);
        f = matmul(ctx, L.ffn_down, ggml_swiglu_split(ctx, matmul(ctx, L.ffn_gate, f), matmul(ctx, L.ffn_up, f)));
        x = ggml_add(ctx, f, x);
    }
    return norm(ctx, x, output_norm);
}

}  // namespace dfn
