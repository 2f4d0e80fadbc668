// The speculative round loop: draft, verify, accept, roll back, push features.
#pragma once

#include "spec/controller.h"
#include "models/drafter.h"
#include "kernels/cpu/sampler.h"
#include "runtime/session.h"
#include "spec/tree.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dfn {

struct spec_params {
    int64_t block_size = 0;           // B: verified tokens per round; 0 = the drafter's block_size
    int64_t ring_capacity = 4096;     // feature ring positions
    // drafter attention window in committed positions before the block; 0 = the drafter's
    // trained context (GGUF dflash.trained_context_length), or the whole ring when it has none
    int64_t window = 0;
    // Confidence cut: verify the drafts d_1..d_k only while the product of the drafter's top-1
    // probabilities p(d_1)...p(d_k) stays >= draft_cutoff (0 = always verify all B-1). On a
    // compute-bound device every verified token costs time, and a draft the drafter itself doubts
    // is rarely accepted; the output is the same either way (only target tokens are committed).
    float draft_cutoff = 0.0f;
    // Draft over the drafter's draft vocabulary when its GGUF has one (drafter.h); false = always
    // the whole vocabulary. Either way only target tokens are committed.
    bool draft_vocab = true;
    // The controller (controller.h) picks each step: an AR step or a round, and how many drafts
    // a round verifies (draft_cutoff still caps them). false: fixed settings, every step a round.
    bool use_controller = true;
    // Tree verify (round_tree, step_tree): the best-first tree of at most tree_budget nodes below
    // `last` (tree.h) from one draft pass's per-position top-K, verified in one target pass.
    // draft_cutoff is then the tree's minimum path score. 1 + tree_budget <= the target's max_verify;
    // 0: chain only (round_tree raises).
    int64_t tree_budget = 0;
};

struct round_result {
    std::vector<int32_t> committed;  // accepted drafts + bonus: 1..B tokens
    std::vector<int32_t> draft;      // the drafts as verified: d_1 .. d_{n_verified-1}
    int64_t n_verified = 0;          // tokens in the verify pass: `last` + the drafts kept by the cut
    bool ar = false;                 // an AR step (step(): the controller's choice): one token, no draft
    // Tree rounds: the verified tree's parents (node 0 the root `last`; draft holds nodes 1..) and
    // the accepted path's node indices, root first. Empty for a chain.
    std::vector<int32_t> parents, path;
    // One per committed token, in order, when the request's sampling_params ask for logprobs
    // (sampler.h: token_logprobs, from the verify's rows of the committed tokens); else empty.
    std::vector<token_logprobs> logprobs;
    double draft_s = 0, verify_s = 0, rollback_s = 0;
};

class spec_session;

// A block's drafts d_1..d_{B-1} and their probabilities (spec_session::draft_top1's outputs, or
// draft_sampled's draws and theirs).
struct shared_draft {
    std::vector<int32_t> tok;
    std::vector<float> p;
    // a constrained session's: the drafter's rows [B-1, n] (draft_logits_for_sampling's), which
    // its step masks and draws from (the constraint moves there, not in the shared pass)
    std::vector<float> rows;
    double seconds = 0;  // this block's share of the shared drafter pass (the controller's draft cost)
};

// A step between its drafts and its target pass (spec_session::begin_step / begin_tree_step /
// finish_step): an AR step, a chain verify, or a tree verify (parents non-empty).
struct pending_step {
    bool ar = false;       // an AR step: `last` decoded with the taps; else a verify of `input`
    bool observe = false;  // the controller measures it (its AR step, or its round)
    const sampling_params * sampling = nullptr;
    int32_t last = -1;
    std::vector<int32_t> input;  // the target pass's tokens: [last] or [last, d_1 .. d_k], or a tree's nodes
    std::vector<int32_t> parents;  // a tree verify's (node 0 the root `last`); empty: AR or a chain
    int64_t n_past0 = 0;         // the slot's n_past before the pass (finish_step)
    std::vector<float> p;        // the drafts' probabilities, as the controller chose k from them (a tree: per node)
    int32_t next = -1;           // the first draft left unverified (the controller's calibration)
    double t0 = 0, t1 = 0;       // the step's start, the drafts' end
    // The target pass's cost to this step when the pass was shared (the scheduler's share of it:
    // engine/batch_costs.h); < 0: the pass was this step's alone, timed from t1 to finish_step.
    double pass_s = -1;
    round_result r;              // its draft
    // The pass must give every row's logits (a sampled or constrained step, logprobs); else the
    // argmax per row is enough.
    bool wants_logits() const { return sampling != nullptr; }
};

// Tests and benchmarks only (acceptance-controlled rounds): given B, the B - 1 tokens a round
// verifies in place of the drafter's (spec_session::set_draft_override); nullopt lets the
// drafter's stand. The product never sets one.
using draft_override = std::function<std::optional<std::vector<int32_t>>(int64_t B)>;

// A spec_session's constraint (set_constraint) for one scope; a null session is left alone.
struct constraint_scope {
    spec_session * s;
    constraint_scope(spec_session * s, token_constraint * c);
    ~constraint_scope();
    constraint_scope(const constraint_scope &) = delete;
    constraint_scope & operator=(const constraint_scope &) = delete;
};

class spec_session {
public:
    // `target` must have been created with max_verify >= the block size.
    spec_session(target_session & target, const std::string & drafter_path, const spec_params & params);
    // A session for sequence slot `slot` of a target with several (session_params::n_seq), drafting
    // with a drafter another session loaded (drafter()): its weights are shared, while the ring,
    // the feature queue, the controller and the constraint are this session's own.
    spec_session(target_session & target, std::shared_ptr<drafter_model> drafter, const spec_params & params, int slot);
    ~spec_session();
    spec_session(const spec_session &) = delete;
    spec_session & operator=(const spec_session &) = delete;
    const std::shared_ptr<drafter_model> & drafter() const { return drafter_; }
    int slot() const { return slot_; }

    // Prefill the prompt through the target with taps, fill the ring; returns the first token.
    // n_cached > 0 (the prompt cache): prompt[0, n_cached) is the sequence the target and the ring
    // already hold (n_cached == target.n_past() == the ring's next position; the caller checks the
    // tokens), so only prompt[n_cached, n) runs, its taps pushed as a prefill pushes them.
    int32_t prefill(const int32_t * prompt, int64_t n, int64_t n_cached = 0);
    // The prefill split around its target pass (a scheduler runs a short prompt's prefill in its
    // shared pass): begin_prefill resets (n_cached 0) or checks the continuation and begins the
    // controller's request (regime: regime_key of the sampling, 0 greedy); the pass decodes
    // prompt[n_cached, n) on the slot with the drafter's tap layers; finish_prefill pushes its taps
    // into the ring.
    void begin_prefill(int64_t n, int64_t n_cached, uint64_t regime);
    void finish_prefill(const decode_result & r, int64_t n, int64_t n_cached);

    // Draft d_1 .. d_{B-1} after `last` at position target.n_past() (nothing is committed).
    std::vector<int32_t> draft(int32_t last, int64_t B);
    // The drafter's logits for d_1 .. d_{B-1}, [B-1, n_vocab] row-major (tests and debugging).
    std::vector<float> draft_logits(int32_t last, int64_t B);
    // A DFlash 2 drafter's selector lattice for d_1..d_{B-1}, [B-1, lattice_row()] (drafter.h:
    // build_selector); draft() walks it (walk_lattice).
    std::vector<float> draft_lattice(int32_t last, int64_t B);
    // d_1..d_{B-1} with their probabilities [B-1] (TOP1 output): the top-1 probability; DFlash 2:
    // the selector's path and its softmax; DSpark with a confidence head: its confidences.
    std::vector<int32_t> draft_top1(int32_t last, int64_t B, std::vector<float> & p);

    // One round from the last committed token. B may be lowered near n_ctx.
    round_result round(int32_t last, int64_t B);

    // The next step of a request: under the controller (params.use_controller) an AR step or a round
    // whose verified drafts the controller chose, each timed and fed back to it; else round().
    // With `sampling`: the sampled AR step and round (spec_sampled.cpp); at temperature 0 (a
    // request that wants logprobs) the greedy ones, taking each argmax from the logits rows.
    round_result step(int32_t last, int64_t B, const sampling_params * sampling = nullptr);

    // step() split around its target pass, so that a scheduler runs the passes of several slots'
    // steps as one (engine/scheduler.h, target_session::decode_batch): begin_step runs the
    // drafter (its graphs only; nothing of the target moves) and says what the target must run:
    // pending_step::input at the slot's n_past, an AR step (decode with the taps) or a chain verify.
    // finish_step takes that pass's result (logits rows, or the argmax per row when the pass
    // computed only those: pending_step::wants_logits false) and commits: the same round step()
    // gives. step() is begin_step, the pass alone (run_step), finish_step.
    // pre: the drafts and probabilities the step's own drafter pass would give (draft_top1's,
    // or draft_sampled's draws: draft_batch's), when the step takes them (batch_draftable).
    pending_step begin_step(int32_t last, int64_t B, const sampling_params * sampling = nullptr,
                            const shared_draft * pre = nullptr);
    // An AR step's plan whatever the controller says (the batch's controller chose AR for every
    // request: engine/batch_controller.h): the taps keep the ring in step; the controller is not
    // told (its AR price is its own AR steps').
    pending_step begin_ar_step(int32_t last, const sampling_params * sampling = nullptr) const;
    // Whether begin_step's next drafts are draft_top1's, draft_sampled's draws or, under a
    // constraint, draft_constrained's from the drafter's rows (a round under the controller, a
    // healthy drafter): those draft_batch may give (a draft override then replaces them, as it
    // replaces the drafter's own).
    bool batch_draftable() const;
    // One drafter pass over several sessions' blocks of B (sessions of one drafter, each on its
    // own slot and ring): out[i] is ss[i]'s own pass alone, bit for bit on the CPU
    // (drafter_model::build_blocks: each block's columns as alone; the head per column); on a
    // device in stock ops (features pushed from each slot's device queue, each block's top-1 by
    // device_argmax), there under the near-tie rule (ggml's kernels round by batch width):
    // draft_top1(lasts[i], B) greedy (samplings[i] null or greedy), else draft_sampled's draws
    // from the block's logits rows with their probabilities; a DFlash 2 drafter's from each
    // block's selector lattice. Each session's pending features are written into its ring by the
    // same graph.
    // constrained[i]: session i's step runs under a constraint: out[i].rows only.
    static void draft_batch(const std::vector<spec_session *> & ss, const std::vector<int32_t> & lasts,
                            const std::vector<const sampling_params *> & samplings,
                            const std::vector<char> & constrained, int64_t B, std::vector<shared_draft> & out);
    // step_tree's begin_step: the tree round's tree (or the controller's AR step), for a pass shared
    // with other slots (a BATCH_VERIFY with the tree's parents); finish_step commits its path.
    pending_step begin_tree_step(int32_t last, int64_t B, const sampling_params * sampling = nullptr);
    round_result finish_step(pending_step & s, decode_result & v);
    round_result run_step(pending_step & s);

    // Tree verify (spec_params::tree_budget): one draft pass (per-position top-K), build_tree,
    // one target pass over the tree, accept_tree, commit the accepted path. step_tree is
    // step()'s form: under the controller an AR step or a tree round of the first nodes of the
    // best-first tree (the controller chooses how many, tree_budget at most); else round_tree.
    // With `sampling` (temperature > 0) the tree holds at each position the drafter's K best
    // tokens by perturbed score (draft_topk_sampled) and the path kept is the target's draws
    // (choose_token at each node's position): sampled AR's tokens. At temperature 0 with
    // logprobs: the greedy tree, its argmaxes from the logits.
    round_result round_tree(int32_t last, int64_t B, const sampling_params * sampling = nullptr);
    round_result step_tree(int32_t last, int64_t B, const sampling_params * sampling = nullptr);
    // Verify a given tree (parents[0] == -1, tokens[0] == last) and commit its accepted path
    // (tests: trees the drafter would not build). The drafter does not run. With `sampling`: the
    // target's choices by choose_token, as a sampled tree round takes them.
    round_result verify_tree(const std::vector<int32_t> & parents, const std::vector<int32_t> & tokens,
                             const sampling_params * sampling = nullptr);
    void set_tree_budget(int64_t n);

    // One exact AR step from the last committed token (the controller's AR step):
    // decodes `last` with the taps, queues its features for the ring as a round's commit does,
    // and returns the greedy next token (taken in the graph, as the AR loop's decode_greedy).
    // Rounds may follow: the ring stays in step with the target.
    int32_t ar_step(int32_t last);

    // Sampled decoding (sampler.h; spec_sampled.cpp): prefill, AR probe and round as above, with
    // each target token drawn by the sampler at its position instead of taken by argmax, and the
    // drafter proposing its own draw under the same noise. The committed tokens equal sampled AR
    // decoding's at p.seed (p.temperature > 0). At temperature 0 (a greedy request that wants
    // logprobs) they are greedy decoding's, each argmax taken from the logits rows on the host.
    // lp, when given and p.want_logprobs(): the token's logprobs. n_cached: as prefill's.
    int32_t prefill_sampled(const int32_t * prompt, int64_t n, const sampling_params & p, token_logprobs * lp = nullptr,
                            int64_t n_cached = 0);
    int32_t ar_step_sampled(int32_t last, const sampling_params & p, token_logprobs * lp = nullptr);
    round_result round_sampled(int32_t last, int64_t B, const sampling_params & p);

    // Tests and benchmarks only: the draft override (draft_override) every round from now on
    // consults, until set back to nullptr (draft_override_scope). Each step (round, step, their
    // tree and sampled forms) asks it once, at its start, whatever the controller then chooses:
    // its tokens must number B - 1 and are refused under a constraint (both checked there, before
    // any draft moves the constraint). A chain round verifies them in place of the drafter's
    // (which still runs); a tree round puts them at rank 0 of their positions with probability 1
    // (the drafter's candidates behind them, the last dropped), so the tree holds the forced
    // chain first and the drafter's tokens as its siblings.
    void set_draft_override(draft_override f) { override_ = std::move(f); }

    // Push target features (taps) of m committed positions starting at `pos0` into the ring.
    // feats: [m, n_taps, n_embd] row-major (nullptr: the device queue's first m columns).
    void push_features(const float * feats, int64_t m, int64_t pos0);

    const drafter_hparams & drafter_hparams_() const { return drafter_->hparams(); }
    int64_t block_size() const { return block_size_; }
    // The ring, with the features a round left pending pushed first.
    feature_ring & ring() {
        flush_features();
        return *ring_;
    }
    const spec_params & params() const { return params_; }  // window: as resolved at construction
    // Committed positions a draft attends to at most: the window, bounded by the ring.
    int64_t effective_window() const {
        return params_.window > 0 ? std::min(params_.window, ring_->capacity) : ring_->capacity;
    }
    // Sets the drafter's weights and the draft and ring-push graphs' compute buffers; adds the
    // ring and the feature queue (several slots' sessions add theirs).
    void add_memory(memory_usage & m) const;
    void set_draft_cutoff(float c);
    void set_draft_vocab(bool on);
    void set_controller(bool on) { params_.use_controller = on; }
    // A drafter whose logits are not finite (NaN / inf weights, overflow) has failed for this
    // session: the first such draft's error is kept here, and every round from then on (round,
    // step, their tree and sampled forms) is an AR step (round_result::ar), so requests go on with
    // AR's output, exactly. Empty while the drafter is healthy; reset() keeps it.
    const std::string & drafter_failure() const { return drafter_failure_; }
    // A structured-output request's grammar (constraint.h), for the calls until it is set back to
    // nullptr; the caller keeps it alive. Under it every target choice (prefill, AR step, verify
    // row) is taken from the row masked by the grammar's state there, and every draft is chosen
    // under its mask; the constraint accepts each committed token. Only the sampling paths take
    // it (a greedy request passes temperature-0 sampling_params: the argmax from the masked rows):
    // the in-graph argmax paths (prefill, ar_step, round without sampling) and forced drafts raise.
    // A failed drafter's AR steps (drafter_failure) are the constrained AR step. A DFlash 2
    // drafter's drafts come from its masked logits rows, not its selector (whose k candidates may
    // hold nothing the grammar allows).
    void set_constraint(token_constraint * c) { constraint_ = c; }
    token_constraint * constraint() const { return constraint_; }
    controller & control() { return ctl_; }
    void reset();

private:
    // prefill's pass (either form): reset (n_cached 0) or check the continuation and begin the
    // controller's request, then decode prompt[n_cached, n) with the taps and push them
    decode_result prefill_pass(const int32_t * prompt, int64_t n, int64_t n_cached, bool argmax_only,
                               uint64_t regime = 0);
    // A run of ring slots [slot0, slot0 + k) taking positions [pos0, pos0 + k): no wrap inside.
    struct ring_segment {
        int64_t slot0, k, pos0, row0;  // row0: the first of the pushed rows it takes
    };
    // The segments that pushing m positions from pos0 writes (the oldest skipped when m > capacity).
    std::vector<ring_segment> ring_segments(int64_t m, int64_t pos0) const;
    // Builds the ring writes of `segs` into a graph; inputs: per segment features F32
    // [n_taps * n_embd, k] and positions I32 [k].
    // On a device the features are columns row0.. of the device queue instead of inputs.
    void build_push(const build_context & b, const std::vector<ring_segment> & segs,
                    std::vector<ggml_tensor *> & f_in, std::vector<ggml_tensor *> & pos_in, bool from_queue) const;
    void set_push_inputs(const std::vector<ring_segment> & segs, const float * feats, const std::vector<ggml_tensor *> & f_in,
                         const std::vector<ggml_tensor *> & pos_in) const;
    ggml_tensor * lm_head() const;  // the drafter's own lm_head, else the target's
    // The features a round committed are pushed by the next draft graph (one graph per round
    // fewer); anything that reads the ring or pushes out of a round flushes them first.
    void flush_features();
    // Queue m rows of features [m, n_taps * n_embd] at positions pos0.. after those pending.
    void queue_features(std::vector<float> && feats, int64_t m, int64_t pos0);

    // One drafter pass; fills the output that is given: argmax_out [B-1], logits_out
    // [B-1, n_vocab], or top1_out [B-1, 2] (top1.h: argmax and its probability).
    // topk_out: [B-1, K, 2] (top1.h: topk_op) with K entries per row. dv_logits: the logits over
    // the draft vocabulary when it is on ([B-1, its size]; sampled drafts).
    // lattice_out: DFlash 2's selector lattice [B-1, lattice_row()] (drafter.h: build_selector).
    void run_draft(int32_t last, int64_t B, int32_t * argmax_out, float * logits_out, float * top1_out = nullptr,
                   float * topk_out = nullptr, int64_t K = 0, bool dv_logits = false, float * lattice_out = nullptr);
    bool has_selector() const { return drafter_->hparams().has_selector(); }
    bool drafts_over_draft_vocab() const { return params_.draft_vocab && drafter_->draft_head; }
    // One draft graph: its sizes, inputs and output (run_draft fills the sizes, build_draft the tensors).
    struct draft_graph {
        enum output { ARGMAX, LOGITS, TOP1, TOPK, LATTICE } what = ARGMAX;
        int64_t B = 0, n_past = 0;
        int64_t rows = 0;   // block rows: B, or B - 1 for an anchor-first DSpark (drafter.h: block_rows)
        int64_t K = 0;      // TOPK: entries per row
        int64_t n_ctx = 0;  // ring slots holding context
        int64_t n_att = 0;  // ring slots attended to: context, block, masked padding
        int64_t lo = 0;     // oldest position any layer sees (the user's window)
        int64_t w = 0;      // the GGUF sliding window of its layers (0: none)
        bool sub = false;   // over the draft vocabulary's rows of the lm_head
        std::vector<ring_segment> push;  // pending features this graph writes into the ring first
        std::vector<ggml_tensor *> push_f, push_pos;
        ggml_tensor * tok = nullptr;       // I32 [rows]: last, MASK x (rows-1)
        ggml_tensor * pos = nullptr;       // I32 [rows]
        ggml_tensor * mask = nullptr;      // F16 [n_att, rows]
        ggml_tensor * mask_swa = nullptr;  // F16 [n_att, B], when w > 0
        ggml_tensor * out = nullptr;       // I32 [B-1] argmax, F32 [n_vocab, B-1] logits or F32 [2, B-1] top1
        device_head head;                  // on a device: argmax / top1 in stock ops (device_heads.h)
        ggml_tensor * conf = nullptr;      // TOP1 of a DSpark drafter with a confidence head: F32 [1, B-1]
    };
    void check_draft(int32_t last, int64_t B) const;
    void build_draft(const build_context & b, draft_graph & d) const;
    void set_draft_inputs(const draft_graph & d, int32_t last) const;
    // mask (swa: mask_swa) over ring slots [0, n_att) for each block row, [B, n_att] row-major
    void fill_draft_mask(const draft_graph & d, bool swa, std::vector<ggml_fp16_t> & m) const;
    // argmax_out: the argmax output; f32_out: the logits or top1 output
    void read_draft(const draft_graph & d, int32_t * argmax_out, float * f32_out) const;
    // read_draft's read of a device's stock head (d.head): the ids into argmax_out, or the (index,
    // p) pairs into f32_out in top1_op's / topk_op's [B-1, pairs, 2] form; a non-finite row raised
    void read_device_top(const draft_graph & d, int32_t * argmax_out, float * f32_out) const;
    // read_draft's checks on the read outputs: DSpark's confidences (conf, [B-1]) in place of the
    // top-1 p, non-finite rows raised, draft-vocabulary rows mapped to token ids
    void finish_draft(const draft_graph & d, int32_t * argmax_out, float * f32_out, const float * conf) const;
    // d's sizes for a block of B after `last` at the slot's n_past, the pending features as its
    // ring pushes (the ring counts them from here on); returns the ring's count before, which a
    // failed graph restores.
    int64_t prepare_draft(draft_graph & d, int32_t last, int64_t B);
    // The number of drafts the draft_cutoff keeps: while the running product of p stays >= it.
    int64_t cutoff_keep(const std::vector<float> & p) const;
    // round()'s drafts: all B-1 argmaxes, or those the draft_cutoff keeps
    std::vector<int32_t> draft_chain(int32_t last, int64_t B);
    // The drafter's logits for d_1..d_{B-1} as the sampler reads them, [B-1, row.n]: over the
    // draft vocabulary when it is on (row.ids its token ids), else the whole vocabulary; sets
    // row.n and row.ids (row i's logits start at i * row.n of the result).
    std::vector<float> draft_logits_for_sampling(int32_t last, int64_t B, logits_row & row);
    // Its rows' shape: n and ids (data null).
    logits_row sampling_row_shape() const;
    // r's draft, verify and rollback seconds from the round's start t0, draft end t1, verify end t2
    // and now (the end of the commit).
    static void set_times(round_result & r, double t0, double t1, double t2);
    // The draft override's tokens for this step (set_draft_override), checked: B - 1 of them, and
    // none under a constraint (before the drafts advance it); null without an override or when it
    // lets the drafter's stand. Valid until the next call.
    const std::vector<int32_t> * forced_draft(int64_t B);
    draft_override override_;
    std::vector<int32_t> forced_;
    // A tree step's plan, given the step's forced draft (forced_draft(B), asked once per step):
    // controlled, the controller's AR step or the prefix of the best-first tree it chooses; else
    // the whole tree (an AR step when the drafter fails).
    pending_step plan_tree(int32_t last, int64_t B, const sampling_params * sampling, const std::vector<int32_t> * forced,
                           bool controlled);
    // finish_step's tree verify: accept (greedy, or the target's draws by choose_token along the
    // path, with their logprobs), commit_tree, queue the path's taps; the controller observes it.
    round_result finish_tree(pending_step & s, decode_result & v, double t2);
    // d_1..d_{B-1} drawn by the sampler at positions n_past+1..; without `probs`, cut as
    // cutoff_keep cuts (the product of the drafts' probabilities under the drafter's filtered
    // distribution); with it, all B-1 and their probabilities (the controller cuts)
    std::vector<int32_t> draft_sampled(int32_t last, int64_t B, const sampling_params & p,
                                       std::vector<float> * probs = nullptr);
    // draft_sampled's draws of a DFlash 2 drafter from its selector lattice lat [B-1, lattice_row]
    // (draft_lattice's), positions n_past + 1 ..
    std::vector<int32_t> lattice_draws(const float * lat, int64_t B, const sampling_params & p, int64_t n_past,
                                       bool cut, std::vector<float> * probs) const;
    // draft_sampled's loop: d_{i+1} = draw(i) for i < B - 1, cut or with probabilities as there
    std::vector<int32_t> drawn_block(int64_t B, bool cut, std::vector<float> * probs,
                                     const std::function<sample_result(int64_t)> & draw) const;
    // The drafter's top-K tokens and probabilities at block positions 1..B-1, [B-1, K] each
    // (K = min(tree_budget, rows of the head)); returns K.
    int64_t draft_topk(int32_t last, int64_t B, std::vector<int32_t> & tok, std::vector<float> & p);
    // draft_topk's sampled form (spec_sampled.cpp): per position the K best tokens by the
    // perturbed score l / T + G(seed, pos, token) over the drafter's filtered logits, with
    // perturbed_topk's weights in place of probabilities (0 past the tokens the filters keep).
    int64_t draft_topk_sampled(int32_t last, int64_t B, const sampling_params & p, std::vector<int32_t> & tok,
                               std::vector<float> & w);
    // DFlash 2's sampled lattice (spec_sampled.cpp): lattice_probs' form [B-1, k] candidates and
    // [B-1, k, k] weights, each (row, predecessor) the perturbed_topk weights of its transition
    // scores under draft_sampled's noise, so a node's first child is draft_sampled's draw.
    void draft_lattice_sampled(int32_t last, int64_t B, const sampling_params & p, std::vector<int32_t> & cand,
                               std::vector<float> & w);
    // A round's tree: draft_topk (or its sampled form), then build_tree with the room left
    // (tree_budget at most).
    draft_tree draft_tree_for(int32_t last, int64_t B, const sampling_params * sampling,
                              const std::vector<int32_t> * forced);
    // The drafts under the constraint (spec_sampled.cpp): d_{i+1} chosen from the drafter's row i
    // masked by the grammar after d_1..d_i (argmax at temperature 0, else the draw), each accepted
    // by the constraint; ends early where the drafter's row allows nothing, or before a token that
    // would terminate the grammar (a stop token: nothing is verified after it). Fills masks_ rows
    // 0..n (row i: the mask after i drafts, the verify's row i). probs, cut: as draft_sampled's.
    // The constraint is left after all the drafts returned.
    // rows: the drafter's rows [B-1, row.n] from a pass shared with other slots (draft_batch),
    // in place of its own pass.
    std::vector<int32_t> draft_constrained(int32_t last, int64_t B, const sampling_params & p,
                                           std::vector<float> * probs = nullptr,
                                           const std::vector<float> * rows = nullptr);
    // draft_topk's form under the constraint (spec_sampled.cpp): position i's K candidates from the
    // drafter's row i masked by the grammar after the spine (the rank-0 candidates of positions
    // before it: the chain draft_constrained takes), greedy (row_topk) or by perturbed score; the
    // positions after the spine ends have weight 0. The constraint is left as it was.
    int64_t draft_topk_constrained(int32_t last, int64_t B, const sampling_params & p, std::vector<int32_t> & tok,
                                   std::vector<float> & w);
    // A tree under the constraint: the nodes whose token the grammar rejects after their parent's
    // path (and those that would terminate it) are dropped with their subtrees. The constraint ends
    // at the root's state, which the verify moves along the path (choose_constrained per row).
    void prune_tree(draft_tree & tree);
    // The grammar's state at the round's start plus its committed tokens: it holds the n_in drafts,
    // whose first committed.size() - 1 are committed; rollback of the others, then accept the last.
    void constraint_commit(int64_t n_in, const std::vector<int32_t> & committed);
    // The sampling paths' refusal of what the constraint cannot take.
    void require_unconstrained(const char * what) const;
    // A chain step's plan: the drafts (the controller's choice among them when `controlled`) or an AR
    // step (a failed drafter, the controller's AR mode).
    pending_step plan_chain(int32_t last, int64_t B, const sampling_params * sampling,
                            const std::vector<int32_t> * forced, bool controlled, const shared_draft * pre = nullptr);
    // An AR step's plan (observe: the controller measures it; not for a failed drafter's).
    pending_step plan_ar(int32_t last, const sampling_params * sampling, double t0, bool observe) const;
    // The target's choice after input row i of `v` at position pos: the in-graph argmax, else
    // choose_token's (the argmax of the row at temperature 0; `mask`: under the constraint's mask).
    int32_t choice(const pending_step & s, const decode_result & v, int64_t i, int64_t pos, const uint32_t * mask,
                   token_logprobs * lp) const;
    // Runs `draft` (a round's drafting: drafter graphs only, nothing of the target's state moves);
    // false when the drafter has failed, before or now (drafter_failure()): the step is then an
    // AR step (plan_ar). Any other error propagates.
    bool drafted(const std::function<void()> & draft);
    std::string drafter_failure_;

    target_session & target_;
    graph_runner & runner_;  // the target's: the drafter's graphs run on its backends and plans
    spec_params params_;
    std::shared_ptr<drafter_model> drafter_;  // shared by the sessions of one target's slots
    int slot_ = 0;                           // the target's sequence slot this session drafts for
    // The target with this session's slot selected (target_session::select_slot): every use of
    // the target goes through it.
    target_session & tgt() const {
        target_.select_slot(slot_);
        return target_;
    }
    std::unique_ptr<feature_ring> ring_;
    int64_t block_size_ = 0;
    controller ctl_;
    token_constraint * constraint_ = nullptr;
    // Under a constraint, a chain round's masks: [n_rows, mask_words(n_vocab)], row i the verify's row i
    std::vector<uint32_t> masks_;
    std::vector<float> pending_feats_;  // [>= pending_m_, n_taps * n_embd]: the verify's taps
    int64_t pending_m_ = 0, pending_pos0_ = 0;
    // On a device the queued rows stay there: the target's verify and AR graphs write their taps
    // into this queue (target_session::set_tap_sink) at column pending_m_, and the ring push reads
    // its columns; pending_feats_ is unused. F32 [n_taps * n_embd, Q], Q = max(64, 2 B).
    ggml_context_ptr queue_ctx_;
    ggml_backend_buffer_ptr queue_buf_;
    ggml_tensor * dev_queue_ = nullptr;
    // Before a target pass of n tokens with taps: on a device, room for n more rows in the queue
    // (pushing the queue into the ring when full) and the target's tap sink at its next column.
    void sink_taps(int64_t n);
    // On a device: the first of n free columns of the queue (pushing it into the ring when full);
    // the target's batched passes write this slot's taps there (target_session::set_slot_tap_queue).
    int64_t reserve_taps(int64_t n);
};

// A spec_session's draft override (set_draft_override) for one scope; a null session or an
// empty override leaves the session alone (the override is tested here, after it has been moved
// into the parameter: a call site's own `f ? s : nullptr` beside `std::move(f)` may see it moved).
struct draft_override_scope {
    spec_session * s;
    draft_override_scope(spec_session * s_, draft_override f) : s(f ? s_ : nullptr) {
        if (s) s->set_draft_override(std::move(f));
    }
    ~draft_override_scope() {
        if (s) s->set_draft_override(nullptr);
    }
    draft_override_scope(const draft_override_scope &) = delete;
    draft_override_scope & operator=(const draft_override_scope &) = delete;
};

inline constraint_scope::constraint_scope(spec_session * s, token_constraint * c) : s(s) {
    if (s) s->set_constraint(c);
}
inline constraint_scope::~constraint_scope() {
    if (s) s->set_constraint(nullptr);
}

}  // namespace dfn
