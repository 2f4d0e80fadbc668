// DFlash drafter (GGUF arch "dflash"): Qwen3-style layers whose attention reads, besides the
// block itself, context K/V made from fused target hidden states: RMSNorm(fc([h_l1; h_l2; ...])).
// The block [last, MASK x (B-1)] attends to context + block without a causal mask.
#include "base/alloc.h"
#include "base/common.h"
#include "kernels/cpu/attn.h"
#include "models/drafter.h"
#include "graph/graph.h"
#include "kernels/cpu/matmul/matmul.h"

#include <cmath>

namespace dfn {

static const char * W = "load_gguf";

// A larger recorded window is no window at all (and a likely corrupt file).
static const int64_t kMaxTrainedContext = int64_t(1) << 20;

drafter_model::drafter_model(const std::string & path, const target_hparams & target) {
    file_ = std::make_unique<gguf_file>(path);
    gguf_file & F = *file_;
    const std::string arch = F.arch();
    DFN_REQUIRE(arch == "dflash", W, "'", path, "' is a '", arch, "' model, not a DFlash drafter (arch 'dflash')");
    auto key = [](const char * s) { return std::string("dflash.") + s; };

    static_cast<block_hparams &>(hp_) = read_block_hparams(F, "dflash", 256);
    hp_.block_size = drafter_block_size(F);
    hp_.causal = F.get_bool(key("attention.causal"), false);
    hp_.sliding_window = F.get_u32(key("attention.sliding_window"), 0);
    hp_.embedding_scale = F.get_f32(key("embedding_scale"), 0.0f);
    hp_.logit_scale = F.get_f32(key("logit_scale"), 0.0f);
    hp_.final_logit_softcapping = F.get_f32(key("final_logit_softcapping"), 0.0f);
    DFN_REQUIRE(hp_.final_logit_softcapping >= 0.0f, W, "'", path, "': dflash.final_logit_softcapping ",
                hp_.final_logit_softcapping, " must be > 0 (or 0: none)");
    if (F.has_key(key("trained_context_length"))) {
        hp_.trained_context = F.get_u32(key("trained_context_length"));  // negatives: out of range
        DFN_REQUIRE(hp_.trained_context >= 1 && hp_.trained_context <= kMaxTrainedContext, W, "'", path,
                    "': dflash.trained_context_length ", hp_.trained_context, " must be in [1, ", kMaxTrainedContext, "]");
    }
    if (hp_.sliding_window > 0) {
        const auto pattern = F.get_int_arr(key("attention.sliding_window_pattern"));
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
    layers_.resize(hp_.n_layer);
    for (int il = 0; il < hp_.n_layer; ++il) {
        load_qwen3_layer(F, il, E, hd, hp_.n_head, hp_.n_head_kv, hp_.n_ff, layers_[il]);
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

ggml_tensor * drafter_model::build_logits(const build_context & b, ggml_tensor * lm_head, ggml_tensor * h) const {
    ggml_context * ctx = b.ctx;
    ggml_tensor * logits = matmul(b, lm_head, h);  // [n_cols, n]
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
    return rope_neox(b, x, pos, hp_.head_dim, hp_);
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

ggml_tensor * drafter_model::build_block(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos,
                                         ggml_tensor * mask, ggml_tensor * mask_swa, const feature_ring & ring,
                                         int64_t n_ctx, ggml_tensor * target_tok_embd) const {
    return build_blocks(b, tokens, pos, nullptr, nullptr, {{&ring, n_ctx, mask, mask_swa}}, target_tok_embd);
}

ggml_tensor * drafter_model::build_blocks(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos,
                                          ggml_tensor * q_rows, ggml_tensor * q_pos, const std::vector<block_ring> & blocks,
                                          ggml_tensor * target_tok_embd) const {
    ggml_context * ctx = b.ctx;
    const int64_t n_blk = (int64_t) blocks.size(), B = tokens->ne[0] / n_blk, hd = hp_.head_dim, n_kv = hp_.n_head_kv;
    const float scale = 1.0f / sqrtf((float) hd);
    ggml_tensor * x = ggml_get_rows(ctx, tok_embd ? tok_embd : target_tok_embd, tokens);  // [n_embd, n_blk B]
    if (hp_.embedding_scale != 0.0f) x = ggml_scale(ctx, x, hp_.embedding_scale);
    // columns [c0, c0 + n) of t along its token dimension `dim`
    auto cols = [&](ggml_tensor * t, int dim, int64_t c0, int64_t n) {
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        ne[dim] = n;
        return ggml_view_4d(ctx, t, ne[0], ne[1], ne[2], ne[3], t->nb[1], t->nb[2], t->nb[3], c0 * t->nb[dim]);
    };
    for (int il = 0; il < hp_.n_layer; ++il) {
        const layer_weights & L = layers_[il];
        // In the last layer, row 0 (`last`) of each block only lends its K/V: its query, attention
        // output and FFN would feed nothing, so those run on rows 1 .. B-1 (Bq of them).
        const int64_t r0 = il + 1 == hp_.n_layer ? 1 : 0, Bq = B - r0;
        auto rows = [&](ggml_tensor * t) {  // rows r0.. of each block of a 2-D [n, n_blk B] tensor
            if (!r0) return t;
            if (n_blk == 1) return ggml_view_2d(ctx, t, t->ne[0], Bq, t->nb[1], r0 * t->nb[1]);
            return ggml_get_rows(ctx, t, q_rows);  // a copy of those columns
        };
        ggml_tensor * inp = rows(x);
        ggml_tensor * xn = norm(b, x, L.attn_norm);
        ggml_tensor * Q = ggml_reshape_3d(ctx, matmul(b, L.wq, rows(xn)), hd, hp_.n_head, n_blk * Bq);  // [hd, n_head, n_blk Bq]
        ggml_tensor * K = ggml_reshape_3d(ctx, matmul(b, L.wk, xn), hd, n_kv, n_blk * B);               // [hd, n_kv, n_blk B]
        ggml_tensor * V = ggml_reshape_3d(ctx, matmul(b, L.wv, xn), hd, n_kv, n_blk * B);
        ggml_tensor * q_p = !r0 ? pos : n_blk == 1 ? ggml_view_1d(ctx, pos, Bq, r0 * ggml_element_size(pos)) : q_pos;
        Q = rope(b, norm(b, Q, L.q_norm), q_p);
        K = rope(b, norm(b, K, L.k_norm), pos);

        std::vector<ggml_tensor *> out;
        for (int64_t s = 0; s < n_blk; ++s) {
            const block_ring & blk = blocks[s];
            const feature_ring & ring = *blk.ring;
            // [ring slots 0 .. n_ctx-1 ; block]: the block's K/V go to the slots after the context
            // (computed before the attention: ggml runs nodes in order); slot order is irrelevant
            // without a causal mask
            write_kv_rows(b, ring.k[il], n_blk == 1 ? K : cols(K, 2, s * B, B), blk.n_ctx);
            write_kv_rows(b, ring.v[il], n_blk == 1 ? V : cols(V, 2, s * B, B), blk.n_ctx);
            ggml_tensor * m = layer_is_swa(il) ? blk.mask_swa : blk.mask;
            const int64_t n_att = m->ne[0];  // >= n_ctx + B: the mask hides the slots past the block
            ggml_tensor * Ka = kv_rows(b, ring.k[il], 0, n_att);  // [hd, n_kv, n_att]
            ggml_tensor * Va = kv_rows(b, ring.v[il], 0, n_att);
            if (r0) m = ggml_view_2d(ctx, m, m->ne[0], Bq, m->nb[1], r0 * m->nb[1]);
            out.push_back(attention(b, n_blk == 1 ? Q : cols(Q, 2, s * Bq, Bq), Ka, Va, m, scale));  // [hd * n_head, Bq]
        }
        ggml_tensor * a = join_segments(b, out, 1);
        x = ggml_add(ctx, matmul(b, L.wo, a), inp);

        x = ggml_add(ctx, ffn_swiglu(b, norm(b, x, L.ffn_norm), L), x);
    }
    return norm(b, x, output_norm);
}

}  // namespace dfn
