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
    // Log-probabilities of each committed token and of the n_logprobs most probable alternatives
    // (token_logprobs below); -1: none (the paths that skip them compute nothing extra). A request
    // that wants them at temperature 0 passes its sampling_params too: choose_token then takes the
    // argmax from the logits rows on the host instead of the argmax in the graph.
    int64_t n_logprobs = -1;
    bool greedy() const { return temperature == 0.0; }
    bool want_logprobs() const { return n_logprobs >= 0; }
};

// Most alternatives a request may ask logprobs for (OpenAI's top_logprobs and vLLM's default
// max_logprobs are 20 too).
constexpr int64_t k_max_logprobs = 20;

// input_error "[sampling] ..." for a temperature that is negative or not finite, top_k < 0,
// top_p outside (0, 1], min_p outside [0, 1), n_logprobs outside [-1, k_max_logprobs].
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
// noise_bits(seed, pos, tokens[j]) into out[j] for j < n, vectorised (the draw's main cost).
void noise_bits_block(uint64_t seed, int64_t pos, const int32_t * tokens, int64_t n, uint64_t * out);

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
// top-k kept, min-p against the largest logit; the largest logit is always kept. Top-p's
// probabilities are integers (30-bit fixed point through exp_neg, see sampler.cpp), so its sums
// are exact and the kept set does not depend on threads, ISA or the order of the terms.
std::vector<int32_t> sampling_filter(const logits_row & row, const sampling_params & p, const char * where, int64_t pos);

struct sample_result {
    int32_t token = -1;     // the token id drawn
    double logprob = 0.0;   // its log-probability under softmax(kept logits / T), when asked for
};

// The draw at position pos (p.temperature > 0). want_logprob: also fill logprob.
sample_result sample_row(const logits_row & row, const sampling_params & p, int64_t pos, const char * where,
                         bool want_logprob = false);

// One committed token's log-probabilities under the distribution it was chosen from: sampled
// (T > 0), softmax(kept logits / T) over the tokens the filters keep; greedy (T = 0), the
// log-softmax of the raw logits (vLLM's default "raw_logprobs"; the filters are not applied, as
// greedy decoding ignores them). log p_i = l_i / T - m - log(sum_kept exp(l_j / T - m)), m the
// largest l / T, the sum in ascending token order: a fixed function of the logits row, so the
// same in AR and speculative decoding (their rows are bit for bit the same).
struct token_logprobs {
    int32_t token = -1;
    double logprob = 0.0;
    // The n_logprobs most probable tokens of that distribution, most probable first (ties: the
    // lower id first); fewer when the filters keep fewer.
    std::vector<int32_t> top_tokens;   // [<= n_logprobs]
    std::vector<double> top_logprobs;  // [<= n_logprobs]
};

// The first index of the row's largest entry (choose_token's greedy choice) when no entry is NaN or
// +inf and one is above -inf; -1 otherwise (where choose_token raises).
int64_t finite_argmax(const logits_row & row);

// The committed token at position pos from its logits row: the argmax (p.greedy(): the first
// maximum, as argmax_op picks it in the graph) or sample_row's draw. lp (when given and
// p.want_logprobs()): its logprobs.
int32_t choose_token(const logits_row & row, const sampling_params & p, int64_t pos, const char * where,
                     token_logprobs * lp = nullptr);

// The K entries with the largest perturbed scores l / T + G(seed, pos, id) among the kept ones
// (p.temperature > 0): the entry indices, score descending (ties: the lower index first), and
// the softmax of their scores over those K (a rank's weight for tree drafting: non-increasing in
// rank). Entry 0 is sample_row's draw. Fewer than K when the filters keep fewer.
void perturbed_topk(const logits_row & row, const sampling_params & p, int64_t pos, int64_t K, const char * where,
                    std::vector<int32_t> & idx, std::vector<float> & weight);

}  // namespace dfn
