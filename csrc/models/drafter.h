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
    // llama.cpp's dflash.attention.value_scale: the attention output (after attn_output) times it;
    // 0: none.
    float attn_value_scale = 0.0f;
    int64_t n_rot = 0;        // dflash.rope.dimension_count: rotated dims per head (default head_dim)
    float attn_scale = 0.0f;  // dflash.attention.scale: the softmax's q.k scale; 0: 1/sqrt(head_dim)

    // DFlash 2 (GGUF dflash.conv_kernel_size, conv_group_size, selector_rank, selector_top_k; all
    // 0 for DFlash): each layer's normed input and its attention / FFN outputs go through a
    // block-local dynamic convolution (build_conv), and a top-k pairwise path selector picks the
    // drafted block (build_selector).
    int64_t conv_kernel = 0;
    int64_t conv_group = 0;
    int64_t selector_rank = 0;
    int64_t selector_top_k = 0;
    bool has_selector() const { return selector_top_k > 0; }

    // DSpark (markov_w1.weight present): a low-rank Markov head biases each draft row's logits by
    // the draft before it (build_markov), and an optional confidence head gives each draft's
    // acceptance probability. dflash.sample_from_anchor (absent: true) puts the first draft on the
    // anchor row itself: the block is [last, MASK x (B-2)] and every row drafts; false (EAGLE-3
    // style 1+N exports) keeps DFlash's [last, MASK x (B-1)] with rows 1.. drafting.
    int64_t markov_rank = 0;
    bool sample_from_anchor = true;
    bool has_confidence = false;
    bool has_markov() const { return markov_rank > 0; }
    // The block row of the first draft (0: anchor-first DSpark; else 1), and the block's rows for
    // B - 1 drafts.
    int64_t first_draft_row() const { return has_markov() && sample_from_anchor ? 0 : 1; }
    int64_t block_rows(int64_t B) const { return B - 1 + first_draft_row(); }
    // Floats per row of the selector's lattice: k candidate ids, then k x k transition scores.
    int64_t lattice_row() const { return selector_top_k * (selector_top_k + 1); }

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

// The selector's path through a lattice (drafter_model::build_selector's, n rows of
// lattice_row() floats), as llama.cpp's DFlash 2 walks it (common/speculative.cpp): from the
// anchor, each row's candidate with the highest score given the previous row's choice (the first
// on ties). Fills tok [n] and, when given, p [n]: the softmax of those k scores at the choice.
// A non-finite score is an error naming draft position pos0 + r.
void walk_lattice(const float * lattice, int64_t n, int64_t k, int32_t * tok, float * p, int64_t pos0);
// The lattice's candidates cand [n, k] and, per row and predecessor column, the softmax of the k
// scores: cond_p [n, k, k] (tree.h's build_tree_conditional reads both).
void lattice_probs(const float * lattice, int64_t n, int64_t k, int32_t * cand, float * cond_p, int64_t pos0);

// A draft block's attention mask over ring slots [0, n_att), [R, n_att] row-major for its R rows
// (block_rows), row i at position n_past + i: context slot s (s < n_ctx, holding position k) is
// visible when k >= lo and, with a sliding window w > 0, n_past + i - k < w; block row j (slot
// n_ctx + j) when j <= i or the drafter is not causal, and |i - j| < w; the rest (padding) is hidden.
void fill_block_mask(const feature_ring & ring, int64_t n_past, int64_t n_ctx, int64_t n_att, int64_t R, int64_t lo,
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

    // Block forward: tokens I32 [R] = [last, MASK...] at positions pos I32 [R], attending to the
    // first n_ctx ring slots and (non-causally) to the block, whose K/V go to ring slots
    // [n_ctx, n_ctx + R) (n_ctx = ring.n_valid(), R <= ring.scratch). mask, mask_swa: F16
    // [n_att, R] for full and sliding-window layers, over ring slots [0, n_att), n_att >= n_ctx + R
    // (-inf past the block: padding keeps the graph's sizes, and its plan, for many rounds).
    // Returns the final hidden states after output_norm of the rows that draft d_1 .. d_{B-1}
    // (rows first_draft_row() .. R-1; R = block_rows(B)), F32 [n_embd, B-1]. build_blocks' one-block case.
    ggml_tensor * build_block(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos, ggml_tensor * mask,
                              ggml_tensor * mask_swa, const feature_ring & ring, int64_t n_ctx,
                              ggml_tensor * tok_embd) const;
    // One block of build_blocks: its ring, context slots and masks as build_block takes them.
    struct block_ring {
        const feature_ring * ring = nullptr;
        int64_t n_ctx = 0;
        ggml_tensor * mask = nullptr;      // F16 [n_att, R]
        ggml_tensor * mask_swa = nullptr;  // F16 [n_att, R], when there are sliding-window layers
    };
    // Several sequences' blocks of R rows in one pass (build_block is its one-block case): block s is tokens
    // [s R, (s + 1) R) at positions pos (I32 [n R] each), over its own ring. Every weight matmul
    // runs once over all blocks; attention, and DFlash 2's convolutions, per block. Returns F32
    // [n_embd, n (B-1)]: block s's drafting rows are the columns build_block gives for it alone,
    // bit for bit (matmul.h: each column alone).
    ggml_tensor * build_blocks(const build_context & b, ggml_tensor * tokens, ggml_tensor * pos,
                               const std::vector<block_ring> & blocks, ggml_tensor * tok_embd) const;
    // The draft head over n_blk blocks: lm_head [n_embd, n_cols] times h F32 [n_embd, n_blk (B-1)]
    // (build_blocks'), then logit_scale and the soft cap; for DSpark, the Markov head first chains
    // each block's rows (tokens I32 [n_blk R], the blocks) on the raw logits (llama.cpp's argmaxes).
    // Returns F32 [n_cols, n_blk (B-1)]; *conf (when conf is given): DSpark's confidences F32
    // [1, n_blk (B-1)], else nullptr.
    ggml_tensor * build_draft_logits(const build_context & b, ggml_tensor * lm_head, ggml_tensor * h, ggml_tensor * tokens,
                                     int64_t n_blk, ggml_tensor ** conf) const;
    // DSpark's Markov head, as llama.cpp chains it: logits F32 [n_vocab, n] (the draft rows' lm_head
    // output, before logit_scale / soft cap), h F32 [n_embd, n] (their hidden states), tokens the
    // block (tokens[0]: the anchor). Row i gets + markov_w2 (markov_w1[prev_i]) (times
    // markov_w2.scale), prev_0 the anchor and prev_{i+1} the argmax of row i so biased. Returns
    // the biased logits F32 [n_vocab, n]; with a confidence head, *conf = sigmoid(conf_proj .
    // [h_i; markov_w1[prev_i]] + bias), F32 [1, n] (else nullptr).
    ggml_tensor * build_markov(const build_context & b, ggml_tensor * logits, ggml_tensor * h, ggml_tensor * tokens,
                               ggml_tensor ** conf) const;
    // DFlash 2's selector over the block's rows 1..B-1: h F32 [n_embd, B-1] (build_block's),
    // logits F32 [n_vocab, B-1] (build_draft_logits' over the whole vocabulary), tokens I32 [B] (the
    // block: tokens[0] is the anchor, `last`). Returns the lattice, F32 [k + k*k, B-1]: per row r
    // (block position r + 1) its k candidates (the logits' top k, token ids as floats) and, for
    // each predecessor p (row r-1's candidate p; for r = 0 the anchor, every p alike), the k
    // scores logit(c_j) + selector_next[c_j] . (selector_prev[pred_p] * (selector_hidden h_r)),
    // at [k + p * k + j]. walk_lattice() reads it.
    ggml_tensor * build_selector(const build_context & b, ggml_tensor * h, ggml_tensor * logits,
                                 ggml_tensor * tokens) const;
    bool layer_is_swa(int il) const { return hp_.sliding_window > 0 && il < (int) hp_.is_swa.size() && hp_.is_swa[il]; }

    ggml_tensor * tok_embd = nullptr;  // own embeddings, if the file has them
    ggml_tensor * output = nullptr;    // own lm_head, if the file has one

    // Copies the draft vocabulary's rows of `lm_head` (the drafter's own or the target's, [n_embd,
    // n_vocab]) into draft_head [n_embd, n_draft_vocab], same type. No-op without a draft vocabulary.
    void gather_draft_head(const ggml_tensor * lm_head, ggml_backend_buffer_type_t buft);
    ggml_tensor * draft_head = nullptr;

private:
    void load_dflash2(gguf_file & F, const std::string & path, const target_hparams & target);
    void load_dspark(gguf_file & F, const std::string & path, const target_hparams & target);
    void refuse_unimplemented(gguf_file & F, const std::string & path);
    // DFlash 2's block-local dynamic convolution, one side (0: a sublayer's input, 1: its output):
    // out[t] = sum_{tap < K} (base[side, tap, c] + dyn[t, side, tap, c / group]) * x[t - tap, c],
    // x[t < 0] = 0, t counted within each block of R rows. x F32 [n_embd, n R] (n blocks), dyn F32
    // [2 * K * n_groups, n R] (the sublayer's kernel projection of its normed input), base F32
    // [n_embd, K, 2]. Returns F32 [n_embd, n R].
    ggml_tensor * build_conv(const build_context & b, ggml_tensor * x, ggml_tensor * dyn, ggml_tensor * base,
                             int side, int64_t R) const;
    // logit_scale and the soft cap, on logits F32 [n_cols, n].
    ggml_tensor * scale_logits(const build_context & b, ggml_tensor * logits) const;
    ggml_tensor * norm(const build_context & b, ggml_tensor * x, ggml_tensor * w) const;
    ggml_tensor * rope(const build_context & b, ggml_tensor * x, ggml_tensor * pos) const;

    std::unique_ptr<gguf_file> file_;
    drafter_hparams hp_;
    ggml_tensor * fc = nullptr;        // [n_taps * n_embd, n_embd]
    ggml_tensor * enc_norm = nullptr;  // F32 [n_embd] (HF hidden_norm)
    ggml_tensor * output_norm = nullptr;
    std::vector<layer_weights> layers_;  // Qwen3 blocks (see load_qwen3_layer)
    struct conv_weights {                // DFlash 2, per layer
        ggml_tensor * attn_base = nullptr;  // F32 [n_embd, K, 2]
        ggml_tensor * attn_proj = nullptr;  // [n_embd, 2 * K * n_groups]
        ggml_tensor * ffn_base = nullptr;
        ggml_tensor * ffn_proj = nullptr;
    };
    std::vector<conv_weights> conv_;     // empty for DFlash
    ggml_tensor * selector_prev = nullptr;    // [rank, n_vocab] (rows by token id)
    ggml_tensor * selector_next = nullptr;    // [rank, n_vocab]
    ggml_tensor * selector_hidden = nullptr;  // [n_embd, rank]
    ggml_tensor * markov_w1 = nullptr;        // DSpark: [rank, n_vocab] (rows by token id)
    ggml_tensor * markov_w2 = nullptr;        // [rank, n_vocab]
    ggml_tensor * markov_w2_s = nullptr;      // F32 [1], optional
    ggml_tensor * conf_proj = nullptr;        // [n_embd + rank, 1], optional
    ggml_tensor * conf_proj_b = nullptr;      // F32 [1], optional
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> head_ctx_{nullptr, ggml_free};
    std::unique_ptr<ggml_backend_buffer, void (*)(ggml_backend_buffer_t)> head_buf_{nullptr, ggml_backend_buffer_free};
};

}  // namespace dfn
