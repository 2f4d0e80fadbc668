// The DFlash drafter (GGUF arch "dflash") and its feature ring.
#pragma once

#include "graph/build_context.h"
#include "gguf/gguf_file.h"
#include "models/model.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <memory>
#include <string>
#include <vector>

namespace dfn {

struct drafter_hparams : block_hparams {
    int64_t block_size = 16;
    int64_t mask_token_id = -1;
    bool causal = false;
    int64_t sliding_window = 0;     // 0: attend to the whole ring
    std::vector<bool> is_swa;       // per layer: uses the sliding window (when sliding_window > 0)
    // GGUF dflash.trained_context_length (optional): the most committed positions before its block
    // the drafter attended to in training. The runtime's default drafter window (spec.h); 0: none
    // recorded (attend to the whole ring). Unlike sliding_window it is anchored at the block: every
    // block row sees the same last N positions, as the ring window does.
    int64_t trained_context = 0;
    float embedding_scale = 0.0f;   // 0: none
    // The draft head's logits, as llama.cpp's DFlash graph and z-lab's drafter apply them:
    // logits * logit_scale (HF output_multiplier; 0: none), then c * tanh(logits / c) with
    // c = final_logit_softcapping (0: none). Neither moves an argmax; both shape the drafter's
    // probabilities (draft_cutoff, the controller, sampled drafts, tree ranking).
    float logit_scale = 0.0f;
    float final_logit_softcapping = 0.0f;
    std::vector<int> tap_layers;    // target layers whose OUTPUT is fused (= GGUF target_layers - 1)
    // GGUF dflash.draft_vocab (optional): the token ids, ascending, the drafter may propose. Drafts
    // are argmaxes over these rows of the lm_head only (EAGLE-3's reduced draft vocabulary): a
    // target that writes a token outside them just rejects that draft; empty = the whole vocabulary.
    std::vector<int32_t> draft_vocab;

    // Floats of fused target features per position (fc's input, a ring push's row): n_taps * n_embd.
    int64_t n_feature_row() const { return (int64_t) tap_layers.size() * n_embd; }
};

// Drafter-context K/V per committed position, for every drafter layer. Position p lives in
// slot p % capacity; keys carry their RoPE at p, so wrap-around changes slots, never meaning.
// Positions are pushed in order from 0; after N pushes the ring holds the last min(N, capacity).
// `scratch` more slots follow: a draft writes its block's K/V at [n_valid, n_valid + B), so that
// context and block are one view (slots past n_valid hold no position yet, or are the scratch).
struct feature_ring {
    feature_ring(const drafter_hparams & hp, int64_t capacity, int64_t scratch, ggml_backend_buffer_type_t buft);
    feature_ring(const feature_ring &) = delete;
    feature_ring & operator=(const feature_ring &) = delete;

    void clear();
    size_t bytes() const { return ggml_backend_buffer_get_size(buf_.get()); }
    int64_t n_valid() const { return n_pushed < capacity ? n_pushed : capacity; }
    int64_t slot_position(int64_t slot) const;  // -1 when empty

    int64_t capacity = 0;
    int64_t scratch = 0;
    int64_t n_pushed = 0;
    std::vector<ggml_tensor *> k;  // per layer F32 [head_dim, n_head_kv, capacity + scratch]
    std::vector<ggml_tensor *> v;  // per layer F32 [head_dim, n_head_kv, capacity + scratch]

private:
    ggml_context_ptr ctx_;         // tensor metadata (freed last: declared first)
    ggml_backend_buffer_ptr buf_;  // the tensors' data
};

// A draft block's attention mask over ring slots [0, n_att), [B, n_att] row-major, row i at position
// n_past + i: context slot s (s < n_ctx, holding position k) is visible when k >= lo and, with a
// sliding window w > 0, n_past + i - k < w; block row j (slot n_ctx + j) when j <= i or the drafter
// is not causal, and |i - j| < w; the rest (padding) is hidden.
void fill_block_mask(const feature_ring & ring, int64_t n_past, int64_t n_ctx, int64_t n_att, int64_t B, int64_t lo,
                     int64_t w, bool causal, std::vector<ggml_fp16_t> & m);

// dflash.block_size of a drafter file (16 when absent), range-checked: the engine sizes the
// target's verify batch from it before the drafter itself is loaded.
constexpr int64_t k_max_gguf_block_size = 1024;
int64_t drafter_block_size(const gguf_file & F);

class drafter_model {
public:
    // Opens a drafter and checks it against the target it will draft for.
    drafter_model(const std::string & path, const target_hparams & target);

    void load_weights(ggml_backend_buffer_type_t buft, bool use_mmap) { file_->load_weights(buft, use_mmap); }
    const drafter_hparams & hparams() const { return hp_; }
    // Every weight tensor (the file's, and the draft head once gathered): tune_matmul's candidates.
    std::vector<ggml_tensor *> weight_tensors() const {
        std::vector<ggml_tensor *> out = file_->tensors();
        if (draft_head) out.push_back(draft_head);
        return out;
    }
    size_t weights_bytes() const { return file_->weights_bytes(); }
    size_t weights_mapped() const { return file_->mapped_bytes(); }
    // weights in buffers of their own: converted tensors, unmapped files, the draft head's rows
    size_t weights_copied() const { return file_->copied_bytes() + (draft_head ? ggml_nbytes(draft_head) : 0); }

    // Context K/V of m positions into ring slots [slot0, slot0 + m) (no wrap inside one call).
    // feats: F32 [n_taps * n_embd, m]; pos: I32 [m].
    void build_encode(const build_context & b, ggml_tensor * feats, ggml_tensor * pos, feature_ring & ring,
                      int64_t slot0) const;

    // Block forward: tokens I32 [B] = [last, MASK...] at positions pos I32 [B], attending to the
    // first n_ctx ring slots and (non-causally) to the block, whose K/V go to ring slots
    // [n_ctx, n_ctx + B) (n_ctx = ring.n_valid(), B <= ring.scratch). mask, mask_swa: F16
    // [n_att, B] for full and sliding-window layers, over ring slots [0, n_att), n_att >= n_ctx + B
    // (-inf past the block: padding keeps the graph's sizes, and its plan, for many rounds).
    // Returns the final hidden states after output_norm of rows 1 .. B-1 (those that predict
    // d_1 .. d_{B-1}), F32 [n_embd, B-1].
    ggml_tensor * build_block(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos, ggml_tensor * mask,
                              ggml_tensor * mask_swa, const feature_ring & ring, int64_t n_ctx,
                              ggml_tensor * tok_embd) const;
    // One block of build_blocks: its ring, context slots and masks as build_block takes them.
    struct block_ring {
        const feature_ring * ring = nullptr;
        int64_t n_ctx = 0;
        ggml_tensor * mask = nullptr;      // F16 [n_att, B]
        ggml_tensor * mask_swa = nullptr;  // F16 [n_att, B], when there are sliding-window layers
    };
    // Several sequences' blocks of B tokens in one pass (batch_engine.h): block s is tokens
    // [s B, (s + 1) B) at positions pos (I32 [n B] each), over its own ring. Every weight matmul runs once
    // over all blocks; attention per block over its ring (as build_block). With more than one block,
    // q_rows I32 [n (B-1)] holds the columns of every block's rows 1 .. B-1 and q_pos their positions
    // (the last layer's queries). Returns F32 [n_embd, n (B-1)]: block s's columns are the ones
    // build_block gives for it alone, bit for bit (matmul.h: each column alone).
    ggml_tensor * build_blocks(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos, ggml_tensor * q_rows,
                               ggml_tensor * q_pos, const std::vector<block_ring> & blocks, ggml_tensor * tok_embd) const;
    // The draft head: lm_head [n_embd, n_cols] times h F32 [n_embd, n], then logit_scale and the
    // soft cap. Returns F32 [n_cols, n].
    ggml_tensor * build_logits(const build_context & b, ggml_tensor * lm_head, ggml_tensor * h) const;
    bool layer_is_swa(int il) const { return hp_.sliding_window > 0 && il < (int) hp_.is_swa.size() && hp_.is_swa[il]; }

    ggml_tensor * tok_embd = nullptr;  // own embeddings, if the file has them
    ggml_tensor * output = nullptr;    // own lm_head, if the file has one

    // Copies the draft vocabulary's rows of `lm_head` (the drafter's own or the target's, [n_embd,
    // n_vocab]) into draft_head [n_embd, n_draft_vocab], same type. No-op without a draft vocabulary.
    void gather_draft_head(const ggml_tensor * lm_head, ggml_backend_buffer_type_t buft);
    ggml_tensor * draft_head = nullptr;

private:
    ggml_tensor * norm(const build_context & b, ggml_tensor * x, ggml_tensor * w) const;
    ggml_tensor * rope(const build_context & b, ggml_tensor * x, ggml_tensor * pos) const;

    std::unique_ptr<gguf_file> file_;
    drafter_hparams hp_;
    ggml_tensor * fc = nullptr;        // [n_taps * n_embd, n_embd]
    ggml_tensor * enc_norm = nullptr;  // F32 [n_embd] (HF hidden_norm)
    ggml_tensor * output_norm = nullptr;
    std::vector<layer_weights> layers_;  // Qwen3 blocks (see load_qwen3_layer)
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> head_ctx_{nullptr, ggml_free};
    std::unique_ptr<ggml_backend_buffer, void (*)(ggml_backend_buffer_t)> head_buf_{nullptr, ggml_backend_buffer_free};
};

}  // namespace dfn
