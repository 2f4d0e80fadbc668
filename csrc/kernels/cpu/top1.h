// Top-1 of each row of logits, with its softmax probability: what draft_cutoff reads from the
// drafter, computed in the graph instead of copying B-1 rows of n_vocab logits out.
#pragma once

#include "ggml.h"

#include <cstdint>

namespace dfn {

// Every row op below marks a row holding a NaN or an inf with the index -1 (found in the pass
// that finds the maximum, so it costs no extra read of the logits); callers turn it into
// throw_non_finite_logits instead of committing a meaningless token.

// logits [n_vocab, n] -> F32 [2, n]: (argmax as a float, exactly as ggml_argmax picks it: the
// first maximum; p = 1 / sum_j exp(l_j - l_max)). p comes from a fast exp (p within 2e-5
// relative): it only decides how many drafts to verify, never which tokens are committed.
ggml_tensor * top1_op(ggml_context * ctx, ggml_tensor * logits);

// logits [n_vocab, n] -> F32 [2, K, n]: per row its K most probable entries (index as a float,
// p), probability descending, ties by index ascending; p as top1_op's (the first entry is
// top1_op's pair exactly, the others exp(l - l_max) / sum). Tree verify's per-position top-K.
ggml_tensor * topk_op(ggml_context * ctx, ggml_tensor * logits, int64_t K);

// logits [n_vocab, n] -> I32 [n]: each row's first maximum (ggml_argmax's pick), rows split over
// the threads and the max vectorised (ggml_argmax runs the rows on one thread, scalar).
ggml_tensor * argmax_op(ggml_context * ctx, ggml_tensor * logits);

// The same for one row (tests compare it against a float64 softmax).
void top1_row(const float * l, int64_t n, int64_t & arg, float & p);
int64_t argmax_row(const float * l, int64_t n);
// out: K (index, p) pairs; a non-finite row gives index -1 in the first pair.
void topk_row(const float * l, int64_t n, int64_t K, float * out);

// RuntimeError "[where] non-finite logits (NaN or inf) at position pos: ...": one message for
// every path that reads logits (decode, verify, draft, eval).
[[noreturn]] void throw_non_finite_logits(const char * where, int64_t pos);

}  // namespace dfn
