#include "engine/request.h"

#include "base/profile.h"
#include "gguf/tokenizer.h"

#include <algorithm>
#include <numeric>

namespace dfn {

int64_t request_stats::rounds() const { return std::accumulate(histogram.begin(), histogram.end(), int64_t(0)); }

request::request(target_session & target, spec_session * spec, const tokenizer * vocab, const request_policy & policy,
                 int slot)
    : target_(target), spec_(spec), vocab_(vocab), policy_(policy), slot_(spec ? spec->slot() : slot) {
    DFN_REQUIRE(slot >= 0 && slot < target.n_seq(), "generate", "sequence slot ", slot, " outside [0, ", target.n_seq(), ")");
    DFN_REQUIRE(!spec || spec->slot() == slot || slot == 0, "generate", "the request's slot ", slot,
                " is not its spec session's slot ", spec ? spec->slot() : 0);
    DFN_REQUIRE(policy.max_tokens >= 0, "generate", "max_tokens must be >= 0, got ", policy.max_tokens);
    DFN_REQUIRE(!policy.speculative || spec, "generate", "a speculative request needs an engine with a drafter");
    DFN_REQUIRE(!policy.tree || (spec && spec->params().tree_budget > 0), "generate",
                "tree verify needs a drafter and a tree budget > 0");
    if (policy_.constraint && !policy_.sampling) policy_.sampling = sampling_params{};  // the masked argmax
    if (policy_.sampling) check_sampling_params(*policy_.sampling);
    if (policy.speculative) {
        B_ = spec->block_size();
        stats_.histogram.assign(B_ + 1, 0);
    }
    ring_ok_ = policy.speculative;
}

request::emitted request::emit(const std::vector<int32_t> & tokens, const std::vector<token_logprobs> & lps) {
    emitted e;
    for (size_t i = 0; i < tokens.size() && !done(); ++i) {
        const int32_t t = tokens[i];
        if (vocab_ && vocab_->is_eog(t)) {
            finish(stop_reason::eos);
            break;
        }
        out_.push_back(t);
        e.tokens.push_back(t);
        if (want_logprobs()) e.logprobs.push_back(lps[i]);
        if ((int64_t) out_.size() >= policy_.max_tokens) finish(stop_reason::length);
    }
    return e;
}

int32_t request::ar(const int32_t * tokens, int64_t n, std::vector<token_logprobs> & lps) {
    if (!sampling()) return target_.decode(tokens, n, false, {}, true).argmax[0];
    if (want_logprobs()) lps.resize(1);
    return target_.decode_sampled(tokens, n, *sampling(), want_logprobs() ? &lps[0] : nullptr, policy_.constraint);
}

request::emitted request::start(const int32_t * prompt, int64_t n, int64_t n_cached) {
    DFN_REQUIRE(committed_.empty() && !done(), "generate", "a request starts once");
    target_.select_slot(slot());
    const double t0 = profile_now();
    std::vector<token_logprobs> lps;
    int32_t tok;
    constraint_scope scope(spec_, policy_.constraint);
    if (!policy_.speculative) {
        if (n_cached == 0) target_.reset();
        tok = ar(prompt + n_cached, n - n_cached, lps);
    } else if (!sampling()) {
        tok = spec_->prefill(prompt, n, n_cached);
    } else {
        if (want_logprobs()) lps.resize(1);
        tok = spec_->prefill_sampled(prompt, n, *sampling(), want_logprobs() ? &lps[0] : nullptr, n_cached);
    }
    return started(tok, std::move(lps), n, n_cached, t0);
}

request::emitted request::started(int32_t tok, std::vector<token_logprobs> lps, int64_t n, int64_t n_cached, double t0) {
    committed_.push_back(tok);
    stats_.n_prompt = n;
    stats_.n_cached = n_cached;
    stats_.prefill_s = profile_now() - t0;
    if (policy_.max_tokens == 0) {
        finish(stop_reason::length);
        return {};
    }
    last_ = tok;
    return emit({tok}, lps);
}

void request::begin_prefill(int64_t n, int64_t n_cached) {
    target_.select_slot(slot());
    if (!policy_.speculative) {
        if (n_cached == 0) target_.reset();
    } else {
        const sampling_params * p = sampling();
        spec_->begin_prefill(n, n_cached, p ? regime_key(p->temperature, p->top_k, p->top_p, p->min_p) : 0);
    }
}

batch_item request::prefill_item(const int32_t * prompt, int64_t from, int64_t to) const {
    batch_item it;
    it.slot = slot();
    it.kind = BATCH_DECODE;  // the last row's logits (its argmax), the taps of every token
    it.tokens.assign(prompt + from, prompt + to);
    return it;
}

// Whether start() would take prompt[0, n) without refusing it (the split forms leave those to it).
static bool startable(const target_session & target, const int32_t * prompt, int64_t n, int64_t n_cached) {
    const int64_t n_vocab = target.hparams().n_vocab;
    if (n - n_cached < 1 || n_cached < 0 || n > target.params().n_ctx) return false;
    for (int64_t i = n_cached; i < n; ++i)
        if (prompt[i] < 0 || prompt[i] >= n_vocab) return false;
    return true;
}

std::optional<batch_item> request::begin_start(const int32_t * prompt, int64_t n, int64_t n_cached, int64_t max_width) {
    DFN_REQUIRE(committed_.empty() && !start_, "generate", "a request starts once");
    // anything start() may refuse runs there, alone (its error reaches this request only)
    if (done() || n - n_cached > max_width || !startable(target_, prompt, n, n_cached)) return std::nullopt;
    const double t0 = profile_now();
    begin_prefill(n, n_cached);
    start_.emplace(pending_start{n, n_cached, t0});
    return prefill_item(prompt, n_cached, n);
}

bool request::begin_chunked_start(const int32_t * prompt, int64_t n, int64_t n_cached) {
    DFN_REQUIRE(committed_.empty() && !start_, "generate", "a request starts once");
    // on a device a slot's taps stay in its queue (spec.h: finish_prefill), which one pass fills
    if (done() || target_.runner().on_device() || !startable(target_, prompt, n, n_cached)) return false;
    const double t0 = profile_now();
    begin_prefill(n, n_cached);
    start_.emplace(pending_start{n, n_cached, t0, std::vector<int32_t>(prompt, prompt + n), n_cached, {}});
    return true;
}

std::optional<batch_item> request::prefill_step(int64_t max_width, emitted & out) {
    DFN_REQUIRE(start_ && !start_->prompt.empty(), "generate", "prefill_step() without begin_chunked_start()");
    pending_start & ps = *start_;
    const int64_t left = ps.n - ps.done;
    // start()'s chunks: n_batch tokens each from n_cached on (target_session::decode)
    const int64_t m = std::min(left, target_.params().n_batch);
    if (m == left && m <= max_width) return prefill_item(ps.prompt.data(), ps.done, ps.n);
    target_.select_slot(slot());
    static const std::vector<int> no_taps;
    const std::vector<int> & taps = policy_.speculative ? spec_->drafter_hparams_().tap_layers : no_taps;
    // the last chunk's last row chooses the first token (its logits when sampled)
    decode_result v = target_.decode(ps.prompt.data() + ps.done, m, false, taps, /*argmax_only=*/!wants_logits());
    ps.done += m;
    ps.taps.insert(ps.taps.end(), v.taps.begin(), v.taps.end());
    if (ps.done < ps.n) return std::nullopt;
    v.taps.clear();
    out = finish_start(v);
    return std::nullopt;
}

request::emitted request::finish_start(decode_result & v) {
    DFN_REQUIRE(start_, "generate", "finish_start() without begin_start()");
    pending_start ps = std::move(*start_);
    start_.reset();
    target_.select_slot(slot());
    if (!ps.taps.empty()) {  // a chunked start: the chunks run alone first, then v's
        ps.taps.insert(ps.taps.end(), v.taps.begin(), v.taps.end());
        v.taps = std::move(ps.taps);
    }
    if (policy_.speculative) spec_->finish_prefill(v, ps.n, ps.n_cached);
    // the first token, as start()'s paths choose it at position n
    std::vector<token_logprobs> lps;
    const int64_t n_vocab = target_.hparams().n_vocab;
    int32_t tok;
    if (sampling()) {
        if (want_logprobs()) lps.resize(1);
        tok = choose_next(policy_.constraint, logits_row{v.logits.data(), n_vocab}, *sampling(), ps.n, "decode",
                          want_logprobs() ? &lps[0] : nullptr);
    } else {
        tok = greedy_of(v, 0, n_vocab, ps.n, "decode");
    }
    return started(tok, std::move(lps), ps.n, ps.n_cached, ps.t0);
}

// The draft source as a spec draft override (a forced draft is refused under a constraint: a
// constrained request leaves the drafter's); empty without one.
static draft_override override_of(const request::draft_source & forced, const request_policy & policy,
                                  const std::vector<int32_t> & out) {
    if (!forced || policy.constraint) return {};
    return [&forced, &out](int64_t B) -> std::optional<std::vector<int32_t>> {
        std::vector<int32_t> d = forced(out, B);
        if (d.empty()) return std::nullopt;
        return d;
    };
}

void request::count(const round_result & r) {
    stats_.controller_switches = spec_->control().switches();
    if (r.ar && stats_.drafter_failure.empty()) stats_.drafter_failure = spec_->drafter_failure();
    if (r.ar) {
        stats_.ar_steps += 1;
    } else {
        stats_.histogram[r.committed.size()] += 1;
        stats_.draft_s += r.draft_s;
        stats_.verify_s += r.verify_s;
        stats_.rollback_s += r.rollback_s;
        stats_.verified_tokens += r.n_verified;
    }
}

round_result request::round(int64_t Bc) {
    draft_override_scope scope(spec_, override_of(forced_, policy_, out_));
    round_result r = policy_.tree ? spec_->step_tree(last_, Bc, sampling()) : spec_->step(last_, Bc, sampling());
    count(r);
    return r;
}

int64_t request::round_room() const {
    const int64_t room = target_.params().n_ctx - target_.slot_n_past(slot());
    // Under exact_max_tokens a round never commits past max_tokens, so a request that ends there
    // leaves the target holding exactly its prompt and tokens.
    const int64_t left = policy_.exact_max_tokens ? policy_.max_tokens - (int64_t) out_.size() : B_;
    return std::min({B_, room, left});
}

request::emitted request::commit_step(std::vector<int32_t> committed, std::vector<token_logprobs> lps, double t0) {
    stats_.decode_s += profile_now() - t0;
    committed_.insert(committed_.end(), committed.begin(), committed.end());
    last_ = committed.back();
    return emit(committed, lps);
}

request::emitted request::step() {
    DFN_REQUIRE(!committed_.empty(), "generate", "step() before start()");
    if (done()) return {};
    target_.select_slot(slot());
    const int64_t room = target_.params().n_ctx - target_.n_past();
    if (room <= 0) {
        finish(stop_reason::context);
        return {};
    }
    const double t0 = profile_now();
    std::vector<int32_t> committed;
    std::vector<token_logprobs> lps;
    constraint_scope scope(spec_, policy_.constraint);
    if (policy_.speculative && round_room() >= 2) {
        round_result r = round(round_room());
        committed = std::move(r.committed);
        lps = std::move(r.logprobs);
    } else if (policy_.speculative && room >= 2) {  // the last token: an AR step that keeps the ring in step
        if (want_logprobs()) lps.resize(1);
        committed = {sampling() ? spec_->ar_step_sampled(last_, *sampling(), want_logprobs() ? &lps[0] : nullptr)
                                : spec_->ar_step(last_)};
        stats_.ar_steps += 1;
    } else {  // AR (also the last position of n_ctx in a speculative request: no room for a block)
        committed = {ar(&last_, 1, lps)};
        ring_ok_ = false;  // no taps: the ring falls behind the target
    }
    return commit_step(std::move(committed), std::move(lps), t0);
}

bool request::shared_draft_round() const {
    return !committed_.empty() && !done() && policy_.speculative && !policy_.tree && round_room() >= 2 &&
           spec_->batch_draftable();
}

std::optional<batch_item> request::begin_step(const shared_draft * pre, bool force_ar) {
    DFN_REQUIRE(!committed_.empty(), "generate", "begin_step() before start()");
    DFN_REQUIRE(!pending_, "generate", "a step is pending: finish_step() it first");
    if (done()) return std::nullopt;
    const int64_t room = target_.params().n_ctx - target_.slot_n_past(slot());
    batch_item it;
    it.slot = slot();
    it.kind = BATCH_DECODE;
    pending_t0_ = profile_now();
    if (!policy_.speculative) {
        if (room <= 0) return std::nullopt;
        it.tokens = {last_};
        pending_.emplace();  // an AR request's step: only its token
        pending_->ar = true;
        pending_->sampling = sampling();
        pending_->input = it.tokens;
        return it;
    }
    if (round_room() < 2) return std::nullopt;
    constraint_scope scope(spec_, policy_.constraint);
    DFN_REQUIRE(!(pre && force_ar), "generate", "given drafts for a step forced to AR");
    if (force_ar) {
        pending_ = spec_->begin_ar_step(last_, sampling());
    } else {
        draft_override_scope forced(spec_, override_of(forced_, policy_, out_));
        DFN_REQUIRE(!(pre && policy_.tree), "generate", "given chain drafts for a tree round");
        pending_ = policy_.tree ? spec_->begin_tree_step(last_, round_room(), sampling())
                                : spec_->begin_step(last_, round_room(), sampling(), pre);
    }
    pending_->n_past0 = target_.slot_n_past(slot());
    it.tokens = pending_->input;
    it.parents = pending_->parents;  // a tree round's (empty: a chain)
    if (!pending_->ar) it.kind = BATCH_VERIFY;
    return it;
}

bool request::wants_logits() const { return sampling() != nullptr; }

request::emitted request::finish_step(decode_result & v, double pass_s) {
    DFN_REQUIRE(pending_, "generate", "finish_step() without a pending step");
    pending_step s = std::move(*pending_);
    s.pass_s = pass_s;
    pending_.reset();
    std::vector<int32_t> committed;
    std::vector<token_logprobs> lps;
    if (!policy_.speculative) {  // an AR step: the choice from its row, as ar() takes it
        if (want_logprobs()) lps.resize(1);
        const int64_t pos = target_.slot_n_past(slot());
        const int64_t n_vocab = target_.hparams().n_vocab;
        committed = {sampling() ? choose_next(policy_.constraint, logits_row{v.logits.data(), n_vocab}, *sampling(), pos,
                                              "decode", want_logprobs() ? &lps[0] : nullptr)
                                : greedy_of(v, 0, n_vocab, pos, "decode")};
        ring_ok_ = false;
    } else {
        constraint_scope scope(spec_, policy_.constraint);
        round_result r = spec_->finish_step(s, v);
        count(r);
        committed = std::move(r.committed);
        lps = std::move(r.logprobs);
    }
    return commit_step(std::move(committed), std::move(lps), pending_t0_);
}

}  // namespace dfn
