// One drafter pass over several slots' blocks (spec.h: spec_session::draft_batch): the
// scheduler's drafts for the rounds of a step (greedy: the top-1 per row; sampled: the draws from
// the block's logits rows), where each slot's spec_session would run a draft graph of its own. Every weight of the drafter and its head is read once for all blocks;
// attention runs per block over its own slot's ring with its own mask. On a device the same pass
// in stock ops: each slot's features pushed from its device feature queue, each block's top-1 by
// device_argmax (device_heads.h) in place of top1_op.
#include "spec/spec.h"

#include "base/common.h"
#include "graph/device_heads.h"
#include "kernels/cpu/sampler.h"
#include "kernels/cpu/top1.h"

namespace dfn {

void spec_session::draft_batch(const std::vector<spec_session *> & ss, const std::vector<int32_t> & lasts,
                              const std::vector<const sampling_params *> & samplings,
                              const std::vector<char> & constrained, int64_t B, std::vector<shared_draft> & out) {
    const size_t n = ss.size();
    DFN_REQUIRE(n >= 1 && lasts.size() == n && samplings.size() == n && constrained.size() == n, "draft",
                "one last token, sampling and constraint flag per session");
    const bool sel = ss[0]->has_selector();
    // drawn: draws from the block's rows here; rows: the rows go to the session (a constrained
    // step masks them); a selector drafter draws from its lattice instead, but a constrained
    // session of one still takes the rows (draft_constrained's)
    auto drawn = [&](size_t i) { return !constrained[i] && samplings[i] && !samplings[i]->greedy(); };
    auto wants_rows = [&](size_t i) { return constrained[i] || (drawn(i) && !sel); };
    bool any_rows = false;
    for (size_t i = 0; i < n; ++i) any_rows = any_rows || wants_rows(i);
    spec_session & s0 = *ss[0];
    const drafter_model & dm = *s0.drafter_;
    const drafter_hparams & dh = dm.hparams();
    const bool sub = s0.drafts_over_draft_vocab();
    // a device engine: each session's pending features are in its device queue (spec.h: dev_queue_)
    const bool dev = s0.dev_queue_ != nullptr;
    std::vector<draft_graph> d(n);
    std::vector<int64_t> pushed_before(n, -1);
    std::string key = cat("draft:batch:", n, ":", B, dh.sliding_window > 0 ? ":swa" : "", sub ? ":dv" : "",
                          sel ? ":lattice" : "", any_rows ? ":logits" : "");
    auto restore = [&] {  // a failed graph: the pending features stay pending
        for (size_t i = 0; i < n; ++i)
            if (pushed_before[i] >= 0) ss[i]->ring_->n_pushed = pushed_before[i];
    };
    try {
        for (size_t i = 0; i < n; ++i) {
            spec_session & s = *ss[i];
            DFN_REQUIRE(s.drafter_ == s0.drafter_ && s.batch_draftable() && s.drafts_over_draft_vocab() == sub, "draft",
                        "a batched draft needs sessions of one drafter, each at a round under its controller");
            d[i].what = draft_graph::TOP1;
            d[i].sub = sub;
            pushed_before[i] = s.prepare_draft(d[i], lasts[i], B);
            for (const ring_segment & sg : d[i].push) key += cat(":push", sg.k);
            key += "|";
        }
    } catch (...) {
        restore();
        throw;
    }
    const int64_t R = d[0].rows;
    ggml_tensor * tok = nullptr, * pos = nullptr, * top1 = nullptr, * conf = nullptr, * logits = nullptr;
    std::vector<ggml_tensor *> lats(n, nullptr);
    auto build = [&](const build_context & b0) {
        build_context b = b0;
        b.any_width = true;  // each block's columns as its own draft computes them (build_context.h)
        ggml_context * ctx = b.ctx;
        std::vector<drafter_model::block_ring> blocks;
        for (size_t i = 0; i < n; ++i) {
            draft_graph & g = d[i];
            ss[i]->build_push(b, g.push, g.push_f, g.push_pos, /*from_queue=*/dev);  // ahead of every block
            g.mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, g.n_att, R);
            ggml_set_input(g.mask);
            if (g.w > 0) {
                g.mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, g.n_att, R);
                ggml_set_input(g.mask_swa);
            }
            blocks.push_back({ss[i]->ring_.get(), g.n_ctx, g.mask, g.mask_swa});
        }
        tok = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) n * R);  // block i: [last_i, MASK x]
        pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) n * R);
        ggml_set_input(tok);
        ggml_set_input(pos);
        ggml_tensor * h = dm.build_blocks(b, tok, pos, blocks, s0.tgt().model().tok_embd);  // [n_embd, n (B-1)]
        ggml_tensor * head = sub ? dm.draft_head : s0.lm_head();
        logits = dm.build_draft_logits(b, head, h, tok, (int64_t) n, &conf);  // [n_cols, n (B-1)]
        if (any_rows) ggml_set_output(logits);  // the blocks' rows, as draft_logits_for_sampling's
        if (conf) {
            ggml_set_output(conf);
            ggml_build_forward_expand(b.gf, conf);
        }
        if (sel) {  // DFlash 2: each block's selector lattice over its own rows and anchor, as alone
            for (size_t i = 0; i < n; ++i) {
                const int64_t c0 = (int64_t) i * (B - 1);
                ggml_tensor * hi = ggml_cont(ctx, ggml_view_2d(ctx, h, h->ne[0], B - 1, h->nb[1], c0 * h->nb[1]));
                ggml_tensor * li = ggml_cont(ctx, ggml_view_2d(ctx, logits, logits->ne[0], B - 1, logits->nb[1],
                                                               c0 * logits->nb[1]));
                ggml_tensor * ti = ggml_view_1d(ctx, tok, R, (size_t) i * R * sizeof(int32_t));
                lats[i] = dm.build_selector(b, hi, li, ti);  // F32 [lattice_row, B-1]
                ggml_set_output(lats[i]);
                ggml_build_forward_expand(b.gf, lats[i]);
            }
            return;
        }
        if (b.device) {  // per block, as its draft alone reads it (spec.cpp: build_draft)
            for (size_t i = 0; i < n; ++i) {
                ggml_tensor * li = ggml_view_2d(ctx, logits, logits->ne[0], B - 1, logits->nb[1],
                                                (size_t) i * (B - 1) * logits->nb[1]);  // [n_cols, B-1]
                d[i].head = device_argmax(b, li, /*with_p=*/true);
            }
            return;
        }
        top1 = top1_op(ctx, logits);  // F32 [2, n (B-1)]
        ggml_set_output(top1);
        ggml_build_forward_expand(b.gf, top1);
    };
    auto set_inputs = [&] {
        std::vector<int32_t> t((size_t) n * R, (int32_t) dh.mask_token_id), p((size_t) n * R);
        std::vector<ggml_fp16_t> m;
        for (size_t i = 0; i < n; ++i) {
            const draft_graph & g = d[i];
            ss[i]->set_push_inputs(g.push, dev ? nullptr : ss[i]->pending_feats_.data(), g.push_f, g.push_pos);
            t[i * R] = lasts[i];
            for (int64_t j = 0; j < R; ++j) p[i * R + j] = (int32_t) (g.n_past + j);
            for (int swa = 0; swa < (g.w > 0 ? 2 : 1); ++swa) {
                ss[i]->fill_draft_mask(g, swa, m);
                ggml_tensor * dst = swa ? g.mask_swa : g.mask;
                if (dst->buffer) ggml_backend_tensor_set(dst, m.data(), 0, m.size() * sizeof(ggml_fp16_t));
            }
        }
        ggml_backend_tensor_set(tok, t.data(), 0, t.size() * sizeof(int32_t));
        ggml_backend_tensor_set(pos, p.data(), 0, p.size() * sizeof(int32_t));
    };
    std::vector<float> all((size_t) n * (B - 1) * 2), confs;
    // a drawn block's logits rows [B-1, row.n] (over the draft vocabulary when it is on)
    const logits_row row = s0.sampling_row_shape();
    std::vector<std::vector<float>> rows(n);
    const int64_t lat_row = dh.lattice_row();
    std::vector<std::vector<float>> lat(n);  // a selector drafter's lattices [B-1, lattice_row]
    auto read = [&] {
        const size_t block = (size_t) (B - 1) * row.n;
        for (size_t i = 0; i < n; ++i) {
            if (sel && !constrained[i]) {
                lat[i].resize((size_t) (B - 1) * lat_row);
                ggml_backend_tensor_get(lats[i], lat[i].data(), 0, lat[i].size() * sizeof(float));
            }
            if (!wants_rows(i)) continue;
            rows[i].resize(block);
            ggml_backend_tensor_get(logits, rows[i].data(), i * block * sizeof(float), block * sizeof(float));
        }
        if (sel) return;
        if (dev) {  // each block's head in top1_op's [B-1, (index, p)] form, as its draft alone reads it
            for (size_t i = 0; i < n; ++i) ss[i]->read_device_top(d[i], nullptr, all.data() + i * (B - 1) * 2);
        } else {
            ggml_backend_tensor_get(top1, all.data(), 0, all.size() * sizeof(float));
        }
        if (conf) {
            confs.resize((size_t) n * (B - 1));
            ggml_backend_tensor_get(conf, confs.data(), 0, confs.size() * sizeof(float));
        }
    };
    try {
        // one plan for every mix on the CPU; a device's runner keeps one per shape key
        s0.runner_.run(key, build, set_inputs, read, "draft:batch");
        out.assign(n, {});
        for (size_t i = 0; i < n; ++i) {
            if (constrained[i]) {  // its step masks them (draft_constrained), the constraint there
                out[i].rows = std::move(rows[i]);
                continue;
            }
            if (sel) {  // the selector's path (draft_top1's) or its coherent draws (draft_sampled's)
                const int64_t n_past = d[i].n_past;
                if (drawn(i)) {
                    out[i].tok = ss[i]->lattice_draws(lat[i].data(), B, *samplings[i], n_past, false, &out[i].p);
                } else {
                    out[i].tok.resize(B - 1);
                    out[i].p.resize(B - 1);
                    walk_lattice(lat[i].data(), B - 1, dh.selector_top_k, out[i].tok.data(), out[i].p.data(), n_past + 1);
                }
                continue;
            }
            if (drawn(i)) {  // draft_sampled's draws from its rows, with their probabilities
                const int64_t n_past = d[i].n_past;
                const sampling_params & p = *samplings[i];
                out[i].tok = ss[i]->drawn_block(B, false, &out[i].p, [&](int64_t j) {
                    return sample_row({rows[i].data() + (size_t) j * row.n, row.n, row.ids}, p, n_past + 1 + j, "draft",
                                      true);
                });
                continue;
            }
            float * f = all.data() + i * (B - 1) * 2;  // as read_draft reads a block alone
            ss[i]->finish_draft(d[i], nullptr, f, conf ? confs.data() + i * (B - 1) : nullptr);
            out[i].tok.resize(B - 1);
            out[i].p.resize(B - 1);
            for (int64_t j = 0; j + 1 < B; ++j) out[i].tok[j] = (int32_t) f[2 * j], out[i].p[j] = f[2 * j + 1];
        }
    } catch (...) {
        restore();
        throw;
    }
    for (spec_session * s : ss) s->pending_m_ = 0;
}

}  // namespace dfn
