// A chain step of a spec_session, split around its one target pass (spec.h: begin_step,
// finish_step): the plan (the controller's choice, the drafts), the pass (run_step alone, or the
// scheduler's decode_batch over several slots: engine/scheduler.h), then the acceptance, the
// commit and the features queued for the ring. round(), round_sampled() and step() are its forms.
#include "spec/spec.h"

#include "base/common.h"
#include "base/profile.h"
#include "spec/verify.h"

#include <algorithm>

namespace dfn {

round_result spec_session::round(int32_t last, int64_t B) {
    require_unconstrained("the in-graph argmax round");
    pending_step s = plan_chain(last, B, nullptr, forced_draft(B), /*controlled=*/false);
    return run_step(s);
}

round_result spec_session::round_sampled(int32_t last, int64_t B, const sampling_params & p) {
    check_sampling_params(p);
    pending_step s = plan_chain(last, B, &p, forced_draft(B), /*controlled=*/false);  // before the drafts move the constraint
    return run_step(s);
}

round_result spec_session::step(int32_t last, int64_t B, const sampling_params * sampling) {
    pending_step s = begin_step(last, B, sampling);
    return run_step(s);
}

pending_step spec_session::begin_step(int32_t last, int64_t B, const sampling_params * sampling, const shared_draft * pre) {
    // whatever the controller chooses, before the drafts move the constraint
    const std::vector<int32_t> * forced = forced_draft(B);
    // (a forced draft replaces the given ones after them, as it replaces the drafter's own)
    DFN_REQUIRE(!pre || batch_draftable(), "round", "given drafts where the step drafts otherwise");
    return plan_chain(last, B, sampling, forced, params_.use_controller, pre);
}

pending_step spec_session::begin_ar_step(int32_t last, const sampling_params * sampling) const {
    return plan_ar(last, sampling, profile_now(), /*observe=*/false);
}

bool spec_session::batch_draftable() const {
    return params_.use_controller && drafter_failure_.empty() && ctl_.next() == controller::mode::spec;
}

pending_step spec_session::plan_ar(int32_t last, const sampling_params * sampling, double t0, bool observe) const {
    if (!sampling) require_unconstrained("the in-graph argmax AR step");
    pending_step s;
    s.ar = true;
    s.observe = observe;
    s.sampling = sampling;
    s.last = last;
    s.input = {last};
    s.t0 = t0;
    s.t1 = profile_now();
    return s;
}

pending_step spec_session::plan_chain(int32_t last, int64_t B, const sampling_params * sampling,
                                      const std::vector<int32_t> * forced, bool controlled, const shared_draft * pre) {
    const double t0 = profile_now();
    if (sampling) check_sampling_params(*sampling);
    else require_unconstrained("the in-graph argmax round");
    pending_step s;
    s.sampling = sampling;
    s.last = last;
    s.t0 = t0;
    std::vector<int32_t> & d = s.r.draft;
    const bool drawn = sampling && !sampling->greedy();
    if (controlled) {
        if (!drafter_failure_.empty()) return plan_ar(last, sampling, t0, false);
        if (ctl_.next() == controller::mode::ar) return plan_ar(last, sampling, t0, true);
        // the drafts with their probabilities (greedy: the top-1's; sampled: the draw's under the
        // drafter's filtered distribution)
        std::vector<float> & p = s.p;
        // pre: drafted before, in a pass shared with other slots (its share is the draft's time);
        // under the constraint the pass gave the drafter's rows, masked and drawn from here
        if (pre) s.t0 -= pre->seconds;
        if (pre && !constraint_) {
            d = pre->tok, p = pre->p;
        } else if (!drafted([&] {
                d = constraint_ ? draft_constrained(last, B, *sampling, &p, pre ? &pre->rows : nullptr)  // may stop short
                    : drawn     ? draft_sampled(last, B, *sampling, &p)
                                : draft_top1(last, B, p);
            })) {
            return plan_ar(last, sampling, t0, false);
        }
        if (forced) d = *forced;
        const int64_t k = std::min(ctl_.choose(p.data(), (int64_t) p.size()), cutoff_keep(p));
        // the first draft left unverified: when every verified one is accepted, the bonus token
        // says whether it would have been too (calibration for free, also when k = 0)
        s.next = k < (int64_t) d.size() ? d[k] : -1;
        if (constraint_) constraint_->rollback((int64_t) d.size() - k);  // it holds the k verified drafts
        d.resize(k);
        s.observe = true;
    } else {
        const bool ok = drafted([&] {
            if (forced) {
                if (drawn) {
                    draft_sampled(last, B, *sampling);
                } else {
                    draft(last, B);  // the drafter runs as in a real round
                }
                d = *forced;
            } else {
                d = constraint_ ? draft_constrained(last, B, *sampling) : drawn ? draft_sampled(last, B, *sampling)
                                                                         : draft_chain(last, B);
            }
        });
        if (!ok) return plan_ar(last, sampling, t0, false);
    }
    s.input.reserve(d.size() + 1);
    s.input.push_back(last);
    s.input.insert(s.input.end(), d.begin(), d.end());
    s.t1 = profile_now();
    return s;
}

round_result spec_session::run_step(pending_step & s) {
    target_session & t = tgt();
    const int64_t L = (int64_t) s.input.size();
    s.n_past0 = t.n_past();
    if (s.parents.empty()) sink_taps(L);  // a tree's path taps go from the host, in path order
    const std::vector<int> & taps = drafter_->hparams().tap_layers;
    decode_result v = s.ar                ? t.decode(s.input.data(), 1, false, taps, /*argmax_only=*/!s.wants_logits())
                      : s.parents.empty() ? t.verify(s.input.data(), L, taps, /*argmax_only=*/!s.wants_logits())
                                          : t.verify_tree(s.input.data(), s.parents.data(), L, taps, !s.wants_logits());
    return finish_step(s, v);
}

int32_t spec_session::choice(const pending_step & s, const decode_result & v, int64_t i, int64_t pos,
                             const uint32_t * mask, token_logprobs * lp) const {
    const int64_t n_vocab = target_.hparams().n_vocab;
    const char * where = s.ar ? "decode" : "verify";
    // greedy: a pass that gave the logits (a batch with sampled steps in it) gives the same token
    if (!s.sampling) return greedy_of(v, i, n_vocab, pos, where);
    const logits_row row{v.logits.data() + (size_t) i * n_vocab, n_vocab};
    if (constraint_ && !s.ar) return choose_masked(row, mask, *s.sampling, pos, where, lp);
    return choose_next(constraint_, row, *s.sampling, pos, where, lp);  // an AR step's: the constraint accepts it
}

round_result spec_session::finish_step(pending_step & s, decode_result & v) {
    // a shared pass: the step's draft time, then its share of the pass (the controller prices the
    // step by what it adds to the batch), then its own commit
    const double now = profile_now(), t2 = s.pass_s >= 0 ? s.t1 + s.pass_s : now;
    round_result & r = s.r;
    const bool lps = s.sampling && s.sampling->want_logprobs();
    if (s.ar) {
        token_logprobs lp;
        r.committed = {choice(s, v, 0, s.n_past0 + 1, nullptr, &lp)};
        queue_features(std::move(v.taps), 1, s.n_past0);
        if (lps) r.logprobs = {std::move(lp)};
        r.ar = true;
        r.n_verified = 1;
        r.verify_s = (s.pass_s >= 0 ? s.t1 - s.t0 + s.pass_s : 0) + profile_now() - (s.pass_s >= 0 ? now : s.t0);
        if (s.observe) ctl_.observe_ar(r.verify_s);
        return std::move(r);
    }
    if (!s.parents.empty()) return finish_tree(s, v, t2);
    const int64_t L = (int64_t) s.input.size();  // `last` + the drafts
    r.n_verified = L;
    // t_i: the target's choice after input i, at position n_past0 + i + 1; rows after the first
    // rejected draft are not chosen (nothing reads them). Every t_i is committed, so these are the
    // logprobs of the committed tokens. Under a constraint row i is masked by masks_ row i: the
    // grammar after d_1..d_i.
    const int64_t W = constraint_ ? mask_words(target_.hparams().n_vocab) : 0;
    std::vector<int32_t> t;
    for (int64_t i = 0; i < L; ++i) {
        token_logprobs lp;
        t.push_back(choice(s, v, i, s.n_past0 + i + 1, constraint_ ? masks_.data() + (size_t) i * W : nullptr, &lp));
        if (lps) r.logprobs.push_back(std::move(lp));
        if (i + 1 == L || r.draft[i] != t[i]) break;
    }
    const int64_t n_acc = (int64_t) t.size() - 1;  // drafts equal to the target's choices
    r.committed = accept_prefix(r.draft.data(), n_acc, t.data(), n_acc + 1);
    constraint_commit(L - 1, r.committed);
    const int64_t n_keep = (int64_t) r.committed.size();  // `last` and the accepted drafts were fed
    tgt().commit(n_keep);
    // the first n_keep rows are pushed into the ring by the next draft graph (see flush_features)
    queue_features(std::move(v.taps), n_keep, s.n_past0);
    r.draft_s = s.t1 - s.t0;
    r.verify_s = t2 - s.t1;
    r.rollback_s = profile_now() - now;  // accept, commit (rollback) and queueing the features
    if (s.observe) {
        const int64_t k = L - 1, accepted = n_keep - 1;
        const int next_hit = s.next >= 0 && accepted == k ? (int) (r.committed.back() == s.next) : -1;
        ctl_.observe_round(s.p.data(), k, accepted, r.draft_s, r.verify_s + r.rollback_s, next_hit);
    }
    return std::move(r);
}

}  // namespace dfn
