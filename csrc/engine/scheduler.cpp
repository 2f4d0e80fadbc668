#include "engine/scheduler.h"

#include "base/common.h"
#include "base/profile.h"
#include "kernels/cpu/matmul/matmul.h"

#include <algorithm>
#include <map>

namespace dfn {

struct scheduler::ticket {
    std::vector<int32_t> prompt;
    request_policy policy;
    bool cache_prompt = false;
    request::draft_source forced;
    std::unique_ptr<request> req;  // once admitted
    int slot = -1;
    int64_t n_cached = 0;
    bool started = false, finished = false, cancelled = false;
    request::emitted buf;  // emitted, not taken by next() yet
    std::exception_ptr error;
};

scheduler::scheduler(target_session & target, spec_session * spec0, const tokenizer * vocab)
    : target_(target), vocab_(vocab), costs_(target.batch_width()),
      batch_ctl_(target.n_seq()) {
    DFN_REQUIRE(!spec0 || spec0->slot() == 0, "engine", "the scheduler's first spec session must serve slot 0");
    specs_.push_back(spec0);
    for (int k = 1; k < target.n_seq(); ++k) {
        if (spec0) {
            owned_.push_back(std::make_unique<spec_session>(target, spec0->drafter(), spec0->params(), k));
            specs_.push_back(owned_.back().get());
        } else {
            specs_.push_back(nullptr);
        }
    }
    slots_.resize(target.n_seq());
    stats_.width.assign(target.n_seq() + 1, 0);
}

scheduler::~scheduler() = default;

std::shared_ptr<scheduler::ticket> scheduler::submit(std::vector<int32_t> prompt, const request_policy & policy,
                                                      bool cache_prompt, request::draft_source forced) {
    DFN_REQUIRE(!policy.speculative || specs_[0], "generate", "a speculative request needs an engine with a drafter");
    auto t = std::make_shared<ticket>();
    t->prompt = std::move(prompt);
    t->policy = policy;
    t->cache_prompt = cache_prompt;
    t->forced = std::move(forced);
    std::lock_guard<std::mutex> lock(m_);
    queue_.push_back(t);
    return t;
}

void scheduler::cancel(ticket & t) {
    std::lock_guard<std::mutex> lock(m_);
    t.cancelled = true;
}

bool scheduler::done(const ticket & t) const {
    std::lock_guard<std::mutex> lock(m_);
    return t.finished && t.buf.tokens.empty();
}

void scheduler::forget_held() {
    std::lock_guard<std::mutex> lock(m_);
    for (slot_state & s : slots_) s.held.clear();
}

int scheduler::slot_of(const ticket & t) const {
    std::lock_guard<std::mutex> lock(m_);
    return t.slot;
}

const request * scheduler::result(const ticket & t) const {
    std::lock_guard<std::mutex> lock(m_);
    return t.finished ? t.req.get() : nullptr;
}

scheduler::pass_stats scheduler::stats() const {
    std::lock_guard<std::mutex> lock(m_);
    return stats_;
}

request::emitted scheduler::next(ticket & t) {
    std::unique_lock<std::mutex> lock(m_);
    while (true) {
        if (t.error) {
            std::exception_ptr e = t.error;
            t.error = nullptr;
            std::rethrow_exception(e);
        }
        if (!t.buf.tokens.empty() || t.finished) {
            request::emitted e = std::move(t.buf);
            t.buf = {};
            return e;
        }
        if (!stepping_) {
            stepping_ = true;
            lock.unlock();
            try {
                step_once();
            } catch (...) {
                lock.lock();
                stepping_ = false;
                cv_.notify_all();
                throw;
            }
            lock.lock();
            stepping_ = false;
            cv_.notify_all();
        } else {
            cv_.wait(lock);
        }
    }
}

std::vector<int> scheduler::admit() {
    std::vector<int> admitted;
    while (!queue_.empty()) {
        std::shared_ptr<ticket> t = queue_.front();
        if (t->cancelled) {  // never started: ends with nothing
            queue_.pop_front();
            t->finished = true;
            continue;
        }
        // a free slot: the one whose held sequence is the longest usable prefix of the prompt
        // (cache_prompt), else one holding nothing, else any
        // scores: the usable prefix's length (>= 1), 0 for an empty slot, -1 for one holding a
        // sequence this prompt cannot continue (it loses that slot's prompt cache)
        int best = -1;
        int64_t best_n = -2;
        for (int k = 0; k < n_slots(); ++k) {
            const slot_state & s = slots_[k];
            if (s.t) continue;
            int64_t n = s.held.empty() ? 0 : -1;  // prefer empty slots for cold starts
            const bool usable = t->cache_prompt && !s.held.empty() && s.held.size() < t->prompt.size() &&
                                (!t->policy.speculative || s.held_ring) &&
                                std::equal(s.held.begin(), s.held.end(), t->prompt.begin());
            if (usable) n = (int64_t) s.held.size();
            if (n > best_n) best = k, best_n = n;
        }
        if (best < 0) break;  // every slot is busy
        queue_.pop_front();
        slot_state & s = slots_[best];
        t->slot = best;
        t->n_cached = std::max<int64_t>(best_n, 0);
        s.t = t;
        s.held.clear();  // in flight: a request that fails leaves nothing held
        admitted.push_back(best);
    }
    return admitted;
}

void scheduler::fail(slot_state & s, std::exception_ptr e) {
    // the slot's caches may hold part of the failed work: the next request there starts cold
    s.t->error = e;
    s.t->finished = true;
    s.held.clear();
}

void scheduler::step_once() {
    const double t_begin = profile_now();
    std::vector<int> admitted;
    std::vector<std::shared_ptr<ticket>> active(n_slots());
    std::vector<char> cancelled(n_slots(), 0);  // read under the lock (cancel() writes from any thread)
    {
        std::lock_guard<std::mutex> lock(m_);
        admitted = admit();
        for (int k = 0; k < n_slots(); ++k) {
            active[k] = slots_[k].t;
            cancelled[k] = active[k] && active[k]->cancelled;
            if (cancelled[k] && active[k]->req) active[k]->req->stop();
        }
    }
    std::vector<request::emitted> out(n_slots());
    std::vector<std::exception_ptr> err(n_slots());
    // the pass's work: the short prompts' prefills (begin_start), then the steps (begin_step)
    std::vector<batch_item> items;
    std::vector<int> in_pass;
    std::vector<char> starting(n_slots(), 0);
    const int64_t budget = target_.batch_width();
    // a prompt rides the pass only as wide as its one-sequence prefill computes each column alone
    // too (a wider chunk takes ggml's or the wide GEMM's kernels there: matmul.h)
    const int64_t ride = std::min(target_.params().n_batch, k_matmul_max_cols);
    bool taps = false, logits = false;
    auto join = [&](int k, batch_item && it) {  // request k's work into the pass
        const request & r = *active[k]->req;
        taps = taps || r.policy().speculative;
        logits = logits || r.wants_logits();
        items.push_back(std::move(it));
        in_pass.push_back(k);
    };
    // the prefills: a short prompt in the pass; a longer one a chunk a step, each alone (a prefill
    // chunk wider than the matmul's batch-invariant width computes differently from a narrower
    // one), its last in the pass when it fits
    std::vector<char> began(n_slots(), 0);  // prefilling in this step: no step of theirs besides
    int64_t chunks = 0;
    for (int k : admitted) began[k] = 1;
    auto prefill_step = [&](int k) {
        ticket & t = *active[k];
        began[k] = 1;
        std::optional<batch_item> it = t.req->prefill_step(ride, out[k]);
        chunks += !it;
        if (it) {
            join(k, std::move(*it));
            starting[k] = 1;
        } else if (t.req->started() || t.req->done()) {
            t.started = true;
        }
    };
    for (int k = 0; k < n_slots(); ++k) {  // the chunked prefills begun in earlier steps
        if (!active[k] || active[k]->started || !active[k]->req || err[k]) continue;
        try {
            if (cancelled[k]) {  // done: the ticket ends with nothing
                active[k]->started = true;
                continue;
            }
            prefill_step(k);
        } catch (...) {
            err[k] = std::current_exception();
        }
    }
    for (int k : admitted) {
        ticket & t = *active[k];
        try {
            spec_session * spec = t.policy.speculative ? specs_[k] : nullptr;
            if (spec && k > 0) {  // slot 0's settings (the Engine's setters change them there)
                const spec_params & p0 = specs_[0]->params();
                spec->set_draft_cutoff(p0.draft_cutoff);
                spec->set_draft_vocab(p0.draft_vocab);
                spec->set_controller(p0.use_controller);
                if (p0.tree_budget > 0) spec->set_tree_budget(p0.tree_budget);
            }
            t.req = std::make_unique<request>(target_, spec, vocab_, t.policy, k);
            if (t.forced) t.req->set_draft_source(t.forced);
            if (cancelled[k]) t.req->stop();
            // (a cancelled request is done: begin_start leaves it to start())
            std::optional<batch_item> it = t.req->begin_start(t.prompt.data(), (int64_t) t.prompt.size(), t.n_cached, ride);
            if (it) {
                join(k, std::move(*it));
                starting[k] = 1;
                continue;
            }
            if (t.req->begin_chunked_start(t.prompt.data(), (int64_t) t.prompt.size(), t.n_cached)) {
                prefill_step(k);
                continue;
            }
            out[k] = t.req->start(t.prompt.data(), (int64_t) t.prompt.size(), t.n_cached);
            t.started = true;
        } catch (...) {
            err[k] = std::current_exception();
        }
    }
    // the others' steps: planned (drafts run), then one pass over the batchable ones
    const size_t n_starting = items.size();
    int64_t solo = 0, drafter_passes_saved = 0;
    auto steps = [&](int k) {
        return active[k] && active[k]->started && !err[k] && !active[k]->req->done() && !began[k];
    };
    // the batch's controller: judged over the requests' steps, when the speculative ones are
    // under the controller
    int n_step = 0;
    bool controlled = false;
    std::vector<size_t> committed0(n_slots(), 0);
    for (int k = 0; k < n_slots(); ++k) {
        if (!steps(k)) continue;
        n_step += 1;
        committed0[k] = active[k]->req->committed().size();
        if (active[k]->policy.speculative) controlled = controlled || active[k]->req->spec()->params().use_controller;
    }
    // the width it judges by: the requests in the pass, the prompts riding in it too (an admission
    // leaves a full batch's steps in the full batch's class)
    const int n_judged = n_step + (int) n_starting;
    const bool force_ar = controlled && !batch_ctl_.speculate(n_judged);
    const double t_step = profile_now();
    double t_solo = 0, t_riders = 0;
    // the rounds' drafts (greedy, sampled, constrained): one drafter pass per block size over their slots
    std::map<int64_t, std::vector<int>> groups;
    for (int k = 0; k < n_slots() && !force_ar; ++k)
        if (steps(k) && active[k]->req->shared_draft_round()) groups[active[k]->req->round_room()].push_back(k);
    std::vector<std::optional<shared_draft>> pre(n_slots());
    for (const auto & [B, ks] : groups) {
        if (ks.size() < 2) continue;
        std::vector<spec_session *> ss;
        std::vector<int32_t> lasts;
        std::vector<const sampling_params *> samplings;
        std::vector<char> constrained;
        for (int k : ks) {
            const request & r = *active[k]->req;
            ss.push_back(r.spec()), lasts.push_back(r.last());
            samplings.push_back(r.policy().sampling ? &*r.policy().sampling : nullptr);
            constrained.push_back(r.policy().constraint != nullptr);
        }
        std::vector<shared_draft> drafts;
        const double t0 = profile_now();
        try {
            spec_session::draft_batch(ss, lasts, samplings, constrained, B, drafts);
        } catch (...) {
            // each drafts alone: a failed drafter is recorded per session (its step an AR step),
            // and any other error reaches that request's own caller
            continue;
        }
        for (shared_draft & d : drafts) d.seconds = (profile_now() - t0) / (double) drafts.size();
        for (size_t i = 0; i < ks.size(); ++i) pre[ks[i]] = std::move(drafts[i]);
        drafter_passes_saved += (int64_t) ks.size() - 1;
    }
    for (int k = 0; k < n_slots(); ++k) {
        if (!steps(k)) continue;
        request & r = *active[k]->req;
        try {
            const bool ar = force_ar && r.policy().speculative && r.spec()->params().use_controller;
            std::optional<batch_item> it = r.begin_step(pre[k] ? &*pre[k] : nullptr, ar);
            if (!it) {  // a step only step() runs: alone, now
                const double t0 = profile_now();
                out[k] = r.step();
                t_solo += profile_now() - t0;
                solo += 1;
                continue;
            }
            join(k, std::move(*it));
        } catch (...) {
            err[k] = std::current_exception();
        }
    }
    // One pass, or several when the work is wider than the matmul's batch-invariant width.
    const std::vector<int> * tap_layers = nullptr;
    for (int k = 0; k < n_slots() && taps; ++k) {
        if (specs_[k]) {
            tap_layers = &specs_[k]->drafter_hparams_().tap_layers;
            break;
        }
    }
    static const std::vector<int> no_taps;
    size_t i0 = 0;
    while (i0 < items.size()) {
        size_t i1 = i0;
        int64_t width = 0;
        while (i1 < items.size() && (i1 == i0 || width + (int64_t) items[i1].tokens.size() <= budget)) {
            width += (int64_t) items[i1].tokens.size();
            ++i1;
        }
        std::vector<batch_item> part(items.begin() + i0, items.begin() + i1);
        std::vector<decode_result> res;
        double pass_s = 0;
        try {
            const double t0 = profile_now();
            res = target_.decode_batch(part, tap_layers ? *tap_layers : no_taps, /*argmax_only=*/!logits);
            pass_s = profile_now() - t0;
        } catch (...) {
            for (size_t i = i0; i < i1; ++i) {
                const int k = in_pass[i];
                err[k] = std::current_exception();
                if (starting[k]) active[k]->started = true;  // failed: the ticket ends with its error
            }
            i0 = i1;
            continue;
        }
        {
            std::lock_guard<std::mutex> lock(m_);
            stats_.passes += 1;
            stats_.tokens += width;
            stats_.width[i1 - i0] += 1;
            for (size_t i = i0; i < i1; ++i) stats_.tree_verifies += !items[i].parents.empty();
        }
        costs_.observe(width, pass_s);
        for (size_t i = i0; i < i1; ++i) {
            const int k = in_pass[i];
            try {
                if (starting[k]) {
                    t_riders += costs_.share((int64_t) part[i - i0].tokens.size(), width, (int64_t) (i1 - i0), pass_s);
                    active[k]->started = true;
                    out[k] = active[k]->req->finish_start(res[i - i0]);
                    continue;
                }
                const double share = costs_.share((int64_t) part[i - i0].tokens.size(), width, (int64_t) (i1 - i0), pass_s);
                out[k] = active[k]->req->finish_step(res[i - i0], share);
            } catch (...) {
                err[k] = std::current_exception();
            }
        }
        i0 = i1;
    }
    // the step's committed tokens per second for the batch's controller (its solo steps, and the
    // riding prompts' shares of the passes, apart: a prompt's columns are most of an AR step's,
    // and a busy batch admits a request nearly every step), when every request it judged was in
    // the pass
    if (controlled && n_step > 0 && in_pass.size() == n_starting + (size_t) n_step) {
        int64_t tokens = 0;
        bool speculated = false;
        for (size_t i = n_starting; i < in_pass.size(); ++i) {
            const int k = in_pass[i];
            if (err[k]) continue;
            tokens += (int64_t) (active[k]->req->committed().size() - committed0[k]);
            speculated = speculated || items[i].kind == BATCH_VERIFY;
        }
        batch_ctl_.observe(n_judged, speculated, tokens, profile_now() - t_step - t_solo - t_riders, n_step);
    }
    std::lock_guard<std::mutex> lock(m_);
    stats_.solo_steps += solo;
    stats_.steps += 1;
    stats_.step_s += profile_now() - t_begin;
    stats_.prefill_chunks += chunks;
    stats_.shared_drafts += drafter_passes_saved;
    stats_.batch_ar_steps = batch_ctl_.forced_ar_steps();
    for (size_t i = 0; i < n_starting; ++i) stats_.batched_prefills += !err[in_pass[i]];
    stats_.batch_switches = batch_ctl_.switches();
    for (int k = 0; k < n_slots(); ++k) {
        if (!active[k]) continue;
        ticket & t = *active[k];
        slot_state & s = slots_[k];
        if (err[k]) {
            fail(s, err[k]);
            if (t.req) target_.reset_slot(k);
            s.t.reset();
            continue;
        }
        t.buf.tokens.insert(t.buf.tokens.end(), out[k].tokens.begin(), out[k].tokens.end());
        t.buf.logprobs.insert(t.buf.logprobs.end(), out[k].logprobs.begin(), out[k].logprobs.end());
        if (t.req && t.req->done()) {
            t.finished = true;
            if (t.policy.exact_max_tokens && !t.req->committed().empty()) {
                s.held = t.prompt;
                s.held.insert(s.held.end(), t.req->committed().begin(), t.req->committed().end() - 1);
                s.held_ring = t.req->ring_in_step();
            }
            s.t.reset();
        }
    }
}

}  // namespace dfn
