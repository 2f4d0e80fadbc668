// Structured output: a grammar's say over the next token (a JSON schema, a regex, an EBNF grammar).
// The grammar engine itself lives outside the core (Python: xgrammar's GrammarMatcher behind
// dflash_native/constraint.py); the core sees it through token_constraint, and applies its masks
// to logits rows before every argmax or draw: the AR step, every verify row (chain or tree) and
// the drafter's choice of each draft.
//
// Exactness: a verify row's mask is the grammar's state after the drafted path up to that row,
// which on the accepted prefix is the state AR had at that position; the row's logits are AR's
// bit for bit, so the masked argmax (or the seeded draw over the masked row) is AR's token.
#pragma once

#include "kernels/cpu/sampler.h"

#include <cstdint>
#include <vector>

namespace dfn {

// One request's grammar state: the tokens accepted so far. A mask is a bitmask of
// mask_words(n_vocab) words, bit (t % 32) of word t / 32 set when token t is allowed
// (xgrammar's layout: int32 [ceil(n_vocab / 32)]).
struct token_constraint {
    virtual ~token_constraint() = default;
    // the tokens allowed next, into mask [n_words]; all zero once terminated
    virtual void fill_mask(uint32_t * mask, int64_t n_words) = 0;
    // advance by one token; false (the state unchanged) when the grammar rejects it. It takes
    // exactly the tokens fill_mask would allow (choose_constrained and prune_tree test a token by
    // accept alone, without a mask)
    virtual bool accept(int32_t token) = 0;
    // undo the last n accepted tokens
    virtual void rollback(int64_t n) = 0;
    // a stop token was accepted: nothing may follow
    virtual bool terminated() = 0;
};

inline int64_t mask_words(int64_t n_vocab) { return (n_vocab + 31) / 32; }
inline bool mask_allows(const uint32_t * mask, int32_t t) { return (mask[t >> 5] >> (t & 31)) & 1u; }

// row with -inf at the entries whose token (row.id) the mask leaves out, in buf; n_allowed: the
// entries left (0: the row allows nothing)
logits_row mask_row(const logits_row & row, const uint32_t * mask, std::vector<float> & buf, int64_t * n_allowed);

// choose_token over the masked row; runtime_error "[where] the constraint allows no token at
// position pos" when the mask leaves nothing of the row
int32_t choose_masked(const logits_row & row, const uint32_t * mask, const sampling_params & p, int64_t pos,
                      const char * where, token_logprobs * lp = nullptr);

// The K entries of the row with the largest logits (those above -inf; fewer when fewer are), logit
// descending, ties by the lower index, with their probabilities under softmax over the row's
// entries above -inf: a masked row's greedy top-K (constrained tree drafts).
void row_topk(const logits_row & row, int64_t K, std::vector<int32_t> & idx, std::vector<float> & prob);

// The committed token of an AR step under c: c's mask, choose_masked, then c accepts it. Greedy
// without logprobs, the row's argmax is tried by c.accept first: the mask is made only when the
// grammar rejects it.
int32_t choose_constrained(token_constraint & c, const logits_row & row, const sampling_params & p, int64_t pos,
                           const char * where, token_logprobs * lp = nullptr);
// An AR step's committed token: choose_constrained under c (which then holds it), or choose_token
// without one.
int32_t choose_next(token_constraint * c, const logits_row & row, const sampling_params & p, int64_t pos,
                    const char * where, token_logprobs * lp = nullptr);

}  // namespace dfn
