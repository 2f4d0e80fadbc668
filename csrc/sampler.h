// Seeded sampling that draws the same token in every decoding mode: the filters (top-k, top-p,
// min-p), then a Gumbel-max draw over noise that depends only on (seed, position, token id).
//
// The draw at sequence position p is  argmax over the kept tokens i of  l_i / T + G(seed, p, i),
// which samples softmax(kept logits / T) (the Gumbel-max trick). Because G is a pure function of
// its three arguments (no generator state), an AR step, a verify row and a replay after rollback
// all see the same noise at a position: given the same logits (the verify computes them bit for
// bit as the AR step does), they draw the same token. The drafter draws its proposal with the
// same noise over its own logits, so it agrees with the target whenever the two perturbed
// argmaxes coincide.
#pragma once

#include <cstdint>
#include <vector>

namespace dfn {

struct sampling_params {
    double temperature = 0.0;  // 0: greedy (callers take the in-graph argmax; the sampler is not used)
    int64_t top_k = 0;         // keep the k largest logits (0: off)
    double top_p = 1.0;        // keep the most probable tokens while their mass < top_p, and the one reaching it (1: off)
    double min_p = 0.0;        // keep tokens whose probability is >= min_p times the largest one (0: off)
    uint64_t seed = 0;
    bool greedy() const { return temperature == 0.0; }
};

// input_error "[sampling] ..." for a temperature that is negative or not finite, top_k < 0,
// top_p outside (0, 1], min_p outside [0, 1).
void check_sampling_params(const sampling_params & p);

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, out = bijection_key(ctr).
void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

// 52 random bits for (seed, pos, token): Philox4x32-10 keyed by the seed (low word first) at
// counter (pos low word, pos high word, token, 0); the top 52 bits of out[0]:out[1].
uint64_t noise_bits(uint64_t seed, int64_t pos, int32_t token);
// U = (bits + 0.5) / 2^52, exact and inside (0, 1); G = -log(-log(U)), in [-3.6, 36.4].
double gumbel_of_bits(uint64_t bits);
inline double gumbel(uint64_t seed, int64_t pos, int32_t token) { return gumbel_of_bits(noise_bits(seed, pos, token)); }

// One row of logits, as the sampler sees it. `ids` gives the token id of each entry (the drafter's
// draft vocabulary: ascending ids), or nullptr when entry i is token i. NaN and +inf raise
// RuntimeError "[where] non-finite logits ..."; -inf marks a token that is never drawn (a row of
// only -inf raises too).
struct logits_row {
    const float * l;
    int64_t n;
    const int32_t * ids = nullptr;
    int32_t id(int64_t i) const { return ids ? ids[i] : (int32_t) i; }
};

// The entries the filters keep, ascending. Order of the filters as llama.cpp's chain: top-k
// (ties broken by the lower index), top-p over the softmax of the raw logits (T = 1) of the tokens
// top-k kept, min-p against the largest logit; the largest logit is always kept. Every sum runs
// in a fixed order (see sampler.cpp), so the kept set does not depend on threads or sort details.
std::vector<int32_t> sampling_filter(const logits_row & row, const sampling_params & p, const char * where, int64_t pos);

struct sample_result {
    int32_t token = -1;     // the token id drawn
    double logprob = 0.0;   // its log-probability under softmax(kept logits / T), when asked for
};

// The draw at position pos (p.temperature > 0). want_logprob: also fill logprob.
sample_result sample_row(const logits_row & row, const sampling_params & p, int64_t pos, const char * where,
                         bool want_logprob = false);

}  // namespace dfn
