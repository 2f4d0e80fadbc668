#include "kernels/cpu/sampler.h"

#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/top1.h"
#include "kernels/cpu/vmath.h"

#include <algorithm>
#if DFN_X86_GCC
#include <immintrin.h>
#endif
#include <cmath>
#include <numeric>

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

// noise_bits(seed, pos, tokens[j]) for j < n: the rounds of philox4x32_10 over a block of tokens.
// The portable form runs the tokens round by round so that the compiler puts them in vector lanes;
// AVX-512 runs 4 x 16 tokens in registers through all rounds (philox_avx512 below).
constexpr int64_t k_block = 256;

DFN_MULTIVERSION(void, noise_bits_lanes,
                 (uint64_t seed, int64_t pos, const int32_t * tokens, int64_t n, uint64_t * out),
                 (seed, pos, tokens, n, out)) {
    const uint32_t p0 = (uint32_t) (uint64_t) pos, p1 = (uint32_t) ((uint64_t) pos >> 32);
    uint32_t k0 = (uint32_t) seed, k1 = (uint32_t) (seed >> 32);
    uint32_t c0[k_block], c1[k_block], c2[k_block], c3[k_block];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) c0[j] = p0, c1[j] = p1, c2[j] = (uint32_t) tokens[j], c3[j] = 0u;
    for (int r = 0; r < 10; ++r) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
            const uint64_t m0 = (uint64_t) 0xD2511F53u * c0[j], m1 = (uint64_t) 0xCD9E8D57u * c2[j];
            const uint32_t n0 = (uint32_t) (m1 >> 32) ^ c1[j] ^ k0, n2 = (uint32_t) (m0 >> 32) ^ c3[j] ^ k1;
            c1[j] = (uint32_t) m1;
            c3[j] = (uint32_t) m0;
            c0[j] = n0;
            c2[j] = n2;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = ((((uint64_t) c0[j]) << 32) | c1[j]) >> 12;
}

#if DFN_X86_GCC
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512 shift intrinsics
// 32-bit lanes x 16: (hi, lo) of the 64-bit products m * c per lane. vpmuludq multiplies the even
// lanes; the odd ones are shifted down first, and the halves are blended back into place.
static inline __attribute__((always_inline)) void mul_hi_lo(__m512i c, __m512i m, __m512i & hi, __m512i & lo) {
    const __m512i e = _mm512_mul_epu32(c, m), o = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(e, 32), o);
    lo = _mm512_mask_blend_epi32(0xAAAA, e, _mm512_slli_epi64(o, 32));
}

static void philox_avx512(uint64_t seed, int64_t pos, const int32_t * tokens, int64_t n, uint64_t * out) {
    constexpr int G = 4;  // independent groups of 16 tokens in flight (hides the multiply latency)
    const __m512i M0 = _mm512_set1_epi64(0xD2511F53u), M1 = _mm512_set1_epi64(0xCD9E8D57u);
    const __m512i P0 = _mm512_set1_epi32((int32_t) (uint32_t) (uint64_t) pos);
    const __m512i P1 = _mm512_set1_epi32((int32_t) (uint32_t) ((uint64_t) pos >> 32));
    // output order: 64-bit lane i of the first half = (c0[i] << 32) | c1[i], i < 8; then i + 8
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t j0 = 0; j0 < n; j0 += 16 * G) {
        __m512i c0[G], c1[G], c2[G], c3[G];
        for (int g = 0; g < G; ++g) {
            const int64_t at = j0 + 16 * g, m = std::max<int64_t>(0, std::min<int64_t>(16, n - at));
            c0[g] = P0;
            c1[g] = P1;
            c2[g] = _mm512_maskz_loadu_epi32((__mmask16) ((1u << m) - 1u), tokens + (m > 0 ? at : 0));
            c3[g] = _mm512_setzero_si512();
        }
        uint32_t k0 = (uint32_t) seed, k1 = (uint32_t) (seed >> 32);
        for (int r = 0; r < 10; ++r) {
            const __m512i K0 = _mm512_set1_epi32((int32_t) k0), K1 = _mm512_set1_epi32((int32_t) k1);
            for (int g = 0; g < G; ++g) {
                __m512i hi0, lo0, hi1, lo1;
                mul_hi_lo(c0[g], M0, hi0, lo0);
                mul_hi_lo(c2[g], M1, hi1, lo1);
                c0[g] = _mm512_ternarylogic_epi32(hi1, c1[g], K0, 0x96);  // hi1 ^ c1 ^ k0
                c2[g] = _mm512_ternarylogic_epi32(hi0, c3[g], K1, 0x96);  // hi0 ^ c3 ^ k1
                c1[g] = lo1;
                c3[g] = lo0;
            }
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        for (int g = 0; g < G; ++g) {
            const int64_t at = j0 + 16 * g, m = std::min<int64_t>(16, n - at);
            if (m <= 0) break;
            const __m512i a = _mm512_srli_epi64(_mm512_permutex2var_epi32(c1[g], lo_idx, c0[g]), 12);
            const __m512i b = _mm512_srli_epi64(_mm512_permutex2var_epi32(c1[g], hi_idx, c0[g]), 12);
            _mm512_mask_storeu_epi64(out + at, (__mmask8) ((1u << std::min<int64_t>(m, 8)) - 1u), a);
            if (m > 8) _mm512_mask_storeu_epi64(out + at + 8, (__mmask8) ((1u << (m - 8)) - 1u), b);
        }
    }
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

void noise_bits_block(uint64_t seed, int64_t pos, const int32_t * tokens, int64_t n, uint64_t * out) {
#if DFN_X86_GCC
    if (isa_in_use() == isa_level::avx512) return philox_avx512(seed, pos, tokens, n, out);
#endif
    for (int64_t j0 = 0; j0 < n; j0 += k_block) noise_bits_lanes(seed, pos, tokens + j0, std::min(k_block, n - j0), out + j0);
}

namespace {

// ---- filters --------------------------------------------------------------------------------------

// The row's largest logit and, in the same pass, how many entries are NaN or +inf and how many
// are -inf (counts, so the loop vectorises).
DFN_MULTIVERSION(float, scan_row, (const float * l, int64_t n, int64_t & n_bad, int64_t & n_neg_inf),
                 (l, n, n_bad, n_neg_inf)) {
    float mx = -INFINITY;
    int64_t bad = 0, ninf = 0;
#pragma omp simd reduction(max : mx) reduction(+ : bad, ninf)
    for (int64_t j = 0; j < n; ++j) {
        const float x = l[j];
        mx = x > mx ? x : mx;
        bad += (x != x) | (x == INFINITY);
        ninf += x == -INFINITY;
    }
    n_bad = bad;
    n_neg_inf = ninf;
    return mx;
}

// The first index of mx, which the row holds.
int64_t first_of(const logits_row & row, float mx) {
    int64_t best = 0;
    while (!(row.l[best] == mx)) ++best;
    return best;
}

// The row's largest logit and its first index; NaN or +inf, or a row without a finite logit,
// raise. all_finite: no -inf entry either.
int64_t checked_argmax(const logits_row & row, const char * where, int64_t pos, bool * all_finite = nullptr) {
    int64_t n_bad = 0, n_neg_inf = 0;
    const float mx = row.n > 0 ? scan_row(row.l, row.n, n_bad, n_neg_inf) : -INFINITY;
    if (n_bad > 0) throw_non_finite_logits(where, pos);
    if (mx == -INFINITY) throw runtime_error(cat("[", where, "] every logit is -inf at position ", pos, ": nothing to sample"));
    if (all_finite) *all_finite = n_neg_inf == 0;
    return first_of(row, mx);
}

// Sort order of the filters: larger logit first, the lower index first among equal logits (a total
// order, so the kept set never depends on the sort algorithm).
struct by_logit {
    const float * l;
    bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

// Buckets of the distance below the largest logit, d = l_max - l (float): bucket floor(8 d) for
// d < 64, the last one above. d rises as l falls, so the buckets come in by_logit order.
constexpr int k_buckets = 513;

static inline int32_t bucket(float l_max, float l) {
    const float d = l_max - l;
    return (int32_t) ((d < 64.0f ? d : 64.0f) * 8.0f);  // 64 -> k_buckets - 1
}

DFN_MULTIVERSION(void, bucket_of, (const float * x, int64_t n, float l_max, int32_t * out), (x, n, l_max, out)) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = bucket(l_max, x[j]);
}

// The logits of the kept entries, contiguous: l itself when every entry is kept (all), else
// gathered into `scratch`.
const float * kept_logits(const float * l, const std::vector<int32_t> & kept, bool all, std::vector<float> & scratch) {
    if (all) return l;
    scratch.resize(kept.size());
    for (size_t j = 0; j < kept.size(); ++j) scratch[j] = l[kept[j]];
    return scratch.data();
}

// Keeps the shortest prefix of `kept` in by_logit order whose integer weights (w[j] >= 0 for
// kept[j]) sum to at least need (1 <= need <= their total); kept stays ascending. The sums are of
// integers, so they are exact and do not depend on the order of the terms: only the tokens of the
// bucket where the sum reaches need are sorted, and the cut is where a walk over every token in
// by_logit order would put it. x: the kept entries' logits, contiguous (kept_logits). w null:
// every weight is 1 (top-k).
void keep_prefix_reaching(const float * l, const float * x, float l_max, std::vector<int32_t> & kept,
                          const int32_t * w, int64_t need) {
    const int64_t n = (int64_t) kept.size();
    thread_local std::vector<int32_t> b;  // scratch, reused across draws
    b.resize(n);
    bucket_of(x, n, l_max, b.data());
    int64_t in_bucket[k_buckets] = {};
    if (w) {
        for (int64_t j = 0; j < n; ++j) in_bucket[b[j]] += w[j];
    } else {
        for (int64_t j = 0; j < n; ++j) in_bucket[b[j]] += 1;
    }
    int64_t acc = 0;
    int cut = 0;  // the bucket where the prefix sum reaches need
    while (cut < k_buckets - 1 && acc + in_bucket[cut] < need) acc += in_bucket[cut++];
    // edge: the cut bucket's (entry, weight) (few, and a predictable branch); then kept[0..m):
    // the entries above it, ascending, by a branch-free compaction in place (m <= j): whether a
    // token of a broad row is kept is a coin flip the branch predictor would lose
    thread_local std::vector<std::pair<int32_t, int32_t>> edge;
    edge.clear();
    int32_t * kp = kept.data();
    const int32_t * bb = b.data();
    for (int64_t j = 0; j < n; ++j) {
        if (bb[j] == cut) edge.push_back({kp[j], w ? w[j] : 1});
    }
    int64_t m = 0;
    for (int64_t j = 0; j < n; ++j) {
        kp[m] = kp[j];
        m += bb[j] < cut;
    }
    std::sort(edge.begin(), edge.end(), [&](const auto & x, const auto & y) { return by_logit{l}(x.first, y.first); });
    size_t taken = 0;
    while (taken < edge.size() && acc < need) acc += edge[taken++].second;
    std::vector<int32_t> add(taken);
    for (size_t k = 0; k < taken; ++k) add[k] = edge[k].first;
    std::sort(add.begin(), add.end());
    kept.resize(m + taken);
    std::inplace_merge(kept.begin(), kept.begin() + m, std::copy(add.begin(), add.end(), kept.begin() + m));
}

void filter_top_k(const float * l, float l_max, int64_t k, std::vector<int32_t> & kept, bool all) {
    if (k <= 0 || k >= (int64_t) kept.size()) return;
    thread_local std::vector<float> x;  // scratch, reused across draws
    keep_prefix_reaching(l, kept_logits(l, kept, all, x), l_max, kept, nullptr, k);
}

// Top-p's weights: w_j = floor(2^30 exp_neg(l_j - l_max)), exp_neg the package's float exp
// (vmath.h: plain IEEE float operations, the same bits on every ISA; the NumPy reference
// repeats them). So w_max = 2^30, and a token below l_max - 20.8 weighs 0.
DFN_MULTIVERSION(void, top_p_weights, (const float * x, int64_t n, float l_max, int32_t * w), (x, n, l_max, w)) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) w[j] = (int32_t) (exp_neg(x[j] - l_max) * 1073741824.0f);
}

// Keeps the shortest prefix, in by_logit order, whose weight reaches ceil(top_p * total weight):
// the tokens holding top_p of the softmax of the raw logits, with that softmax in 30-bit fixed
// point. Integer sums are exact, so the cut is a fixed function of the logits whatever order the
// terms are added in (a vocabulary below 2^21 keeps the total below 2^51).
void filter_top_p(const float * l, float l_max, double top_p, std::vector<int32_t> & kept, bool all) {
    if (top_p >= 1.0) return;
    const int64_t n = (int64_t) kept.size();
    thread_local std::vector<int32_t> w;  // scratch, reused across draws
    thread_local std::vector<float> xs;
    const float * x = kept_logits(l, kept, all, xs);
    w.resize(n);
    top_p_weights(x, n, l_max, w.data());
    int64_t total = 0;
    for (int64_t j = 0; j < n; ++j) total += w[j];
    const int64_t need = (int64_t) std::ceil(top_p * (double) total);  // in [1, total]: w_max = 2^30
    keep_prefix_reaching(l, x, l_max, kept, w.data(), need);
}

void filter_min_p(const float * l, double l_max, double min_p, std::vector<int32_t> & kept) {
    if (min_p <= 0.0) return;
    // p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p); the maximum (0 >= log(min_p)) stays
    const double lim = std::log(min_p);
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](int32_t i) { return (double) l[i] - l_max < lim; }),
               kept.end());
}

std::vector<int32_t> filter(const logits_row & row, const sampling_params & p, int64_t i_max, bool all_finite) {
    DFN_REQUIRE(row.n < (int64_t) 1 << 21, "sampling", "rows of more than 2^21 logits are not supported, got ", row.n);
    std::vector<int32_t> kept;
    if (all_finite) {
        kept.resize(row.n);
        std::iota(kept.begin(), kept.end(), 0);
    } else {
        kept.reserve(row.n);
        for (int64_t i = 0; i < row.n; ++i) {
            if (row.l[i] > -INFINITY) kept.push_back((int32_t) i);
        }
    }
    const float l_max = row.l[i_max];
    filter_top_k(row.l, l_max, p.top_k, kept, all_finite);
    filter_top_p(row.l, l_max, p.top_p, kept, all_finite && (int64_t) kept.size() == row.n);
    filter_min_p(row.l, l_max, p.min_p, kept);
    return kept;
}

// ---- the draw -------------------------------------------------------------------------------------

// The pruning ladder: noise bits at or below rung k give G <= g(k) = k / 8 - 4 (G is
// non-decreasing in the bits). A token whose score l/T needs G > m to beat the K-th best so far can
// be skipped without its two logs when its bits are at or below the ladder's rung under m.
constexpr int k_rungs = 128;  // g from -4 to 11.875

const int64_t * ladder() {  // rungs1: -1, then rung 0 .. k_rungs - 1
    static const std::vector<int64_t> rungs = [] {
        std::vector<int64_t> r(k_rungs + 1, -1);
        for (int k = 0; k < k_rungs; ++k) {
            const double g = k / 8.0 - 4.0;
            // U = exp(-exp(-g)), bits = U 2^52 - 0.5; then stepped so that it is the last bits value
            // whose G is <= g (-1: none)
            int64_t b = (int64_t) std::floor(std::exp(-std::exp(-g)) * 0x1p52 - 0.5);
            b = std::min<int64_t>(std::max<int64_t>(b, -1), ((int64_t) 1 << 52) - 1);
            while (b >= 0 && gumbel_of_bits((uint64_t) b) > g) --b;
            while (b + 1 < ((int64_t) 1 << 52) && gumbel_of_bits((uint64_t) (b + 1)) <= g) ++b;
            r[k + 1] = b;
        }
        return r;
    }();
    return rungs.data();
}

// Per token of a block: whether its draw could reach s (the K-th best score at the block's start):
// false only when its bits sit at or below the rung under m = s - l/T, i.e. G <= m and its score is
// below s. m is computed in float with a margin far above float rounding (the test only skips work:
// a token it lets through is scored exactly). rungs1[0] = -1 (no rung below m), rungs1[k + 1] = rung k.
DFN_MULTIVERSION(void, could_reach,
                 (const float * l, const int32_t * kept, const uint64_t * bits, int64_t n, double s, double inv_t,
                  const int64_t * rungs1, uint8_t * out),
                 (l, kept, bits, n, s, inv_t, rungs1, out)) {
    const float s_f = (float) (s - 1e-3 * (1.0 + std::fabs(s))), it = (float) inv_t;
    int32_t r[k_block];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
        float k = ((s_f - l[kept[j]] * it) + 4.0f) * 8.0f + 1.0f;
        // NaN (a tiny T: l * it = 0 * inf or inf - inf) goes to rung -1, scored exactly
        k = k > 0.0f ? (k < (float) k_rungs ? k : (float) k_rungs) : 0.0f;
        r[j] = (int32_t) k;
    }
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = (int64_t) bits[j] > rungs1[r[j]];
}

// The K best kept entries by l/T + G(seed, pos, id), score descending, the lower index first
// among equal scores: (entry, score) pairs in `top`.
void gumbel_topk(const logits_row & row, const std::vector<int32_t> & kept, int64_t i_max, double T, uint64_t seed,
                 int64_t pos, int64_t K, std::vector<std::pair<int32_t, double>> & top) {
    auto before = [](const std::pair<int32_t, double> & a, const std::pair<int32_t, double> & b) {
        return a.second > b.second || (a.second == b.second && a.first < b.first);
    };
    top.assign(1, {(int32_t) i_max, (double) row.l[i_max] / T + gumbel(seed, pos, row.id(i_max))});  // kept by every filter
    const int64_t * rungs = ladder();
    int32_t ids[k_block];
    uint64_t bits[k_block];
    uint8_t reach[k_block];
    for (size_t j0 = 0; j0 < kept.size(); j0 += k_block) {
        const int64_t nb = std::min<int64_t>(k_block, (int64_t) (kept.size() - j0));
        const int32_t * kb = kept.data() + j0;
        for (int64_t j = 0; j < nb; ++j) ids[j] = row.id(kb[j]);
        noise_bits_block(seed, pos, ids, nb, bits);
        // s only rises during the block, so a token that cannot reach its value at the start
        // cannot enter later either
        const double s = (int64_t) top.size() < K ? -INFINITY : top.back().second;
        if (s > -INFINITY) {
            could_reach(row.l, kb, bits, nb, s, 1.0 / T, rungs, reach);
        } else {
            std::fill(reach, reach + nb, 1);
        }
        for (int64_t j = 0; j < nb; ++j) {
            const int32_t i = kb[j];
            if (!reach[j] || i == i_max) continue;
            const std::pair<int32_t, double> c{i, (double) row.l[i] / T + gumbel_of_bits(bits[j])};
            if ((int64_t) top.size() == K && !before(c, top.back())) continue;
            top.insert(std::upper_bound(top.begin(), top.end(), c, before), c);
            if ((int64_t) top.size() > K) top.pop_back();
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

int64_t finite_argmax(const logits_row & row) {
    int64_t n_bad = 0, n_neg_inf = 0;
    const float mx = row.n > 0 ? scan_row(row.l, row.n, n_bad, n_neg_inf) : -INFINITY;
    return n_bad > 0 || mx == -INFINITY ? -1 : first_of(row, mx);
}

std::vector<int32_t> sampling_filter(const logits_row & row, const sampling_params & p, const char * where, int64_t pos) {
    bool all_finite;
    const int64_t i_max = checked_argmax(row, where, pos, &all_finite);
    return filter(row, p, i_max, all_finite);
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
    bool all_finite;
    const int64_t i_max = checked_argmax(row, where, pos, &all_finite);
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
    const std::vector<int32_t> kept = filter(row, p, i_max, all_finite);
    const int64_t i = gumbel_argmax(row, kept, i_max, p.temperature, p.seed, pos);
    if (want) fill_logprobs(row, kept, i_max, p.temperature, i, p.n_logprobs, *lp);
    return row.id(i);
}

void perturbed_topk(const logits_row & row, const sampling_params & p, int64_t pos, int64_t K, const char * where,
                    std::vector<int32_t> & idx, std::vector<float> & weight) {
    DFN_REQUIRE(p.temperature > 0.0 && K >= 1, where, "perturbed_topk needs a temperature > 0 and K >= 1");
    bool all_finite;
    const int64_t i_max = checked_argmax(row, where, pos, &all_finite);
    std::vector<std::pair<int32_t, double>> top;
    gumbel_topk(row, filter(row, p, i_max, all_finite), i_max, p.temperature, p.seed, pos, K, top);
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
