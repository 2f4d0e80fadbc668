#include "spec/spec.h"

#include "base/alloc.h"

#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/matmul/dispatch.h"

#include "base/common.h"
#include "base/profile.h"
#include "kernels/cpu/top1.h"
#include "spec/verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dfn {

// The drafter's file read and its weights placed beside the target's output head (on a model
// split over devices: on the last device), its draft head gathered and its matmuls tuned.
static std::shared_ptr<drafter_model> load_drafter(target_session & target, const std::string & path) {
    graph_runner & runner = target.runner();
    auto d = std::make_shared<drafter_model>(path, target.hparams());
    d->load_weights(runner.last_buffer_type(), target.params().use_mmap);
    d->gather_draft_head(d->output ? d->output : target.model().output, runner.last_buffer_type());
    tune_matmul(runner, d->weight_tensors());  // the types the target did not measure
    return d;
}

spec_session::spec_session(target_session & target, const std::string & drafter_path, const spec_params & params)
    : spec_session(target, load_drafter(target, drafter_path), params, 0) {}

spec_session::spec_session(target_session & target, std::shared_ptr<drafter_model> drafter, const spec_params & params,
                           int slot)
    : target_(target), runner_(target.runner()), params_(params), drafter_(std::move(drafter)), slot_(slot),
      ctl_(k_max_block_size) {
    DFN_REQUIRE(slot >= 0 && slot < target.n_seq(), "engine", "sequence slot ", slot, " outside [0, ", target.n_seq(), ")");
    const drafter_hparams & dh = drafter_->hparams();
    block_size_ = params.block_size > 0 ? params.block_size : dh.block_size;
    DFN_REQUIRE(params.block_size >= 0, "engine", "block_size must be >= 2 (or 0: the drafter's), got ",
                params.block_size);
    DFN_REQUIRE(block_size_ >= 2 && block_size_ <= k_max_block_size, "engine", "block_size must be in [2, ",
                k_max_block_size, "] (the most tokens one round may verify), got ", block_size_,
                params.block_size > 0 ? "" : " from the drafter's dflash.block_size");
    DFN_REQUIRE(params.ring_capacity >= block_size_, "engine", "feature_ring_capacity ", params.ring_capacity,
                " must be >= block_size ", block_size_);
    DFN_REQUIRE(params.window >= 0, "engine", "drafter_window must be >= 0");
    set_draft_cutoff(params.draft_cutoff);
    DFN_REQUIRE(params.tree_budget == 0 || !runner_.on_device() || target.hparams().is_gdn.empty(), "engine",
                "verify='tree' over a target with GDN layers runs on the CPU only (ggml's GDN and conv ops step along "
                "one sequence, not a tree's branches); on device ", runner_.device_name(), " use verify='chain'");
    if (params.tree_budget != 0) set_tree_budget(params.tree_budget);
    DFN_REQUIRE(target.params().max_verify >= block_size_ || target.hparams().is_gdn.empty(), "engine",
                "target created with max_verify ", target.params().max_verify, " < block_size ", block_size_);
    // The drafter attends to the user's window, else to the context it was trained with (an
    // untouched engine never shows it more than it learned from), else to the whole ring.
    if (params_.window == 0) params_.window = dh.trained_context;
    // Ring positions older than the window are never read: a ring of the window (at least a block)
    // drafts the same and masks fewer slots each round. A smaller ring than that still wins.
    const int64_t capacity = params_.window > 0 ? std::min(params.ring_capacity, std::max(params_.window, block_size_))
                                                : params.ring_capacity;
    ring_ = std::make_unique<feature_ring>(dh, capacity, block_size_, runner_.last_buffer_type());
    if (runner_.on_device()) {
        queue_ctx_.reset(init_meta_ctx(1, "feature queue"));
        dev_queue_ = ggml_new_tensor_2d(queue_ctx_.get(), GGML_TYPE_F32, dh.n_feature_row(),
                                        std::max<int64_t>(64, 2 * block_size_));
        ggml_set_name(dev_queue_, "feature_queue");
        queue_buf_.reset(alloc_ctx_tensors(queue_ctx_.get(), runner_.last_buffer_type(), "feature_ring", "the device feature queue"));
        target.set_slot_tap_queue(slot, {dev_queue_, [this](int64_t n) { return reserve_taps(n); }});
    }
}

spec_session::~spec_session() {
    if (dev_queue_) target_.clear_slot_tap_queue(slot_, dev_queue_);
}

void spec_session::add_memory(memory_usage & m) const {
    m.drafter_weights_mapped = drafter_->weights_mapped();
    m.drafter_weights_copied = drafter_->weights_copied();
    m.feature_ring += ring_->bytes() + (dev_queue_ ? ggml_nbytes(dev_queue_) : 0);
    m.feature_queue += pending_feats_.capacity() * sizeof(float);
    m.compute_drafter = runner_.compute_bytes({"draft:", "encode:"});
}

ggml_tensor * spec_session::lm_head() const { return drafter_->output ? drafter_->output : tgt().model().output; }

void spec_session::set_draft_vocab(bool on) { params_.draft_vocab = on; }

void spec_session::set_draft_cutoff(float c) {
    DFN_REQUIRE(std::isfinite(c) && c >= 0.0f && c <= 1.0f, "engine", "draft_cutoff must be in [0, 1], got ", c);
    params_.draft_cutoff = c;
}

void spec_session::set_tree_budget(int64_t n) {
    const int64_t cap = std::max<int64_t>(tgt().params().max_verify, 1) - 1;
    DFN_REQUIRE(n >= 1 && n <= cap, "engine", "tree_budget must be in [1, ", cap, "] (the verify capacity ",
                cap + 1, " this engine was created with, minus the root), got ", n);
    params_.tree_budget = n;
}

void spec_session::reset() {
    tgt().reset();
    ring_->clear();
    pending_m_ = 0;  // the controller's request begins in prefill_pass (with its sampling regime)
}

std::vector<spec_session::ring_segment> spec_session::ring_segments(int64_t m, int64_t pos0) const {
    const int64_t cap = ring_->capacity;
    // Positions older than the last `cap` would be overwritten within this push: skip them.
    const int64_t skip = std::max<int64_t>(0, m - cap);
    std::vector<ring_segment> out;
    for (int64_t p = pos0 + skip, row = skip; row < m;) {
        const int64_t slot0 = p % cap;
        const int64_t k = std::min(m - row, cap - slot0);  // contiguous slots before the wrap
        out.push_back({slot0, k, p, row});
        p += k;
        row += k;
    }
    return out;
}

void spec_session::build_push(const build_context & b, const std::vector<ring_segment> & segs,
                              std::vector<ggml_tensor *> & f_in, std::vector<ggml_tensor *> & pos_in,
                              bool from_queue) const {
    const int64_t row = drafter_->hparams().n_feature_row();
    f_in.clear();
    pos_in.clear();
    for (const ring_segment & sg : segs) {
        if (from_queue) {
            f_in.push_back(ggml_view_2d(b.ctx, dev_queue_, row, sg.k, dev_queue_->nb[1], sg.row0 * dev_queue_->nb[1]));
        } else {
            f_in.push_back(ggml_new_tensor_2d(b.ctx, GGML_TYPE_F32, row, sg.k));
            ggml_set_input(f_in.back());
        }
        pos_in.push_back(ggml_new_tensor_1d(b.ctx, GGML_TYPE_I32, sg.k));
        ggml_set_input(pos_in.back());
        drafter_->build_encode(b, f_in.back(), pos_in.back(), *ring_, sg.slot0);
    }
}

void spec_session::set_push_inputs(const std::vector<ring_segment> & segs, const float * feats,
                                   const std::vector<ggml_tensor *> & f_in, const std::vector<ggml_tensor *> & pos_in) const {
    const int64_t row = drafter_->hparams().n_feature_row();
    for (size_t i = 0; i < segs.size(); ++i) {
        const ring_segment & sg = segs[i];
        if (feats) ggml_backend_tensor_set(f_in[i], feats + sg.row0 * row, 0, (size_t) row * sg.k * sizeof(float));
        std::vector<int32_t> pos(sg.k);
        for (int64_t j = 0; j < sg.k; ++j) pos[j] = (int32_t) (sg.pos0 + j);
        ggml_backend_tensor_set(pos_in[i], pos.data(), 0, sg.k * sizeof(int32_t));
    }
}

void spec_session::push_features(const float * feats, int64_t m, int64_t pos0) {
    flush_features();
    // in order; a gap only when the push overwrites the whole ring (queue_features' dropped rows)
    DFN_REQUIRE(pos0 == ring_->n_pushed || (pos0 > ring_->n_pushed && m >= ring_->capacity), "feature_ring",
                "positions must be pushed in order: got ", pos0, ", expected ", ring_->n_pushed);
    for (const ring_segment & sg : ring_segments(m, pos0)) {
        // one graph per segment: a prompt's push can be as long as the ring
        const std::vector<ring_segment> one = {sg};
        std::vector<ggml_tensor *> f_in, pos_in;
        runner_.run(
            cat("encode:", sg.k, feats ? "" : ":queue"),
            [&](const build_context & b) { build_push(b, one, f_in, pos_in, feats == nullptr); },
            [&] { set_push_inputs(one, feats, f_in, pos_in); }, [] {});
    }
    ring_->n_pushed = pos0 + m;
}

void spec_session::flush_features() {
    if (pending_m_ == 0) return;
    const int64_t m = pending_m_;
    pending_m_ = 0;
    push_features(dev_queue_ ? nullptr : pending_feats_.data(), m, pending_pos0_);
}

int64_t spec_session::reserve_taps(int64_t n) {
    if (pending_m_ + n > dev_queue_->ne[1]) flush_features();
    return pending_m_;
}

void spec_session::sink_taps(int64_t n) {
    if (!dev_queue_) return;
    const int64_t col0 = reserve_taps(n);
    tgt().set_tap_sink(dev_queue_, col0);
}

void spec_session::queue_features(std::vector<float> && feats, int64_t m, int64_t pos0) {
    if (dev_queue_) {
        // the rows are in the device queue already, at columns pending_m_.. (sink_taps), or come
        // from the host (a tree's path, in path order) into those columns
        DFN_REQUIRE(pending_m_ == 0 || pos0 == pending_pos0_ + pending_m_, "feature_ring", "features queued out of "
                    "order: got position ", pos0, ", expected ", pending_pos0_ + pending_m_);
        if (!feats.empty()) {
            if (pending_m_ + m > dev_queue_->ne[1]) flush_features();
            ggml_backend_tensor_set(dev_queue_, feats.data(), pending_m_ * dev_queue_->nb[1], m * dev_queue_->nb[1]);
        }
        if (pending_m_ == 0) pending_pos0_ = pos0;
        pending_m_ += m;
        return;
    }
    if (pending_m_ == 0) {
        pending_feats_ = std::move(feats);
        pending_pos0_ = pos0;
        pending_m_ = m;
        return;
    }
    // after a round's rows (the AR probe follows a round): append, so one draft graph writes both
    DFN_REQUIRE(pos0 == pending_pos0_ + pending_m_, "feature_ring", "features queued out of order: got position ",
                pos0, ", expected ", pending_pos0_ + pending_m_);
    const size_t row = (size_t) drafter_->hparams().n_feature_row();
    // A long run of AR steps (the controller's AR mode) queues a row each: rows older than the
    // ring's capacity would be overwritten by the newer ones anyway (the push skips them:
    // ring_segments), so once `slack` rows past the capacity are queued the older ones are dropped
    // in one move: capacity / slack = 8 rows moved per step on average, and the queue holds at
    // most capacity + slack rows (growth capped there, not doubled past it).
    const int64_t cap = ring_->capacity, slack = std::max<int64_t>(1, cap / 8);
    const int64_t drop = pending_m_ + m > cap + slack ? std::min(pending_m_, pending_m_ + m - cap) : 0;
    if (drop > 0) {
        pending_feats_.erase(pending_feats_.begin(), pending_feats_.begin() + (size_t) drop * row);
        pending_m_ -= drop;
        pending_pos0_ += drop;
    }
    const size_t need = (size_t) (pending_m_ + m) * row, most = (size_t) (cap + slack) * row;
    if (need > pending_feats_.capacity() && need <= most) {
        pending_feats_.reserve(std::min(std::max(need, 2 * pending_feats_.capacity()), most));
    }
    pending_feats_.resize(need);  // drops the verify's rejected rows
    std::copy(feats.begin(), feats.begin() + (size_t) m * row, pending_feats_.begin() + (size_t) pending_m_ * row);
    pending_m_ += m;
}

int32_t spec_session::ar_step(int32_t last) {
    require_unconstrained("the in-graph argmax AR step");
    const int64_t pos = tgt().n_past();
    sink_taps(1);
    // the target checks the token and n_ctx; like decode_greedy, plus the taps
    decode_result r = tgt().decode(&last, 1, false, drafter_->hparams().tap_layers, /*argmax_only=*/true);
    queue_features(std::move(r.taps), 1, pos);
    return r.argmax[0];
}

decode_result spec_session::prefill_pass(const int32_t * prompt, int64_t n, int64_t n_cached, bool argmax_only,
                                         uint64_t regime) {
    begin_prefill(n, n_cached, regime);
    decode_result r = tgt().decode(prompt + n_cached, n - n_cached, false, drafter_->hparams().tap_layers, argmax_only);
    finish_prefill(r, n, n_cached);
    return r;
}

void spec_session::finish_prefill(const decode_result & r, int64_t n, int64_t n_cached) {
    if (dev_queue_ && r.taps.empty()) {
        // a batched pass on a device left the taps in this slot's queue at its next columns
        // (target_session::set_slot_tap_queue): queued as a verify's rows are, pushed by the next draft
        queue_features({}, n - n_cached, n_cached);
        return;
    }
    push_features(r.taps.data(), n - n_cached, n_cached);
}

void spec_session::begin_prefill(int64_t n, int64_t n_cached, uint64_t regime) {
    if (n_cached == 0) {
        reset();
    } else {
        const int64_t ring_next = pending_m_ > 0 ? pending_pos0_ + pending_m_ : ring_->n_pushed;
        DFN_REQUIRE(n_cached > 0 && n_cached < n, "prefill", "n_cached = ", n_cached, " must be in [0, ", n,
                    ") (at least one prompt token must run)");
        DFN_REQUIRE(n_cached == tgt().n_past() && n_cached == ring_next, "prefill", "n_cached = ", n_cached,
                    " but the target holds ", tgt().n_past(), " positions and the ring ", ring_next);
    }
    ctl_.begin_request(regime);
}

int32_t spec_session::prefill(const int32_t * prompt, int64_t n, int64_t n_cached) {
    // the next token by the in-graph argmax, as AR's decode_greedy takes it (and checked there)
    require_unconstrained("the in-graph argmax prefill");
    return prefill_pass(prompt, n, n_cached, /*argmax_only=*/true).argmax[0];
}

std::vector<int32_t> spec_session::draft(int32_t last, int64_t B) {
    std::vector<int32_t> out(B - 1);
    if (has_selector()) {  // DFlash 2: the selector's path
        const int64_t n_past = tgt().n_past();
        const std::vector<float> lat = draft_lattice(last, B);
        walk_lattice(lat.data(), B - 1, drafter_->hparams().selector_top_k, out.data(), nullptr, n_past + 1);
        return out;
    }
    run_draft(last, B, out.data(), nullptr, nullptr);
    return out;
}

std::vector<float> spec_session::draft_lattice(int32_t last, int64_t B) {
    DFN_REQUIRE(has_selector(), "draft", "this drafter has no DFlash 2 selector");
    std::vector<float> out((size_t) (B - 1) * drafter_->hparams().lattice_row());
    run_draft(last, B, nullptr, nullptr, nullptr, nullptr, 0, false, out.data());
    return out;
}

std::vector<float> spec_session::draft_logits(int32_t last, int64_t B) {
    std::vector<float> out((size_t) (B - 1) * tgt().hparams().n_vocab);
    run_draft(last, B, nullptr, out.data(), nullptr);
    return out;
}

void spec_session::check_draft(int32_t last, int64_t B) const {
    DFN_REQUIRE(last >= 0 && last < tgt().hparams().n_vocab, "draft", "token id ", last, " is outside the vocabulary");
    DFN_REQUIRE(B >= 2 && tgt().n_past() + B <= tgt().params().n_ctx, "draft", "block of ", B, " at position ",
                tgt().n_past(), " does not fit n_ctx = ", tgt().params().n_ctx);
    DFN_REQUIRE(B <= block_size_, "draft", "block of ", B, " > this engine's block_size ", block_size_);
}

void spec_session::build_draft(const build_context & b, draft_graph & d) const {
    ggml_context * ctx = b.ctx;
    const int64_t R = d.rows;
    build_push(b, d.push, d.push_f, d.push_pos, dev_queue_ != nullptr);
    d.tok = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, R);
    d.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, R);
    d.mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, d.n_att, R);
    ggml_set_input(d.tok);
    ggml_set_input(d.pos);
    ggml_set_input(d.mask);
    if (d.w > 0) {
        d.mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, d.n_att, R);
        ggml_set_input(d.mask_swa);
    }
    ggml_tensor * h = drafter_->build_block(b, d.tok, d.pos, d.mask, d.mask_swa, *ring_, d.n_ctx,
                                           tgt().model().tok_embd);  // [n_embd, B-1]
    ggml_tensor * head = d.sub ? drafter_->draft_head : lm_head();  // [n_embd, n_draft_vocab or n_vocab]
    d.out = drafter_->build_draft_logits(b, head, h, d.tok, 1, &d.conf);  // logits [n_draft_vocab or n_vocab, B-1]
    if (d.conf && d.what == draft_graph::TOP1) {
        ggml_set_output(d.conf);
        ggml_build_forward_expand(b.gf, d.conf);
    } else {
        d.conf = nullptr;
    }
    if (d.what == draft_graph::LATTICE) {
        d.out = drafter_->build_selector(b, h, d.out, d.tok);  // F32 [lattice_row, B-1]
        ggml_set_output(d.out);
        ggml_build_forward_expand(b.gf, d.out);
        return;
    }
    if (b.device && d.what != draft_graph::LOGITS) {
        d.head = d.what == draft_graph::TOPK ? device_topk(b, d.out, d.K)
                                             : device_argmax(b, d.out, /*with_p=*/d.what == draft_graph::TOP1);
        d.out = d.head.ids;
        return;
    }
    if (d.what == draft_graph::TOPK) {
        d.out = topk_op(ctx, d.out, d.K);  // F32 [2, K, B-1]
    } else if (d.what == draft_graph::TOP1) {
        d.out = top1_op(ctx, d.out);  // F32 [2, B-1]
    } else if (d.what == draft_graph::ARGMAX) {
        d.out = argmax_op(ctx, d.out);  // I32 [B-1]; flags non-finite rows (top1.h)
    }
    ggml_set_output(d.out);
    ggml_build_forward_expand(b.gf, d.out);
}

void spec_session::fill_draft_mask(const draft_graph & d, bool swa, std::vector<ggml_fp16_t> & m) const {
    fill_block_mask(*ring_, d.n_past, d.n_ctx, d.n_att, d.rows, d.lo, swa ? d.w : 0, drafter_->hparams().causal, m);
}

void spec_session::set_draft_inputs(const draft_graph & d, int32_t last) const {
    const int64_t B = d.rows;
    set_push_inputs(d.push, dev_queue_ ? nullptr : pending_feats_.data(), d.push_f, d.push_pos);
    std::vector<int32_t> t(B, (int32_t) drafter_->hparams().mask_token_id), p(B);
    t[0] = last;
    for (int64_t i = 0; i < B; ++i) p[i] = (int32_t) (d.n_past + i);
    ggml_backend_tensor_set(d.tok, t.data(), 0, B * sizeof(int32_t));
    ggml_backend_tensor_set(d.pos, p.data(), 0, B * sizeof(int32_t));
    std::vector<ggml_fp16_t> m;
    for (int swa = 0; swa < (d.w > 0 ? 2 : 1); ++swa) {
        fill_draft_mask(d, swa, m);
        // a drafter whose layers all slide reads no full mask (and one with none, no sliding
        // mask): the scheduler gave it no buffer
        ggml_tensor * dst = swa ? d.mask_swa : d.mask;
        if (dst->buffer) ggml_backend_tensor_set(dst, m.data(), 0, m.size() * sizeof(ggml_fp16_t));
    }
}

int64_t spec_session::prepare_draft(draft_graph & d, int32_t last, int64_t B) {
    check_draft(last, B);
    d.B = B;
    d.rows = drafter_->hparams().block_rows(B);
    d.n_past = tgt().n_past();
    // The features the last round committed are written into the ring by this graph, ahead of
    // the block (ggml computes nodes in order); the ring counts them from here on.
    if (pending_m_ > 0) d.push = ring_segments(pending_m_, pending_pos0_);
    const int64_t n_pushed_before = ring_->n_pushed;
    const int64_t n_pushed = pending_m_ > 0 ? pending_pos0_ + pending_m_ : n_pushed_before;
    DFN_REQUIRE(n_pushed == d.n_past, "draft", "feature ring holds ", n_pushed, " positions but the target has ", d.n_past);
    ring_->n_pushed = n_pushed;
    d.n_ctx = ring_->n_valid();
    // attention over ring slots [0, n_att): the context, the block, and padding the mask hides
    d.n_att = std::min(ring_->capacity + ring_->scratch, kv_padded(d.n_ctx + d.rows));
    // The user's window limits every layer; a GGUF sliding window limits its layers further,
    // per query: key position k is visible from query position q when q - k < w.
    d.lo = params_.window > 0 ? d.n_past - params_.window : 0;
    d.w = drafter_->hparams().sliding_window;
    return n_pushed_before;
}

void spec_session::run_draft(int32_t last, int64_t B, int32_t * argmax_out, float * logits_out, float * top1_out,
                             float * topk_out, int64_t K, bool dv_logits, float * lattice_out) {
    draft_graph d;
    d.what = logits_out ? draft_graph::LOGITS : top1_out ? draft_graph::TOP1 : topk_out ? draft_graph::TOPK
             : lattice_out ? draft_graph::LATTICE : draft_graph::ARGMAX;
    d.K = K;
    if (topk_out) top1_out = topk_out;  // read_draft's f32 output
    if (lattice_out) top1_out = lattice_out;
    const int64_t n_pushed_before = prepare_draft(d, last, B);
    // the drafts come from the draft vocabulary's rows when there is one (logits_out: the whole
    // vocabulary for tests, the draft vocabulary's rows for sampled drafts)
    d.sub = (!logits_out || dv_logits) && drafts_over_draft_vocab();
    std::string key = cat("draft:", B, d.w > 0 ? ":swa" : "",
                          logits_out ? ":logits" : topk_out ? cat(":topk", K) : lattice_out ? ":lattice"
                                                     : top1_out ? ":top1" : ":argmax",
                          d.sub ? ":dv" : "");
    for (const ring_segment & sg : d.push) key += cat(":push", sg.k);
    try {
        runner_.run(
            key, [&](const build_context & b) { build_draft(b, d); }, [&] { set_draft_inputs(d, last); },
            [&] { read_draft(d, argmax_out, logits_out ? logits_out : top1_out); });
    } catch (...) {
        ring_->n_pushed = n_pushed_before;  // the pending features stay pending
        throw;
    }
    pending_m_ = 0;
}

void spec_session::read_device_top(const draft_graph & d, int32_t * argmax_out, float * f32_out) const {
    const int64_t pairs = d.what == draft_graph::TOPK ? d.K : 1;  // (index, p) pairs per row
    // a device's stock head: ids (and p) apart; f32_out takes top1_op's / topk_op's
    // [B-1, pairs, (index, p)] form
    std::vector<int32_t> ids((d.B - 1) * pairs);
    std::vector<float> p((d.B - 1) * pairs);
    const int64_t bad = read_device_head(d.head, ids.data(), d.head.p ? p.data() : nullptr);
    if (bad >= 0) throw_non_finite_logits("draft", d.n_past + bad + 1);
    for (int64_t i = 0; i < (d.B - 1) * pairs; ++i) {
        if (argmax_out) argmax_out[i] = ids[i];
        if (f32_out) f32_out[2 * i] = (float) ids[i], f32_out[2 * i + 1] = p[i];
    }
}

void spec_session::read_draft(const draft_graph & d, int32_t * argmax_out, float * f32_out) const {
    if (d.head.ids) {
        read_device_top(d, argmax_out, f32_out);
    } else {
        if (argmax_out) ggml_backend_tensor_get(d.out, argmax_out, 0, ggml_nbytes(d.out));
        if (f32_out) ggml_backend_tensor_get(d.out, f32_out, 0, ggml_nbytes(d.out));
    }
    if (d.what == draft_graph::LATTICE) return;  // walk_lattice checks its scores
    std::vector<float> conf;
    if (d.conf) {
        conf.resize(d.B - 1);
        ggml_backend_tensor_get(d.conf, conf.data(), 0, conf.size() * sizeof(float));
    }
    finish_draft(d, argmax_out, f32_out, d.conf ? conf.data() : nullptr);
}

void spec_session::finish_draft(const draft_graph & d, int32_t * argmax_out, float * f32_out, const float * conf) const {
    const int64_t pairs = d.what == draft_graph::TOPK ? d.K : 1;
    if (conf) {  // DSpark's confidence head: each draft's acceptance probability replaces its top-1 p
        for (int64_t i = 0; i + 1 < d.B; ++i) f32_out[2 * i + 1] = conf[i];
    }
    for (int64_t i = 0; i + 1 < d.B; ++i) {  // d_{i+1} sits at position n_past + i + 1
        const bool top = d.what == draft_graph::TOP1 || d.what == draft_graph::TOPK;
        if ((argmax_out && argmax_out[i] < 0) || (top && f32_out[2 * pairs * i] < 0))
            throw_non_finite_logits("draft", d.n_past + i + 1);
    }
    if (!d.sub) return;
    const std::vector<int32_t> & ids = drafter_->hparams().draft_vocab;  // rows of the draft head -> token ids
    for (int64_t i = 0; i + 1 < d.B; ++i) {
        if (argmax_out) argmax_out[i] = ids[argmax_out[i]];
        if (d.what == draft_graph::TOP1 || d.what == draft_graph::TOPK) {
            for (int64_t k = 0; k < pairs; ++k) {
                float & idx = f32_out[2 * (pairs * i + k)];
                idx = (float) ids[(size_t) idx];
            }
        }
    }
}

std::vector<int32_t> spec_session::draft_top1(int32_t last, int64_t B, std::vector<float> & p) {
    if (has_selector()) {  // DFlash 2: the selector's path, p its softmax at each choice
        std::vector<int32_t> out(B - 1);
        p.resize(B - 1);
        const int64_t n_past = tgt().n_past();
        const std::vector<float> lat = draft_lattice(last, B);
        walk_lattice(lat.data(), B - 1, drafter_->hparams().selector_top_k, out.data(), p.data(), n_past + 1);
        return out;
    }
    std::vector<float> top1((size_t) (B - 1) * 2);  // [B-1, (argmax, p)]
    run_draft(last, B, nullptr, nullptr, top1.data());
    std::vector<int32_t> out(B - 1);
    p.resize(B - 1);
    for (int64_t i = 0; i + 1 < B; ++i) out[i] = (int32_t) top1[2 * i], p[i] = top1[2 * i + 1];
    return out;
}

int64_t spec_session::cutoff_keep(const std::vector<float> & p) const {
    double p_all = 1.0;
    for (int64_t i = 0; i < (int64_t) p.size(); ++i) {
        p_all *= p[i];
        if (p_all < params_.draft_cutoff) return i;
    }
    return (int64_t) p.size();
}

std::vector<int32_t> spec_session::draft_chain(int32_t last, int64_t B) {
    if (params_.draft_cutoff <= 0.0f) return draft(last, B);
    std::vector<float> p;
    std::vector<int32_t> d = draft_top1(last, B, p);
    d.resize(cutoff_keep(p));
    return d;
}

bool spec_session::drafted(const std::function<void()> & draft) {
    if (!drafter_failure_.empty()) return false;
    try {
        draft();
        return true;
    } catch (const non_finite_error & e) {
        // Weights that give NaN once give NaN for good: stop drafting for this session rather
        // than fail every speculative request that AR would serve.
        drafter_failure_ = cat("[draft] the drafter failed and the engine decodes AR from now on: ", e.what());
        return false;
    }
}

const std::vector<int32_t> * spec_session::forced_draft(int64_t B) {
    if (!override_) return nullptr;
    std::optional<std::vector<int32_t>> f = override_(B);
    if (!f) return nullptr;
    DFN_REQUIRE(!constraint_, "round", "a forced draft cannot run under a constraint (its tokens would bypass the "
                "grammar)");
    DFN_REQUIRE((int64_t) f->size() == B - 1, "round", "forced draft must have B-1 = ", B - 1, " tokens");
    forced_ = std::move(*f);
    return &forced_;
}

void spec_session::set_times(round_result & r, double t0, double t1, double t2) {
    r.draft_s = t1 - t0;
    r.verify_s = t2 - t1;
    r.rollback_s = profile_now() - t2;  // accept, commit (rollback) and queueing the features
}

// ---- tree verify ----

int64_t spec_session::draft_topk(int32_t last, int64_t B, std::vector<int32_t> & tok, std::vector<float> & p) {
    const int64_t rows =
        drafts_over_draft_vocab() ? (int64_t) drafter_->hparams().draft_vocab.size() : tgt().hparams().n_vocab;
    DFN_REQUIRE(params_.tree_budget >= 1, "round", "tree verify needs a tree_budget (this engine verifies chains)");
    const int64_t K = std::min(params_.tree_budget, rows);
    std::vector<float> out((size_t) (B - 1) * K * 2);  // [B-1, K, (index, p)]
    run_draft(last, B, nullptr, nullptr, nullptr, out.data(), K);
    tok.resize((size_t) (B - 1) * K);
    p.resize(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) tok[i] = (int32_t) out[2 * i], p[i] = out[2 * i + 1];
    return K;
}

round_result spec_session::verify_tree(const std::vector<int32_t> & parents, const std::vector<int32_t> & tokens,
                                       const sampling_params * sampling) {
    require_unconstrained("verify_tree");
    if (sampling) check_sampling_params(*sampling);
    DFN_REQUIRE(parents.size() == tokens.size(), "verify", "parents and tokens must have one entry per node");
    pending_step s;
    s.sampling = sampling;
    s.last = tokens.empty() ? -1 : tokens[0];
    s.input = tokens;
    s.parents = parents;
    s.t0 = s.t1 = profile_now();
    return run_step(s);
}

round_result spec_session::finish_tree(pending_step & s, decode_result & v, double t2) {
    round_result & r = s.r;
    const std::vector<int32_t> & parents = s.parents, & tokens = s.input;
    const int64_t n = (int64_t) tokens.size(), n_past0 = s.n_past0;
    const sampling_params * sampling = s.sampling;
    r.n_verified = n;
    r.parents = parents;
    r.draft.assign(tokens.begin() + 1, tokens.end());
    // node i sits at position n_past0 + depth(i) (target_session::tree_positions: the verify's
    // positions); the target's choice after it is the one AR makes at n_past0 + depth(i) + 1
    std::vector<int64_t> depth(n);
    target_session::tree_positions(0, n, parents.data(), depth.data());
    const int64_t n_vocab = tgt().hparams().n_vocab;
    if (sampling) {
        // drawn only along the path accept_tree_by walks; under a constraint from the row masked by
        // the grammar after node i's path: the constraint's state there (prune_tree left it at the
        // root's), which accepting each choice moves along the path
        r.committed = accept_tree_by(
            parents.data(), tokens.data(), n,
            [&](int64_t i) {
                token_logprobs lp;
                const logits_row row{v.logits.data() + (size_t) i * n_vocab, n_vocab};
                const int64_t pos = n_past0 + depth[i] + 1;
                const int32_t t = choose_next(constraint_, row, *sampling, pos, "verify", &lp);
                if (sampling->want_logprobs()) r.logprobs.push_back(std::move(lp));
                return t;
            },
            &r.path);
    } else {
        // greedy: a pass that gave the logits (a batch with sampled steps in it) gives the same argmax
        std::vector<int32_t> am(n);
        for (int64_t i = 0; i < n; ++i) am[i] = greedy_of(v, i, n_vocab, n_past0 + depth[i] + 1, "verify");
        r.committed = accept_tree(parents.data(), tokens.data(), am.data(), n, &r.path);
    }
    tgt().commit_tree(r.path);
    // the path's taps in path order: the ring gets exactly the committed positions
    const size_t row = (size_t) drafter_->hparams().n_feature_row();
    std::vector<float> feats(r.path.size() * row);
    for (size_t d = 0; d < r.path.size(); ++d) {
        std::copy_n(v.taps.begin() + (size_t) r.path[d] * row, row, feats.begin() + d * row);
    }
    queue_features(std::move(feats), (int64_t) r.path.size(), n_past0);
    set_times(r, s.t0, s.t1, t2);
    if (s.observe) {
        // the controller's calibration sees every child of every accepted node: accepted (the
        // path's next node) or turned down
        std::vector<std::pair<float, bool>> outcomes;
        for (size_t d = 0; d < r.path.size(); ++d) {
            const int32_t next = d + 1 < r.path.size() ? r.path[d + 1] : -1;
            for (size_t i = (size_t) r.path[d] + 1; i < (size_t) n; ++i)
                if (parents[i] == r.path[d]) outcomes.emplace_back(s.p[i], (int32_t) i == next);
        }
        ctl_.observe_tree_round(outcomes, r.n_verified, (int64_t) r.committed.size(), r.draft_s,
                                r.verify_s + r.rollback_s);
    }
    return std::move(r);
}

// A forced tree draft (spec.h: round_tree): forced[i] at rank 0 of position i with probability 1,
// the candidates ranked before it moved one rank down (the last one dropped when forced[i] is not
// among the K): ranks stay by probability, as build_tree needs. forced holds B - 1 tokens
// (forced_draft).
static void force_tree_draft(const std::vector<int32_t> & forced, int64_t B, int64_t K, std::vector<int32_t> & tok,
                             std::vector<float> & p) {
    for (int64_t i = 0; i + 1 < B; ++i) {
        int32_t * t = tok.data() + i * K;  // [K] position i's candidates
        float * q = p.data() + i * K;
        int64_t m = 0;
        while (m + 1 < K && t[m] != forced[(size_t) i]) ++m;
        std::move_backward(t, t + m, t + m + 1);
        std::move_backward(q, q + m, q + m + 1);
        t[0] = forced[(size_t) i], q[0] = 1.0f;
    }
}

draft_tree spec_session::draft_tree_for(int32_t last, int64_t B, const sampling_params * sampling,
                                        const std::vector<int32_t> * forced) {
    DFN_REQUIRE(sampling || !constraint_, "round", "a constrained tree round needs sampling params (temperature 0 "
                "for greedy)");
    std::vector<int32_t> tok;
    std::vector<float> p;
    if (has_selector() && !forced && !constraint_) {
        // DFlash 2: each node's children are its row's selector candidates ranked by their
        // transition probability from that node (sampled: by their perturbed weights; under a
        // constraint: draft_topk_constrained's masked rows, where a candidate the grammar allows
        // is always found when there is one)
        DFN_REQUIRE(params_.tree_budget >= 1, "round", "tree verify needs a tree_budget (this engine verifies chains)");
        const int64_t k = drafter_->hparams().selector_top_k, n_past = tgt().n_past();
        if (sampling && !sampling->greedy()) {
            draft_lattice_sampled(last, B, *sampling, tok, p);
        } else {
            const std::vector<float> lat = draft_lattice(last, B);
            tok.resize((size_t) (B - 1) * k);
            p.resize(tok.size() * k);
            lattice_probs(lat.data(), B - 1, k, tok.data(), p.data(), n_past + 1);
        }
        const int64_t budget = std::min(params_.tree_budget, tgt().params().n_ctx - tgt().n_past() - 1);
        return build_tree_conditional(last, tok.data(), p.data(), B - 1, k, budget, params_.draft_cutoff);
    }
    // both check last, B and the room for the block
    const int64_t K = constraint_                        ? draft_topk_constrained(last, B, *sampling, tok, p)
                      : sampling && !sampling->greedy() ? draft_topk_sampled(last, B, *sampling, tok, p)
                                                        : draft_topk(last, B, tok, p);
    if (forced) force_tree_draft(*forced, B, K, tok, p);
    // the verify writes 1 + nodes rows from n_past: near n_ctx the tree gets what is left
    const int64_t budget = std::min(params_.tree_budget, tgt().params().n_ctx - tgt().n_past() - 1);
    draft_tree tree = build_tree(last, tok.data(), p.data(), B - 1, K, budget, params_.draft_cutoff);
    if (constraint_) prune_tree(tree);
    return tree;
}

void spec_session::prune_tree(draft_tree & tree) {
    const int64_t n = tree.size();
    std::vector<std::vector<int32_t>> children(n);
    for (int64_t i = 1; i < n; ++i) children[tree.parent[i]].push_back((int32_t) i);
    std::vector<char> keep(n, 0);
    keep[0] = 1;
    // depth first: the constraint holds node i's path while its children are tried (accept takes
    // what the mask allows: no mask is made)
    auto visit = [&](auto & self, int32_t i) -> void {
        for (const int32_t c : children[i]) {
            if (!constraint_->accept(tree.token[c])) continue;
            if (!constraint_->terminated()) {  // a stop token: nothing to verify after it
                keep[c] = 1;
                self(self, c);
            }
            constraint_->rollback(1);
        }
    };
    visit(visit, 0);
    // the kept nodes in their order (parents first, so still best-first), parents renumbered
    std::vector<int32_t> index(n, -1);
    draft_tree out;
    for (int64_t i = 0; i < n; ++i) {
        if (!keep[i]) continue;
        index[i] = (int32_t) out.size();
        out.parent.push_back(i == 0 ? -1 : index[tree.parent[i]]);
        out.token.push_back(tree.token[i]);
        out.depth.push_back(tree.depth[i]);
        out.score.push_back(tree.score[i]);
        out.prob.push_back(tree.prob[i]);
    }
    tree = std::move(out);
}

round_result spec_session::round_tree(int32_t last, int64_t B, const sampling_params * sampling) {
    pending_step s = plan_tree(last, B, sampling, forced_draft(B), /*controlled=*/false);
    return run_step(s);
}

round_result spec_session::step_tree(int32_t last, int64_t B, const sampling_params * sampling) {
    pending_step s = begin_tree_step(last, B, sampling);
    return run_step(s);
}

pending_step spec_session::begin_tree_step(int32_t last, int64_t B, const sampling_params * sampling) {
    const std::vector<int32_t> * forced = forced_draft(B);  // whatever the controller chooses
    return plan_tree(last, B, sampling, forced, params_.use_controller);
}

pending_step spec_session::plan_tree(int32_t last, int64_t B, const sampling_params * sampling,
                                     const std::vector<int32_t> * forced, bool controlled) {
    const double t0 = profile_now();
    if (controlled) {
        if (!drafter_failure_.empty()) return plan_ar(last, sampling, t0, false);
        if (ctl_.next() == controller::mode::ar) return plan_ar(last, sampling, t0, true);
    }
    if (sampling) check_sampling_params(*sampling);
    draft_tree tree;
    if (!drafted([&] { tree = draft_tree_for(last, B, sampling, forced); })) return plan_ar(last, sampling, t0, false);
    if (controlled) {
        // The controller verifies the prefix of the best-first node order (a tree: parents first)
        // with the most expected tokens per second; tree_budget caps it. A sampled tree's node
        // weights (perturbed_topk's) stand in for the probabilities.
        const size_t n = (size_t) ctl_.choose_tree(tree.parent.data(), tree.prob.data(), tree.size()) + 1;
        tree.parent.resize(n), tree.token.resize(n), tree.prob.resize(n);
    }
    pending_step s;
    s.observe = controlled;
    s.sampling = sampling;
    s.last = last;
    s.input = std::move(tree.token);
    s.parents = std::move(tree.parent);
    s.p = std::move(tree.prob);
    s.t0 = t0;
    s.t1 = profile_now();
    return s;
}

}  // namespace dfn
