#include "sampler.h"

#include "common.h"
#include "cpu_isa.h"
#include "top1.h"

#include <algorithm>
#include <cmath>

namespace dfn {

void check_sampling_params(const sampling_params & p) {
    DFN_REQUIRE(std::isfinite(p.temperature) && p.temperature >= 0.0, "sampling",
                "temperature must be a finite number >= 0 (0: greedy), got ", p.temperature);
    DFN_REQUIRE(p.top_k >= 0, "sampling", "top_k must be >= 0 (0: off), got ", p.top_k);
    DFN_REQUIRE(p.top_p > 0.0 && p.top_p <= 1.0, "sampling", "top_p must be in (0, 1] (1: off), got ", p.top_p);
    DFN_REQUIRE(p.min_p >= 0.0 && p.min_p < 1.0, "sampling", "min_p must be in [0, 1) (0: off), got ", p.min_p);
    DFN_REQUIRE(p.n_logprobs >= -1 && p.n_logprobs <= k_max_logprobs, "sampling", "logprobs must be in [0, ",
                k_max_logprobs, "] (-1: off), got ", p.n_logprobs);
}

// ---- noise ----------------------------------------------------------------------------------------

void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {  // the key schedule: a Weyl sequence, bumped before every round but the first
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t) 0xD2511F53u * c0, p1 = (uint64_t) 0xCD9E8D57u * c2;
        const uint32_t hi0 = (uint32_t) (p0 >> 32), lo0 = (uint32_t) p0, hi1 = (uint32_t) (p1 >> 32), lo1 = (uint32_t) p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

uint64_t noise_bits(uint64_t seed, int64_t pos, int32_t token) {
    const uint64_t up = (uint64_t) pos;
    const uint32_t ctr[4] = {(uint32_t) up, (uint32_t) (up >> 32), (uint32_t) token, 0u};
    const uint32_t key[2] = {(uint32_t) seed, (uint32_t) (seed >> 32)};
    uint32_t out[4];
    philox4x32_10(ctr, key, out);
    return ((((uint64_t) out[0]) << 32) | out[1]) >> 12;
}

double gumbel_of_bits(uint64_t bits) {
    // bits + 0.5 < 2^52 fits a double's 53-bit mantissa: U is exact, never 0 or 1
    const double u = ((double) bits + 0.5) * 0x1p-52;
    return -std::log(-std::log(u));
}

namespace {

// ---- filters --------------------------------------------------------------------------------------

// The row's largest logit and its first index; NaN or +inf, or a row without a finite logit, raise.
int64_t checked_argmax(const logits_row & row, const char * where, int64_t pos) {
    int64_t best = -1;
    for (int64_t i = 0; i < row.n; ++i) {
        const float x = row.l[i];
        if (std::isnan(x) || x == INFINITY) throw_non_finite_logits(where, pos);
        if (x > -INFINITY && (best < 0 || x > row.l[best])) best = i;
    }
    if (best < 0) throw runtime_error(cat("[", where, "] every logit is -inf at position ", pos, ": nothing to sample"));
    return best;
}

// Sort order of the filters: larger logit first, the lower index first among equal logits (a total
// order, so the kept set never depends on the sort algorithm).
struct by_logit {
    const float * l;
    bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

void filter_top_k(const float * l, int64_t k, std::vector<int32_t> & kept) {
    if (k <= 0 || k >= (int64_t) kept.size()) return;
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), by_logit{l});
    kept.resize(k);
    std::sort(kept.begin(), kept.end());
}

// Keeps the shortest prefix, in by_logit order, whose probability mass reaches top_p. The
// probabilities are exp(l - l_max) / Z with Z summed over `kept` in ascending index order, and the
// mass is summed along the prefix, so the cut is a fixed function of the logits.
// Only candidates are ordered: the tokens within a distance of l_max picked from a histogram of
// (l_max - l) in half-nat buckets, so that the tokens left out hold at most half of 1 - top_p.
// They are a by_logit prefix (exp rises with l), so the walk over them adds the same terms in the
// same order as a walk over every token, and the cut falls among them (in exact arithmetic; if
// rounding says otherwise, every token is walked). A broad row keeps a few hundred tokens of n.
void filter_top_p(const float * l, double l_max, double top_p, std::vector<int32_t> & kept) {
    if (top_p >= 1.0) return;
    const size_t n = kept.size();
    std::vector<double> e(n);
    double z = 0.0;
    for (size_t j = 0; j < n; ++j) {
        e[j] = std::exp((double) l[kept[j]] - l_max);
        z += e[j];
    }
    constexpr int k_buckets = 128;  // half-nat buckets of l_max - l; the last one takes the rest
    const auto bucket = [&](size_t j) {
        const double d = 2.0 * (l_max - (double) l[kept[j]]);
        return d >= k_buckets - 1 ? k_buckets - 1 : (int) d;
    };
    double in_bucket[k_buckets] = {};
    for (size_t j = 0; j < n; ++j) in_bucket[bucket(j)] += e[j];
    const double left_out = 0.5 * (1.0 - top_p) * z;
    double tail = 0.0;
    int last = k_buckets - 1;  // candidates: buckets 0..last
    while (last > 0 && tail + in_bucket[last] <= left_out) tail += in_bucket[last--];

    struct cand_t {
        float l;
        int32_t id;
        double e;
    };
    const auto first = [](const cand_t & a, const cand_t & b) { return a.l > b.l || (a.l == b.l && a.id < b.id); };
    std::vector<cand_t> cand;
    for (size_t j = 0; j < n; ++j) {
        if (bucket(j) <= last) cand.push_back({l[kept[j]], kept[j], e[j]});
    }
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) {  // rounding kept the mass of the candidates below top_p: walk every token
            cand.clear();
            for (size_t j = 0; j < n; ++j) cand.push_back({l[kept[j]], kept[j], e[j]});
        }
        std::sort(cand.begin(), cand.end(), first);
        double mass = 0.0;
        for (size_t j = 0; j < cand.size(); ++j) {
            mass += cand[j].e / z;
            if (mass >= top_p) {
                kept.resize(j + 1);
                for (size_t i = 0; i <= j; ++i) kept[i] = cand[i].id;
                std::sort(kept.begin(), kept.end());
                return;
            }
        }
    }
    // the whole mass rounds below top_p: every token stays
}

void filter_min_p(const float * l, double l_max, double min_p, std::vector<int32_t> & kept) {
    if (min_p <= 0.0) return;
    // p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p); the maximum (0 >= log(min_p)) stays
    const double lim = std::log(min_p);
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](int32_t i) { return (double) l[i] - l_max < lim; }),
               kept.end());
}

std::vector<int32_t> filter(const logits_row & row, const sampling_params & p, int64_t i_max) {
    std::vector<int32_t> kept;
    kept.reserve(row.n);
    for (int64_t i = 0; i < row.n; ++i) {
        if (row.l[i] > -INFINITY) kept.push_back((int32_t) i);
    }
    const double l_max = row.l[i_max];
    filter_top_k(row.l, p.top_k, kept);
    filter_top_p(row.l, l_max, p.top_p, kept);
    filter_min_p(row.l, l_max, p.min_p, kept);
    return kept;
}

// ---- the draw -------------------------------------------------------------------------------------

// Noise bits at or below this give G <= k_prune_gumbel (G rises with the bits); above it come 1 in
// 1024 draws. A token whose l/T lies more than k_prune_gumbel below the best score so far can only
// win with such bits, so for most tokens the draw computes Philox and skips the two logs.
constexpr uint64_t k_prune_bits = (1ull << 52) - (1ull << 42);

double prune_gumbel() {
    // G(k_prune_bits) plus a margin that covers any rounding wiggle of log's monotonicity: the test
    // below stays conservative, and the draw equals the plain argmax over every kept token
    static const double g = gumbel_of_bits(k_prune_bits) + 1e-9;
    return g;
}

// noise_bits(seed, pos, tokens[j]) for j < n: the same Philox rounds as philox4x32_10, written
// over a block of tokens so that the compiler runs them in vector lanes (the draw's main cost).
DFN_MULTIVERSION(void, noise_bits_block,
                 (uint64_t seed, int64_t pos, const int32_t * tokens, int64_t n, uint64_t * out),
                 (seed, pos, tokens, n, out)) {
    const uint32_t p0 = (uint32_t) (uint64_t) pos, p1 = (uint32_t) ((uint64_t) pos >> 32);
    const uint32_t key0 = (uint32_t) seed, key1 = (uint32_t) (seed >> 32);
    for (int64_t j = 0; j < n; ++j) {
        uint32_t c0 = p0, c1 = p1, c2 = (uint32_t) tokens[j], c3 = 0u, k0 = key0, k1 = key1;
        for (int r = 0; r < 10; ++r) {
            const uint64_t m0 = (uint64_t) 0xD2511F53u * c0, m1 = (uint64_t) 0xCD9E8D57u * c2;
            const uint32_t n0 = (uint32_t) (m1 >> 32) ^ c1 ^ k0, n2 = (uint32_t) (m0 >> 32) ^ c3 ^ k1;
            c1 = (uint32_t) m1;
            c3 = (uint32_t) m0;
            c0 = n0;
            c2 = n2;
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        out[j] = ((((uint64_t) c0) << 32) | c1) >> 12;
    }
}

// The K best kept entries by l/T + G(seed, pos, id), score descending, the lower index first
// among equal scores: (entry, score) pairs in `top`.
void gumbel_topk(const logits_row & row, const std::vector<int32_t> & kept, int64_t i_max, double T, uint64_t seed,
                 int64_t pos, int64_t K, std::vector<std::pair<int32_t, double>> & top) {
    const double g_prune = prune_gumbel();
    auto before = [](const std::pair<int32_t, double> & a, const std::pair<int32_t, double> & b) {
        return a.second > b.second || (a.second == b.second && a.first < b.first);
    };
    top.assign(1, {(int32_t) i_max, (double) row.l[i_max] / T + gumbel(seed, pos, row.id(i_max))});  // kept by every filter
    // s_K: the score an entry must beat once K are held. l < l_lim implies l/T + g_prune < s_K
    // (the relative margin covers the rounding of both sides), so the test needs no division for
    // the tokens it skips.
    auto lim = [&] {
        if ((int64_t) top.size() < K) return (double) -INFINITY;
        const double s_k = top.back().second;
        return (s_k - g_prune - 1e-9 * (1.0 + std::fabs(s_k))) * T;
    };
    double l_lim = lim();
    constexpr int64_t k_block = 256;
    int32_t ids[k_block];
    uint64_t bits[k_block];
    for (size_t j0 = 0; j0 < kept.size(); j0 += k_block) {
        const int64_t nb = std::min<int64_t>(k_block, (int64_t) (kept.size() - j0));
        for (int64_t j = 0; j < nb; ++j) ids[j] = row.id(kept[j0 + j]);
        noise_bits_block(seed, pos, ids, nb, bits);
        for (int64_t j = 0; j < nb; ++j) {
            const int32_t i = kept[j0 + j];
            // bits at or below k_prune_bits give a score <= l/T + G(k_prune_bits) < s_K
            if (i == i_max || (bits[j] <= k_prune_bits && (double) row.l[i] < l_lim)) continue;
            const std::pair<int32_t, double> c{i, (double) row.l[i] / T + gumbel_of_bits(bits[j])};
            if ((int64_t) top.size() == K && !before(c, top.back())) continue;
            top.insert(std::upper_bound(top.begin(), top.end(), c, before), c);
            if ((int64_t) top.size() > K) top.pop_back();
            l_lim = lim();
        }
    }
}

// argmax over the kept entries of l/T + G(seed, pos, id); among equal scores the lower index.
int64_t gumbel_argmax(const logits_row & row, const std::vector<int32_t> & kept, int64_t i_max, double T,
                      uint64_t seed, int64_t pos) {
    std::vector<std::pair<int32_t, double>> top;
    gumbel_topk(row, kept, i_max, T, seed, pos, 1, top);
    return top[0].first;
}

// token_logprobs of entry i under softmax(kept l / T), with the n_top most probable kept entries
void fill_logprobs(const logits_row & row, const std::vector<int32_t> & kept, int64_t i_max, double T, int64_t i,
                   int64_t n_top, token_logprobs & out) {
    const double m = (double) row.l[i_max] / T;
    double z = 0.0;
    for (int32_t j : kept) z += std::exp((double) row.l[j] / T - m);
    const double log_z = std::log(z);
    out.token = row.id(i);
    out.logprob = (double) row.l[i] / T - m - log_z;
    out.top_tokens.clear();
    out.top_logprobs.clear();
    if (n_top <= 0) return;
    // T > 0: the order of l / T is the order of l (by_logit); ties by the lower entry, which is
    // the lower id (draft-vocabulary ids ascend with the entries)
    std::vector<int32_t> order(kept);
    const int64_t n = std::min<int64_t>(n_top, (int64_t) order.size());
    std::partial_sort(order.begin(), order.begin() + n, order.end(), by_logit{row.l});
    out.top_tokens.resize(n);
    out.top_logprobs.resize(n);
    for (int64_t k = 0; k < n; ++k) {
        out.top_tokens[k] = row.id(order[k]);
        out.top_logprobs[k] = (double) row.l[order[k]] / T - m - log_z;
    }
}

}  // namespace

std::vector<int32_t> sampling_filter(const logits_row & row, const sampling_params & p, const char * where, int64_t pos) {
    return filter(row, p, checked_argmax(row, where, pos));
}

sample_result sample_row(const logits_row & row, const sampling_params & p, int64_t pos, const char * where,
                         bool want_logprob) {
    DFN_REQUIRE(p.temperature > 0.0, where, "sampling needs a temperature > 0 (0 is greedy: take the argmax)");
    sampling_params q = p;
    q.n_logprobs = want_logprob ? 0 : -1;
    token_logprobs lp;
    sample_result r;
    r.token = choose_token(row, q, pos, where, &lp);
    r.logprob = lp.logprob;
    return r;
}

int32_t choose_token(const logits_row & row, const sampling_params & p, int64_t pos, const char * where,
                     token_logprobs * lp) {
    const int64_t i_max = checked_argmax(row, where, pos);
    const bool want = lp && p.want_logprobs();
    if (p.greedy()) {
        if (want) {
            std::vector<int32_t> all;  // the raw distribution: every token with a finite logit
            all.reserve(row.n);
            for (int64_t i = 0; i < row.n; ++i) {
                if (row.l[i] > -INFINITY) all.push_back((int32_t) i);
            }
            fill_logprobs(row, all, i_max, 1.0, i_max, p.n_logprobs, *lp);
        }
        return row.id(i_max);
    }
    const std::vector<int32_t> kept = filter(row, p, i_max);
    const int64_t i = gumbel_argmax(row, kept, i_max, p.temperature, p.seed, pos);
    if (want) fill_logprobs(row, kept, i_max, p.temperature, i, p.n_logprobs, *lp);
    return row.id(i);
}

void perturbed_topk(const logits_row & row, const sampling_params & p, int64_t pos, int64_t K, const char * where,
                    std::vector<int32_t> & idx, std::vector<float> & weight) {
    DFN_REQUIRE(p.temperature > 0.0 && K >= 1, where, "perturbed_topk needs a temperature > 0 and K >= 1");
    const int64_t i_max = checked_argmax(row, where, pos);
    std::vector<std::pair<int32_t, double>> top;
    gumbel_topk(row, filter(row, p, i_max), i_max, p.temperature, p.seed, pos, K, top);
    idx.resize(top.size());
    weight.resize(top.size());
    double z = 0.0;
    for (const auto & t : top) z += std::exp(t.second - top[0].second);
    for (size_t k = 0; k < top.size(); ++k) {
        idx[k] = top[k].first;
        weight[k] = (float) (std::exp(top[k].second - top[0].second) / z);
    }
}

}  // namespace dfn
