// Sampled speculative decoding: spec_session's prefill, AR probe and round with the sampler
// (sampler.h) in place of the argmax. The target token at absolute position q is drawn from its
// logits row with the noise G(seed, q, .); a verify row's logits are bit for bit the AR step's, so
// every committed token is the one sampled AR decoding draws at q. The drafter proposes d_i, at
// position n_past + i, as its own draw with the same noise (Gumbel coupling): where its
// distribution is close to the target's the two draws agree, and acceptance stays near greedy's.
// The same paths serve a greedy request that asks for logprobs (temperature 0): choose_token
// then takes the argmax from the rows, which is the in-graph argmax the greedy paths read.
#include "spec/spec.h"

#include "base/common.h"
#include "base/profile.h"
#include "kernels/cpu/top1.h"
#include "spec/verify.h"

#include <algorithm>
#include <cmath>

namespace dfn {

int32_t spec_session::prefill_sampled(const int32_t * prompt, int64_t n, const sampling_params & p,
                                      token_logprobs * lp, int64_t n_cached) {
    check_sampling_params(p);
    decode_result r = prefill_pass(prompt, n, n_cached, /*argmax_only=*/false,
                                   regime_key(p.temperature, p.top_k, p.top_p, p.min_p));
    const logits_row row{r.logits.data(), tgt().hparams().n_vocab};
    return choose_next(constraint_, row, p, n, "decode", lp);
}

int32_t spec_session::ar_step_sampled(int32_t last, const sampling_params & p, token_logprobs * lp) {
    check_sampling_params(p);
    const int64_t pos = tgt().n_past();
    sink_taps(1);
    decode_result r = tgt().decode(&last, 1, false, drafter_->hparams().tap_layers);
    queue_features(std::move(r.taps), 1, pos);
    const logits_row row{r.logits.data(), tgt().hparams().n_vocab};
    return choose_next(constraint_, row, p, pos + 1, "decode", lp);
}

logits_row spec_session::sampling_row_shape() const {
    const bool dv = drafts_over_draft_vocab();
    const std::vector<int32_t> & ids = drafter_->hparams().draft_vocab;
    return {nullptr, dv ? (int64_t) ids.size() : target_.hparams().n_vocab, dv ? ids.data() : nullptr};
}

std::vector<float> spec_session::draft_logits_for_sampling(int32_t last, int64_t B, logits_row & row) {
    row = sampling_row_shape();
    std::vector<float> logits((size_t) (B - 1) * row.n);  // [B-1, row.n]
    run_draft(last, B, nullptr, logits.data(), nullptr, nullptr, 0, /*dv_logits=*/true);
    return logits;
}

std::vector<int32_t> spec_session::draft_sampled(int32_t last, int64_t B, const sampling_params & p,
                                                 std::vector<float> * probs) {
    const int64_t n_past = tgt().n_past();
    const bool cut = !probs && params_.draft_cutoff > 0.0f;
    if (!has_selector()) {
        logits_row row0{nullptr, 0};
        const std::vector<float> logits = draft_logits_for_sampling(last, B, row0);  // [B-1, row0.n]
        return drawn_block(B, cut, probs, [&](int64_t i) {
            return sample_row({logits.data() + (size_t) i * row0.n, row0.n, row0.ids}, p, n_past + 1 + i, "draft",
                              cut || probs);
        });
    }
    return lattice_draws(draft_lattice(last, B).data(), B, p, n_past, cut, probs);
}

std::vector<int32_t> spec_session::lattice_draws(const float * lat, int64_t B, const sampling_params & p,
                                                 int64_t n_past, bool cut, std::vector<float> * probs) const {
    // DFlash 2 draws a coherent block: among row i's k candidates of the selector lattice
    // [B-1, lattice_row] by their transition scores from the previous draw, under the same noise.
    const int64_t k = drafter_->hparams().selector_top_k;
    std::vector<int32_t> cand(k);
    int64_t pred = 0;  // the previous draw's column among its row's candidates
    return drawn_block(B, cut, probs, [&](int64_t i) {
        const float * row = lat + (size_t) i * drafter_->hparams().lattice_row();
        for (int64_t j = 0; j < k; ++j) cand[j] = (int32_t) row[j];
        const sample_result s = sample_row({row + k + pred * k, k, cand.data()}, p, n_past + 1 + i, "draft", cut || probs);
        pred = std::find(cand.begin(), cand.end(), s.token) - cand.begin();
        return s;
    });
}

std::vector<int32_t> spec_session::drawn_block(int64_t B, bool cut, std::vector<float> * probs,
                                               const std::function<sample_result(int64_t)> & draw) const {
    // d_{i+1}: the draw at position n_past + 1 + i
    std::vector<int32_t> out;
    if (probs) probs->clear();
    double p_all = 1.0;
    for (int64_t i = 0; i + 1 < B; ++i) {
        const sample_result s = draw(i);
        if (probs) probs->push_back((float) std::exp(s.logprob));
        if (cut) {
            p_all *= std::exp(s.logprob);
            if (p_all < params_.draft_cutoff) break;
        }
        out.push_back(s.token);
    }
    return out;
}

// Under a constraint the drafter's rows are checked whole before the grammar moves: a non-finite
// logit anywhere is the drafter's failure (drafted()), raised while the constraint is still at the
// round's start, so the failed round's AR step masks from the right state. (mask_row would hide
// a NaN the grammar disallows, and row_topk skips NaN: the failure would go unseen.)
static void check_draft_rows(const std::vector<float> & logits, int64_t n, int64_t pos0) {
    for (size_t j = 0; j < logits.size(); ++j) {
        if (logits[j] != logits[j] || logits[j] == INFINITY) throw_non_finite_logits("draft", pos0 + (int64_t) j / n);
    }
}

std::vector<int32_t> spec_session::draft_constrained(int32_t last, int64_t B, const sampling_params & p,
                                                     std::vector<float> * probs, const std::vector<float> * rows) {
    const int64_t n_past = tgt().n_past();
    const int64_t W = mask_words(tgt().hparams().n_vocab);
    logits_row row0 = sampling_row_shape();
    const std::vector<float> logits = rows ? *rows : draft_logits_for_sampling(last, B, row0);
    DFN_REQUIRE((int64_t) logits.size() == (B - 1) * row0.n, "draft", "the drafter's rows hold ", logits.size(),
                " logits, not ", B - 1, " x ", row0.n);
    check_draft_rows(logits, row0.n, n_past + 1);
    const bool cut = !probs && params_.draft_cutoff > 0.0f;
    sampling_params q = p;
    q.n_logprobs = 0;  // the draft's probability under the masked distribution (cut, controller)
    masks_.assign((size_t) B * W, 0);
    std::vector<int32_t> out;
    if (probs) probs->clear();
    std::vector<float> buf;
    double p_all = 1.0;
    int64_t i = 0;
    for (; i + 1 < B; ++i) {
        uint32_t * mask = masks_.data() + (size_t) i * W;
        constraint_->fill_mask(mask, W);
        int64_t n_allowed = 0;
        const logits_row row = mask_row({logits.data() + (size_t) i * row0.n, row0.n, row0.ids}, mask, buf, &n_allowed);
        if (n_allowed == 0) break;  // the draft vocabulary holds nothing the grammar allows here
        token_logprobs lp;
        const int32_t d = choose_token(row, q, n_past + 1 + i, "draft", &lp);  // d_{i+1}
        const double pr = std::exp(lp.logprob);
        if (cut && (p_all *= pr) < params_.draft_cutoff) break;
        if (!constraint_->accept(d)) break;
        if (constraint_->terminated()) {  // a stop token: the verify row after it would allow nothing
            constraint_->rollback(1);
            break;
        }
        out.push_back(d);
        if (probs) probs->push_back((float) pr);
    }
    if (i + 1 == B) constraint_->fill_mask(masks_.data() + (size_t) i * W, W);  // the bonus row's
    return out;
}

void spec_session::constraint_commit(int64_t n_in, const std::vector<int32_t> & committed) {
    if (!constraint_) return;
    // it holds the n_in drafts, of which the committed tokens but the last are the first ones
    const int32_t t = committed.back();
    constraint_->rollback(n_in - ((int64_t) committed.size() - 1));
    if (!constraint_->accept(t)) throw runtime_error(cat("[verify] the constraint rejected committed token ", t));
}

void spec_session::require_unconstrained(const char * what) const {
    DFN_REQUIRE(!constraint_, "round", what, " cannot run under a constraint (pass sampling params: temperature 0 "
                "for greedy)");
}

int64_t spec_session::draft_topk_constrained(int32_t last, int64_t B, const sampling_params & p,
                                             std::vector<int32_t> & tok, std::vector<float> & w) {
    DFN_REQUIRE(params_.tree_budget >= 1, "round", "tree verify needs a tree_budget (this engine verifies chains)");
    const int64_t n_past = tgt().n_past(), W = mask_words(tgt().hparams().n_vocab);
    logits_row row0{nullptr, 0};
    const std::vector<float> logits = draft_logits_for_sampling(last, B, row0);
    check_draft_rows(logits, row0.n, n_past + 1);
    const int64_t K = std::min(params_.tree_budget, row0.n);
    tok.assign((size_t) (B - 1) * K, 0);  // [B-1, K]
    w.assign(tok.size(), 0.0f);
    std::vector<uint32_t> mask((size_t) W);
    std::vector<float> buf, wk;
    std::vector<int32_t> idx;
    int64_t n_spine = 0;
    for (int64_t i = 0; i + 1 < B; ++i) {  // position n_past + i + 1
        constraint_->fill_mask(mask.data(), W);
        int64_t n_allowed = 0;
        const logits_row row = mask_row({logits.data() + (size_t) i * row0.n, row0.n, row0.ids}, mask.data(), buf,
                                        &n_allowed);
        if (n_allowed == 0) break;
        if (p.greedy()) {
            row_topk(row, K, idx, wk);
        } else {
            perturbed_topk(row, p, n_past + 1 + i, K, "draft", idx, wk);
        }
        for (size_t k = 0; k < idx.size(); ++k) {
            tok[i * K + k] = row.id(idx[k]);
            w[i * K + k] = wk[k];
        }
        if (!constraint_->accept(row.id(idx[0]))) break;
        ++n_spine;
        if (constraint_->terminated()) break;  // nothing follows a stop token (prune_tree drops it)
    }
    constraint_->rollback(n_spine);
    return K;
}

int64_t spec_session::draft_topk_sampled(int32_t last, int64_t B, const sampling_params & p, std::vector<int32_t> & tok,
                                         std::vector<float> & w) {
    DFN_REQUIRE(params_.tree_budget >= 1, "round", "tree verify needs a tree_budget (this engine verifies chains)");
    const int64_t n_past = tgt().n_past();
    logits_row row0{nullptr, 0};
    const std::vector<float> logits = draft_logits_for_sampling(last, B, row0);
    check_draft_rows(logits, row0.n, n_past + 1);
    const int64_t K = std::min(params_.tree_budget, row0.n);
    // [B-1, K]; a position whose filters keep fewer than K tokens has weight 0 past them, which
    // build_tree never takes
    tok.assign((size_t) (B - 1) * K, 0);
    w.assign(tok.size(), 0.0f);
    std::vector<int32_t> idx;
    std::vector<float> wk;
    for (int64_t i = 0; i + 1 < B; ++i) {  // d_{i+1} at position n_past + i + 1
        const logits_row row{logits.data() + (size_t) i * row0.n, row0.n, row0.ids};
        perturbed_topk(row, p, n_past + 1 + i, K, "draft", idx, wk);
        for (size_t k = 0; k < idx.size(); ++k) {
            tok[i * K + k] = row.id(idx[k]);
            w[i * K + k] = wk[k];
        }
    }
    return K;
}

void spec_session::draft_lattice_sampled(int32_t last, int64_t B, const sampling_params & p, std::vector<int32_t> & cand,
                                         std::vector<float> & w) {
    const int64_t k = drafter_->hparams().selector_top_k, n_past = tgt().n_past();
    const std::vector<float> lat = draft_lattice(last, B);  // [B-1, k + k*k]
    cand.resize((size_t) (B - 1) * k);
    w.assign(cand.size() * k, 0.0f);  // 0 past the candidates the filters keep
    std::vector<int32_t> idx;
    std::vector<float> wk;
    for (int64_t r = 0; r + 1 < B; ++r) {  // row r: d_{r+1} at position n_past + 1 + r
        const float * row = lat.data() + (size_t) r * drafter_->hparams().lattice_row();
        for (int64_t j = 0; j < k; ++j) cand[r * k + j] = (int32_t) row[j];
        for (int64_t q = 0; q < k; ++q) {  // the transition scores from predecessor column q
            perturbed_topk({row + k + q * k, k, cand.data() + r * k}, p, n_past + 1 + r, k, "draft", idx, wk);
            for (size_t m = 0; m < idx.size(); ++m) w[(size_t) (r * k + q) * k + idx[m]] = wk[m];
        }
    }
}

}  // namespace dfn
