// One request's loop over a target (and its spec_session when speculative): the prefill, then AR
// steps or speculative rounds until a token-level stop (end of generation, max_tokens, the
// context). It is the only request loop: Python's Engine (engine.py: the text layer, stop strings,
// streaming) and the C API (c_api.cpp) both drive it. The request's policy is fixed when it
// starts: the token chooser (greedy, or sampled with its seed; logprobs), speculative or AR, and
// the verify kind (chain or tree).
#pragma once

#include "kernels/cpu/constraint.h"
#include "kernels/cpu/sampler.h"
#include "runtime/session.h"
#include "spec/spec.h"

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dfn {

class tokenizer;

enum class stop_reason { none, eos, length, context, caller };

// The request's policy: set once, before start().
struct request_policy {
    bool speculative = false;  // rounds through the spec_session; false: AR steps on the target
    bool tree = false;         // tree verify (spec_session::step_tree); the spec's tree_budget > 0
    // Unset: greedy, each argmax taken in the graph. Set: the sampler's choice at each position
    // (sampler.h: choose_token), at temperature 0 the argmax from the logits rows on the host,
    // with the committed tokens' logprobs when n_logprobs >= 0.
    std::optional<sampling_params> sampling;
    int64_t max_tokens = 0;
    // Never commit past max_tokens (the prompt cache: a finished request leaves the target holding
    // exactly its prompt and tokens). Otherwise a round may verify past it; the extra tokens are
    // committed in the core but not emitted.
    bool exact_max_tokens = false;
    // Structured output (constraint.h): every target choice and draft under the grammar's mask,
    // the request taking the sampling path (temperature 0 when unset). The caller keeps it alive.
    token_constraint * constraint = nullptr;
};

// What a request measured; the Python GenerationStats and the C dfn_stats are filled from it.
struct request_stats {
    int64_t n_prompt = 0, n_cached = 0;
    double prefill_s = 0, decode_s = 0;  // decode_s: every step after the prefill
    int64_t ar_steps = 0;                // AR steps of a speculative request (the controller's, the last token's)
    // Rounds by committed tokens: histogram[k] = rounds that committed k tokens (index 0 unused);
    // B + 1 entries for a speculative request.
    std::vector<int64_t> histogram;
    double draft_s = 0, verify_s = 0, rollback_s = 0;
    int64_t verified_tokens = 0, controller_switches = 0;
    std::string drafter_failure;  // spec_session::drafter_failure() once it failed in this request
    stop_reason stop = stop_reason::none;
    int64_t rounds() const;
};

class request {
public:
    // Tests and benchmarks (acceptance-controlled mode): the B - 1 drafts a round verifies in
    // place of the drafter's (which still runs), given the tokens emitted so far and B; an empty
    // vector lets the drafter's stand.
    using draft_source = std::function<std::vector<int32_t>(const std::vector<int32_t> & out, int64_t B)>;

    // `spec` may be null for an AR request (policy.speculative false); `vocab`, when given, ends the
    // request at an end-of-generation token (not emitted). The target and spec outlive the request.
    // slot: the target's sequence slot an AR request runs on (a speculative one runs on its spec
    // session's).
    request(target_session & target, spec_session * spec, const tokenizer * vocab, const request_policy & policy,
            int slot = 0);
    int slot() const { return slot_; }

    // The tokens one call committed and emitted (cut at an end-of-generation token and at
    // max_tokens) and, when the policy asks for logprobs, theirs.
    struct emitted {
        std::vector<int32_t> tokens;
        std::vector<token_logprobs> logprobs;
    };

    // The prefill of prompt[0, n) (n_cached > 0: the target, and the ring when speculative, already
    // hold prompt[0, n_cached): only the rest runs; 0: a cold start that resets them); its first
    // token. max_tokens 0 ends the request after the prefill (the prompt is still checked).
    emitted start(const int32_t * prompt, int64_t n, int64_t n_cached = 0);
    // start() split around its target pass, for a scheduler that runs a short prompt's prefill in
    // its shared pass: begin_start returns the pass's work for this request's slot (a BATCH_DECODE of
    // prompt[n_cached, n): the last row's logits or argmax, every token's taps for a speculative
    // request), or nullopt when the prefill should run alone (start()): wider than max_width
    // tokens, or anything start() would refuse; finish_start takes that work's result and chooses
    // the first token as start() would.
    std::optional<batch_item> begin_start(const int32_t * prompt, int64_t n, int64_t n_cached, int64_t max_width);
    emitted finish_start(decode_result & v);
    // A longer prompt's prefill spread over a scheduler's steps, so that the other requests' steps
    // go on between its chunks: begin_chunked_start keeps the prompt (false: the prefill should run
    // alone, start(): anything start() would refuse, or a target on a device), then each
    // prefill_step runs one chunk of start()'s (n_batch tokens from n_cached on, the same chunks,
    // so the same caches) alone, or returns the last chunk as the shared pass's work when it fits
    // in max_width tokens (finish_start takes its result). started() once the first token is out
    // (`out`: it, from a chunk run alone).
    bool begin_chunked_start(const int32_t * prompt, int64_t n, int64_t n_cached);
    std::optional<batch_item> prefill_step(int64_t max_width, emitted & out);
    bool prefilling() const { return start_.has_value(); }
    bool started() const { return !committed_.empty(); }
    // One AR step or one speculative round (the controller's choice under it). done() after a stop.
    emitted step();
    // step() split around its target pass, for a scheduler that runs several requests' passes as
    // one (engine/scheduler.h): when the next step is a round (chain or tree) or an AR step,
    // begin_step runs its drafts and returns the pass's work for this request's slot (a
    // BATCH_VERIFY of the verified tokens, with a tree's parents, or a BATCH_DECODE of one
    // token); finish_step takes that work's result from the shared pass
    // (target_session::decode_batch, with the drafter's tap layers; logits rows when
    // wants_logits()) and commits, as step() would have. nullopt: the step is one only step()
    // runs (the last token's AR step, the end of the context, a done request).
    // pre: this step's drafts from a drafter pass shared with other requests
    // (spec_session::draft_batch), when shared_draft_round() said the step takes them. force_ar: a
    // speculative request's step is an AR step whatever its controller says (the batch's
    // controller, engine/batch_controller.h); the ring stays in step.
    std::optional<batch_item> begin_step(const shared_draft * pre = nullptr, bool force_ar = false);
    // Whether the next step is a chain round whose drafts draft_batch may give, greedy, sampled or
    // constrained (the spec's batch_draftable; a draft source replaces them after, as it replaces
    // the drafter's own); its block size then is round_room().
    bool shared_draft_round() const;
    int64_t round_room() const;
    int32_t last() const { return last_; }
    spec_session * spec() const { return spec_; }
    bool wants_logits() const;
    // pass_s: this request's share of the shared pass's time (engine/batch_costs.h), for the
    // controller's prices; < 0: unknown (timed from the drafts' end).
    emitted finish_step(decode_result & v, double pass_s = -1);
    // The caller ends the request (a stop string, a callback, a cancellation).
    void stop() { finish(stop_reason::caller); }
    bool done() const { return stats_.stop != stop_reason::none; }

    void set_draft_source(draft_source f) { forced_ = std::move(f); }
    const request_stats & stats() const { return stats_; }
    const request_policy & policy() const { return policy_; }
    int64_t block_size() const { return B_; }
    const std::vector<int32_t> & output() const { return out_; }
    // Every token the target committed, past a stop too: the target has run all but the last.
    // The sequence the target holds after the request is the prompt + committed()[:-1].
    const std::vector<int32_t> & committed() const { return committed_; }
    // Whether the spec's feature ring is in step with that sequence (an AR step at the last
    // position of the context runs without taps: the ring falls behind).
    bool ring_in_step() const { return ring_ok_; }

private:
    void finish(stop_reason why) {
        if (stats_.stop == stop_reason::none) stats_.stop = why;
    }
    // Appends committed tokens to the output, stopping at an end-of-generation token or max_tokens.
    emitted emit(const std::vector<int32_t> & tokens, const std::vector<token_logprobs> & lps);
    // One AR token on the target (no taps), greedy or by the sampler.
    int32_t ar(const int32_t * tokens, int64_t n, std::vector<token_logprobs> & lps);
    // A round (or the controller's AR step) of Bc verified tokens at most.
    round_result round(int64_t Bc);
    // (round_room: the verified tokens a round may take now: min(B, room in n_ctx, tokens left
    // under exact_max_tokens); < 2: no round.)
    // A round's result into the stats.
    void count(const round_result & r);
    emitted commit_step(std::vector<int32_t> committed, std::vector<token_logprobs> lps, double t0);
    // begin_step's pending work: a round's (spec's pending_step) or an AR request's step
    std::optional<pending_step> pending_;
    // begin_start's: the prompt's length, the cached prefix, the prefill's start time; a chunked
    // start's prompt, the tokens prefilled so far and their taps ([token][tap layer][n_embd])
    struct pending_start {
        int64_t n, n_cached;
        double t0;
        std::vector<int32_t> prompt;
        int64_t done = 0;
        std::vector<float> taps;
    };
    // the batch item of prompt[from, to) on this request's slot (a BATCH_DECODE)
    batch_item prefill_item(const int32_t * prompt, int64_t from, int64_t to) const;
    // the prefill's beginning: the slot selected, the target reset (or the spec's ring checked)
    void begin_prefill(int64_t n, int64_t n_cached);
    std::optional<pending_start> start_;
    // start()'s end, after the first token is chosen
    emitted started(int32_t tok, std::vector<token_logprobs> lps, int64_t n, int64_t n_cached, double t0);
    double pending_t0_ = 0;
    const sampling_params * sampling() const { return policy_.sampling ? &*policy_.sampling : nullptr; }
    bool want_logprobs() const { return policy_.sampling && policy_.sampling->want_logprobs(); }

    target_session & target_;
    spec_session * spec_;
    const tokenizer * vocab_;
    request_policy policy_;
    int slot_ = 0;
    int64_t B_ = 1;
    draft_source forced_;
    request_stats stats_;
    std::vector<int32_t> out_, committed_;
    int32_t last_ = -1;
    bool ring_ok_ = false;
};

}  // namespace dfn
