// A first engine over several sequences (issue 35): greedy chain rounds for the n_seq slots of a
// target session, each step one drafter pass over every decoding slot's block and one target pass
// over their verifies and the prompt chunks of the slots still prefilling
// (target_session::decode_batch). Requests join (start) and leave (they finish, or are released)
// between steps. Each request's tokens are its greedy AR tokens, as a one-sequence engine gives
// them (docs/architecture.md, "Batched target"); its drafts are a one-sequence spec_session's, for
// every drafter kind (DFlash, DFlash 2's selector walk, DSpark's rows and Markov head). Not yet
// behind Engine, the server or the C API.
#pragma once

#include "kernels/cpu/matmul/matmul.h"
#include "models/drafter.h"
#include "runtime/session.h"

#include <memory>
#include <string>
#include <vector>

namespace dfn {

struct batch_engine_params {
    int64_t block_size = 0;      // B, verified tokens per round; 0: the drafter's
    int64_t prefill_chunk = 32;  // prompt tokens per slot per step
    // tokens per target pass: the matmul's batch-invariant width (at most the target's n_batch)
    int64_t max_step_tokens = k_matmul_max_cols;
};

class batch_engine {
public:
    // target: a session with n_seq slots and max_verify >= the block size. The drafter's ring per
    // slot holds the whole context (n_ctx positions: it never wraps).
    batch_engine(target_session & target, const std::string & drafter_path, const batch_engine_params & p);
    ~batch_engine();

    // Admits a request (prompt tokens, at most max_tokens tokens out) into a free slot; returns it.
    int start(const std::vector<int32_t> & prompt, int64_t max_tokens);
    // One step over the active requests: a drafter pass over the decoding slots' blocks, then one
    // target pass over their verifies and prompt chunks. Returns the number of requests still active.
    int step();
    // A slot's request: finished (max_tokens, or the next block would not fit n_ctx), its tokens.
    bool finished(int slot) const;
    const std::vector<int32_t> & output(int slot) const;
    // Per round of the slot's request: the drafts verified and the tokens committed (tests).
    struct round_record {
        std::vector<int32_t> draft, committed;
    };
    const std::vector<round_record> & rounds(int slot) const;
    // Frees a slot (its caches and ring emptied) for the next request.
    void release(int slot);
    int64_t block_size() const { return B_; }
    int n_slots() const { return (int) slots_.size(); }
    // Target passes and the tokens they ran, summed over the engine's life (benchmarks).
    int64_t n_steps = 0, n_step_tokens = 0;

private:
    struct slot_state;
    slot_state & at(int slot);
    const slot_state & at(int slot) const;
    // The drafter pass: each slot's queued features into its ring, then the blocks; returns the
    // drafts, B-1 per slot in `slots` order.
    std::vector<int32_t> draft(const std::vector<int> & slots);
    void finish_if_done(slot_state & s);

    target_session & target_;
    batch_engine_params params_;
    std::unique_ptr<drafter_model> drafter_;
    int64_t B_ = 0;
    std::vector<std::unique_ptr<slot_state>> slots_;
};

}  // namespace dfn
