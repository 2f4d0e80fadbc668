// The engine over several sequences (issue 35; docs/architecture.md, "The scheduler"): requests
// queue for one of the target's sequence slots, start there (the prefill), then advance together.
// Each step runs every active request's plan (a round's drafts, or an AR step), then ONE target
// pass over all of their work (target_session::decode_batch: every weight read once for the
// batch), then each request's acceptance and commit. A request's tokens in any batch are its
// tokens run alone, bit for bit (the matmul contract: each column computed as alone). Requests
// join and leave between steps (continuous batching). Tree rounds and the last token's AR step
// run alone, between the batched passes. The rounds' drafts of one block size, greedy, sampled and
// constrained, come from one drafter pass over their slots (spec_session::draft_batch; DFlash 2's
// selector per block in it; a constrained slot masks its rows in its own step; a draft source's
// forced drafts replace a slot's after it). Under the controller (spec_params::use_controller), the
// batch's controller (engine/batch_controller.h) may make a step AR for every request: it judges
// whole steps by their committed tokens per second against all-AR steps over as many requests.
//
// Threads: any number of callers submit and wait (next()); whichever waits while no step runs
// runs the next one for everybody (no thread of the scheduler's own).
#pragma once

#include "engine/batch_controller.h"
#include "engine/batch_costs.h"
#include "engine/request.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace dfn {

class scheduler {
public:
    // target: a session with n_seq slots (CPU); spec0: slot 0's spec session, or null for an
    // engine without a drafter (AR only). Slots 1.. get spec sessions of their own that share its
    // drafter's weights and settings. vocab: ends requests at an end-of-generation token.
    scheduler(target_session & target, spec_session * spec0, const tokenizer * vocab);
    ~scheduler();

    struct ticket;
    // Queues a request: its prompt, policy and, for tests and benchmarks, a draft source
    // (request::set_draft_source). cache_prompt: start from the held sequence of a free slot
    // whose prompt cache holds a strict prefix of the prompt (the request should then set
    // exact_max_tokens, so that it leaves its own sequence held).
    std::shared_ptr<ticket> submit(std::vector<int32_t> prompt, const request_policy & policy, bool cache_prompt = false,
                                   request::draft_source forced = {});
    // The tokens the ticket's request emitted since the last call, waiting (and stepping the
    // engine while no other thread does) until there are some or the request has ended; its
    // error, if it failed, is thrown here.
    request::emitted next(ticket & t);
    // Ends the request at the next step (stop_reason caller); a queued one never starts.
    void cancel(ticket & t);
    bool done(const ticket & t) const;
    // The slot the ticket's request runs in (-1 while it queues).
    int slot_of(const ticket & t) const;
    // The request once it has ended (stats, committed tokens); null before.
    const request * result(const ticket & t) const;

    // Drops every slot's prompt cache (another user of the target, Engine.eval, is about to run on
    // it); call with no request in flight.
    void forget_held();
    int n_slots() const { return (int) specs_.size(); }
    spec_session * spec(int slot) { return specs_.at(slot); }
    // The batch's controller (tests set its parameters; call with no request in flight).
    batch_controller & batch_control() { return batch_ctl_; }

    // What the batched passes ran, summed over the engine's life (metrics, benchmarks): passes,
    // tokens, and histogram of passes by the number of requests in them.
    struct pass_stats {
        int64_t passes = 0, tokens = 0, solo_steps = 0;
        int64_t shared_drafts = 0;  // draft graphs saved by drafting several slots' blocks in one pass
        // the batch's controller: all-AR steps it imposed, and its mode changes
        int64_t batch_ar_steps = 0, batch_switches = 0;
        int64_t batched_prefills = 0;  // prompts prefilled in a shared pass (request::begin_start)
        int64_t prefill_chunks = 0;    // chunks of longer prompts run alone between steps (prefill_step)
        int64_t tree_verifies = 0;     // tree rounds' verifies in the shared passes
        int64_t steps = 0;             // engine steps (step_once)
        double step_s = 0;             // their seconds (the rest of a run's time is its callers')
        std::vector<int64_t> width;  // width[n]: passes over n requests
    };
    pass_stats stats() const;

private:
    struct slot_state {
        std::shared_ptr<ticket> t;  // the request in it
        std::vector<int32_t> held;  // its prompt cache: the sequence the slot holds after its last request
        bool held_ring = false;     // and whether the ring is in step with it
    };
    void step_once();
    // Admits queued tickets into free slots (caller holds m_); returns those admitted.
    std::vector<int> admit();
    void fail(slot_state & s, std::exception_ptr e);

    target_session & target_;
    const tokenizer * vocab_;
    std::vector<spec_session *> specs_;  // per slot; null without a drafter
    std::vector<std::unique_ptr<spec_session>> owned_;
    std::vector<slot_state> slots_;
    std::deque<std::shared_ptr<ticket>> queue_;
    mutable std::mutex m_;
    std::condition_variable cv_;
    bool stepping_ = false;
    pass_stats stats_;
    batch_costs costs_;  // the shared passes' costs, split into the requests' shares
    batch_controller batch_ctl_;  // whether the batch speculates at all
};

}  // namespace dfn
