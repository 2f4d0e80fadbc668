#include "spec/batch_engine.h"

#include "base/common.h"
#include "graph/graph.h"
#include "kernels/cpu/matmul/dispatch.h"
#include "kernels/cpu/top1.h"
#include "spec/verify.h"

#include <algorithm>

namespace dfn {

static const char * W = "batch";

struct batch_engine::slot_state {
    enum phase_t { FREE, PREFILL, DECODE, DONE } phase = FREE;
    std::vector<int32_t> prompt, out;
    int64_t fed = 0, max_tokens = 0;
    int32_t last = -1;
    std::unique_ptr<feature_ring> ring;
    // committed positions' target features not in the ring yet: rows [queue_m, n_feature_row] from
    // position queue_pos0 (the next drafter pass writes them, as spec_session's queue)
    std::vector<float> queue;
    int64_t queue_m = 0, queue_pos0 = 0;
    std::vector<round_record> rounds;
};

batch_engine::batch_engine(target_session & target, const std::string & drafter_path, const batch_engine_params & p)
    : target_(target), params_(p) {
    graph_runner & runner = target.runner();
    DFN_REQUIRE(!runner.on_device(), "engine", "the batch engine runs on the CPU");
    drafter_ = std::make_unique<drafter_model>(drafter_path, target.hparams());
    const drafter_hparams & dh = drafter_->hparams();
    B_ = p.block_size > 0 ? p.block_size : dh.block_size;
    DFN_REQUIRE(p.block_size >= 0 && B_ >= 2 && B_ <= k_max_block_size, "engine", "block_size must be in [2, ",
                k_max_block_size, "], got ", B_);
    DFN_REQUIRE(target.params().max_verify >= B_ || target.hparams().is_gdn.empty(), "engine",
                "target created with max_verify ", target.params().max_verify, " < block_size ", B_);
    DFN_REQUIRE(p.prefill_chunk >= 1, "engine", "prefill_chunk must be >= 1, got ", p.prefill_chunk);
    params_.max_step_tokens = std::min(p.max_step_tokens, target.params().n_batch);
    DFN_REQUIRE(params_.max_step_tokens >= B_, "engine", "max_step_tokens ", params_.max_step_tokens,
                " (at most n_batch) must hold one block of ", B_);
    drafter_->load_weights(runner.last_buffer_type(), target.params().use_mmap);
    drafter_->gather_draft_head(drafter_->output ? drafter_->output : target.model().output, runner.last_buffer_type());
    tune_matmul(runner, drafter_->weight_tensors());
    for (int i = 0; i < target.n_seq(); ++i) {
        slots_.push_back(std::make_unique<slot_state>());
        slots_.back()->ring = std::make_unique<feature_ring>(dh, target.params().n_ctx, B_, runner.last_buffer_type());
    }
}

batch_engine::~batch_engine() = default;

batch_engine::slot_state & batch_engine::at(int slot) {
    DFN_REQUIRE(slot >= 0 && slot < n_slots(), W, "slot ", slot, " outside [0, ", n_slots(), ")");
    return *slots_[slot];
}

const batch_engine::slot_state & batch_engine::at(int slot) const { return const_cast<batch_engine *>(this)->at(slot); }

int batch_engine::start(const std::vector<int32_t> & prompt, int64_t max_tokens) {
    const target_hparams & hp = target_.hparams();
    DFN_REQUIRE(!prompt.empty(), W, "empty prompt");
    DFN_REQUIRE(max_tokens >= 1, W, "max_tokens must be >= 1, got ", max_tokens);
    DFN_REQUIRE((int64_t) prompt.size() < target_.params().n_ctx, W, "a prompt of ", prompt.size(),
                " tokens leaves no room in n_ctx = ", target_.params().n_ctx);
    for (size_t i = 0; i < prompt.size(); ++i) {
        DFN_REQUIRE(prompt[i] >= 0 && prompt[i] < hp.n_vocab, W, "token id ", prompt[i], " at index ", i,
                    " is outside the vocabulary [0, ", hp.n_vocab, ")");
    }
    for (int i = 0; i < n_slots(); ++i) {
        slot_state & s = *slots_[i];
        if (s.phase != slot_state::FREE) continue;
        target_.reset_slot(i);
        s.ring->clear();
        s.prompt = prompt;
        s.out.clear();
        s.rounds.clear();
        s.fed = 0;
        s.max_tokens = max_tokens;
        s.queue_m = 0;
        s.phase = slot_state::PREFILL;
        return i;
    }
    throw input_error(cat("[", W, "] all ", n_slots(), " slots are busy"));
}

bool batch_engine::finished(int slot) const { return at(slot).phase == slot_state::DONE; }
const std::vector<int32_t> & batch_engine::output(int slot) const { return at(slot).out; }
const std::vector<batch_engine::round_record> & batch_engine::rounds(int slot) const { return at(slot).rounds; }

void batch_engine::release(int slot) {
    slot_state & s = at(slot);
    s.phase = slot_state::FREE;
    s.queue_m = 0;
    target_.reset_slot(slot);
}

void batch_engine::finish_if_done(slot_state & s) {
    if ((int64_t) s.out.size() < s.max_tokens) return;
    s.out.resize(s.max_tokens);
    s.phase = slot_state::DONE;
}

std::vector<int32_t> batch_engine::draft(const std::vector<int> & slots) {
    const drafter_hparams & dh = drafter_->hparams();
    // R block rows per slot ([last, MASK...]: drafter.h, block_rows), B-1 drafts each
    const int64_t n = (int64_t) slots.size(), B = B_, R = dh.block_rows(B), row = dh.n_feature_row(),
                  w = dh.sliding_window, k_sel = dh.selector_top_k;
    const bool sub = drafter_->draft_head != nullptr;  // over the draft vocabulary's rows
    struct block_in {
        slot_state * s;
        int64_t n_past, n_ctx, n_att, lo, n_pushed_before;
        ggml_tensor * f_in = nullptr, * p_in = nullptr;
        drafter_model::block_ring blk;
    };
    std::vector<block_in> in(n);
    std::string key = cat("draft:batch:", n, ":", B, w > 0 ? ":swa" : "", sub ? ":dv" : "");
    for (int64_t k = 0; k < n; ++k) {
        block_in & x = in[k];
        x.s = slots_[slots[k]].get();
        feature_ring & ring = *x.s->ring;
        x.n_past = target_.slot_n_past(slots[k]);
        x.n_pushed_before = ring.n_pushed;
        const int64_t n_pushed = x.s->queue_m > 0 ? x.s->queue_pos0 + x.s->queue_m : ring.n_pushed;
        DFN_REQUIRE(n_pushed == x.n_past, "draft", "feature ring of slot ", slots[k], " holds ", n_pushed,
                    " positions but the target has ", x.n_past);
        ring.n_pushed = n_pushed;  // the queued rows are written by this graph, ahead of the block
        x.n_ctx = ring.n_valid();
        x.n_att = std::min(ring.capacity + ring.scratch, kv_padded(x.n_ctx + R));
        x.lo = dh.trained_context > 0 ? x.n_past - dh.trained_context : 0;  // spec.h: the default window
        key += cat(":push", x.s->queue_m);
    }
    ggml_tensor * tok = nullptr, * pos = nullptr, * out = nullptr;
    auto build = [&](const build_context & b) {
        ggml_context * ctx = b.ctx;
        std::vector<drafter_model::block_ring> blocks;
        for (block_in & x : in) {
            if (x.s->queue_m > 0) {
                x.f_in = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, row, x.s->queue_m);
                x.p_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, x.s->queue_m);
                ggml_set_input(x.f_in);
                ggml_set_input(x.p_in);
                drafter_->build_encode(b, x.f_in, x.p_in, *x.s->ring, x.s->queue_pos0);  // the ring never wraps
            }
            x.blk = {x.s->ring.get(), x.n_ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, x.n_att, R), nullptr};
            ggml_set_input(x.blk.mask);
            if (w > 0) {
                x.blk.mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, x.n_att, R);
                ggml_set_input(x.blk.mask_swa);
            }
            blocks.push_back(x.blk);
        }
        tok = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n * R);
        pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n * R);
        ggml_set_input(tok);
        ggml_set_input(pos);
        ggml_tensor * h = drafter_->build_blocks(b, tok, pos, blocks, target_.model().tok_embd);  // [n_embd, n (B-1)]
        ggml_tensor * head = sub ? drafter_->draft_head : drafter_->output ? drafter_->output : target_.model().output;
        ggml_tensor * logits = drafter_->build_draft_logits(b, head, h, tok, n, nullptr);  // [n_cols, n (B-1)]
        if (dh.has_selector()) {  // DFlash 2: each block's lattice, walked in read()
            std::vector<ggml_tensor *> lat;
            for (int64_t k = 0; k < n; ++k) {
                lat.push_back(drafter_->build_selector(b, columns_view(b, h, 1, k * (B - 1), B - 1),
                                                       columns_view(b, logits, 1, k * (B - 1), B - 1),
                                                       columns_view(b, tok, 0, k * R, R)));
            }
            out = join_segments(b, lat, 1);  // F32 [lattice_row, n (B-1)]
        } else {
            out = argmax_op(ctx, logits);  // I32 [n (B-1)]
        }
        ggml_set_output(out);
        ggml_build_forward_expand(b.gf, out);
    };
    auto set_inputs = [&] {
        std::vector<int32_t> t(n * R, (int32_t) dh.mask_token_id), p(n * R);
        std::vector<ggml_fp16_t> m;
        for (int64_t k = 0; k < n; ++k) {
            const block_in & x = in[k];
            if (x.f_in) {
                ggml_backend_tensor_set(x.f_in, x.s->queue.data(), 0, (size_t) row * x.s->queue_m * sizeof(float));
                std::vector<int32_t> pp(x.s->queue_m);
                for (int64_t j = 0; j < x.s->queue_m; ++j) pp[j] = (int32_t) (x.s->queue_pos0 + j);
                ggml_backend_tensor_set(x.p_in, pp.data(), 0, pp.size() * sizeof(int32_t));
            }
            t[k * R] = x.s->last;
            for (int64_t i = 0; i < R; ++i) p[k * R + i] = (int32_t) (x.n_past + i);
            for (int swa = 0; swa < (w > 0 ? 2 : 1); ++swa) {
                fill_block_mask(*x.s->ring, x.n_past, x.n_ctx, x.n_att, R, x.lo, swa ? w : 0, dh.causal, m);
                ggml_tensor * dst = swa ? x.blk.mask_swa : x.blk.mask;
                if (dst->buffer) ggml_backend_tensor_set(dst, m.data(), 0, m.size() * sizeof(ggml_fp16_t));
            }
        }
        ggml_backend_tensor_set(tok, t.data(), 0, t.size() * sizeof(int32_t));
        ggml_backend_tensor_set(pos, p.data(), 0, p.size() * sizeof(int32_t));
    };
    std::vector<int32_t> drafts(n * (B - 1));
    auto read = [&] {
        if (dh.has_selector()) {
            std::vector<float> lat((size_t) n * (B - 1) * dh.lattice_row());
            ggml_backend_tensor_get(out, lat.data(), 0, lat.size() * sizeof(float));
            for (int64_t k = 0; k < n; ++k) {
                walk_lattice(lat.data() + (size_t) k * (B - 1) * dh.lattice_row(), B - 1, k_sel,
                             drafts.data() + k * (B - 1), nullptr, in[k].n_past + 1);
            }
            return;
        }
        ggml_backend_tensor_get(out, drafts.data(), 0, drafts.size() * sizeof(int32_t));
        for (int64_t k = 0; k < n; ++k) {
            for (int64_t i = 0; i + 1 < B; ++i) {  // d_{i+1} sits at position n_past + i + 1
                int32_t & d = drafts[k * (B - 1) + i];
                if (d < 0) throw_non_finite_logits("draft", in[k].n_past + i + 1);
                if (sub) d = dh.draft_vocab[d];
            }
        }
    };
    try {
        target_.runner().run(key, build, set_inputs, read);
    } catch (...) {
        for (block_in & x : in) x.s->ring->n_pushed = x.n_pushed_before;  // the queued rows stay queued
        throw;
    }
    for (block_in & x : in) x.s->queue_m = 0;
    return drafts;
}

int batch_engine::step() {
    const drafter_hparams & dh = drafter_->hparams();
    const int64_t budget = params_.max_step_tokens, n_ctx = target_.params().n_ctx, row = dh.n_feature_row();
    int64_t used = 0;
    // the decoding slots first (a block each, while the step has room), then prompt chunks
    std::vector<int> dec;
    for (int i = 0; i < n_slots(); ++i) {
        slot_state & s = *slots_[i];
        if (s.phase != slot_state::DECODE) continue;
        if (target_.slot_n_past(i) + B_ > n_ctx) {
            s.phase = slot_state::DONE;  // the next block would not fit the context
            continue;
        }
        if (used + B_ > budget) continue;
        dec.push_back(i);
        used += B_;
    }
    const std::vector<int32_t> drafts = dec.empty() ? std::vector<int32_t>{} : draft(dec);
    std::vector<batch_item> items;
    for (size_t k = 0; k < dec.size(); ++k) {
        batch_item it;
        it.slot = dec[k];
        it.kind = BATCH_VERIFY;
        it.tokens.push_back(slots_[dec[k]]->last);
        it.tokens.insert(it.tokens.end(), drafts.begin() + k * (B_ - 1), drafts.begin() + (k + 1) * (B_ - 1));
        items.push_back(std::move(it));
    }
    for (int i = 0; i < n_slots(); ++i) {
        slot_state & s = *slots_[i];
        const int64_t left = (int64_t) s.prompt.size() - s.fed;
        const int64_t m = std::min({left, params_.prefill_chunk, budget - used});
        if (s.phase != slot_state::PREFILL || m <= 0) continue;
        batch_item it;
        it.slot = i;
        it.kind = m == left ? BATCH_DECODE : BATCH_PREFILL;  // the last chunk gives the first token
        it.tokens.assign(s.prompt.begin() + s.fed, s.prompt.begin() + s.fed + m);
        items.push_back(std::move(it));
        used += m;
    }
    if (!items.empty()) {
        std::vector<int64_t> n_past0;
        for (const batch_item & it : items) n_past0.push_back(target_.slot_n_past(it.slot));
        std::vector<decode_result> res = target_.decode_batch(items, dh.tap_layers, /*argmax_only=*/true);
        ++n_steps;
        n_step_tokens += used;
        for (size_t i = 0; i < items.size(); ++i) {
            const batch_item & it = items[i];
            slot_state & s = *slots_[it.slot];
            decode_result & r = res[i];
            std::vector<int32_t> committed;
            if (it.kind == BATCH_VERIFY) {
                committed = accept_prefix(it.tokens.data() + 1, B_ - 1, r.argmax.data(), B_);
                target_.commit_slot(it.slot, (int64_t) committed.size());
                s.rounds.push_back({std::vector<int32_t>(it.tokens.begin() + 1, it.tokens.end()), committed});
            } else {
                s.fed += (int64_t) it.tokens.size();
                if (it.kind == BATCH_DECODE) committed = {r.argmax[0]}, s.phase = slot_state::DECODE;
            }
            // the fed positions' features (a verify: `last` and the accepted drafts) for the ring
            const int64_t m = it.kind == BATCH_VERIFY ? (int64_t) committed.size() : (int64_t) it.tokens.size();
            DFN_REQUIRE(s.queue_m == 0 || s.queue_pos0 + s.queue_m == n_past0[i], W, "features queued out of order");
            if (s.queue_m == 0) s.queue_pos0 = n_past0[i], s.queue.clear();
            s.queue.insert(s.queue.end(), r.taps.begin(), r.taps.begin() + m * row);
            s.queue_m += m;
            if (!committed.empty()) {
                s.out.insert(s.out.end(), committed.begin(), committed.end());
                s.last = committed.back();
                finish_if_done(s);
            }
        }
    }
    int active = 0;
    for (const auto & s : slots_) active += s->phase == slot_state::PREFILL || s->phase == slot_state::DECODE;
    return active;
}

}  // namespace dfn
