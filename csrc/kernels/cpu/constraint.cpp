#include "kernels/cpu/constraint.h"

#include "base/common.h"

#include <algorithm>
#include <cmath>

namespace dfn {

logits_row mask_row(const logits_row & row, const uint32_t * mask, std::vector<float> & buf, int64_t * n_allowed) {
    buf.resize((size_t) row.n);
    int64_t n = 0;
    for (int64_t i = 0; i < row.n; ++i) {
        const bool ok = mask_allows(mask, row.id(i));
        buf[i] = ok ? row.l[i] : -INFINITY;
        n += ok;
    }
    if (n_allowed) *n_allowed = n;
    return {buf.data(), row.n, row.ids};
}

// A greedy choice that returns no logprobs: the masked argmax is then the row's argmax whenever
// the mask allows it (the masked row keeps that entry and every entry before it is smaller), so
// neither the masked copy of the row nor, for choose_constrained, the mask itself is needed.
static bool plain_greedy(const sampling_params & p, const token_logprobs * lp) {
    return p.greedy() && !(lp && p.want_logprobs());
}

int32_t choose_masked(const logits_row & row, const uint32_t * mask, const sampling_params & p, int64_t pos,
                      const char * where, token_logprobs * lp) {
    if (plain_greedy(p, lp)) {
        const int64_t i = finite_argmax(row);
        if (i >= 0 && mask_allows(mask, row.id(i))) return row.id(i);
    }
    std::vector<float> buf;
    int64_t n_allowed = 0;
    const logits_row masked = mask_row(row, mask, buf, &n_allowed);
    if (n_allowed == 0) throw runtime_error(cat("[", where, "] the constraint allows no token at position ", pos));
    return choose_token(masked, p, pos, where, lp);
}

void row_topk(const logits_row & row, int64_t K, std::vector<int32_t> & idx, std::vector<float> & prob) {
    idx.clear();
    float m = -INFINITY;
    for (int64_t i = 0; i < row.n; ++i) {
        if (row.l[i] > -INFINITY) idx.push_back((int32_t) i), m = std::max(m, row.l[i]);
    }
    double z = 0.0;
    for (const int32_t i : idx) z += std::exp((double) row.l[i] - m);
    const size_t k = (size_t) std::min<int64_t>(K, (int64_t) idx.size());
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t a, int32_t b) { return row.l[a] > row.l[b] || (row.l[a] == row.l[b] && a < b); });
    idx.resize(k);
    prob.resize(k);
    for (size_t j = 0; j < k; ++j) prob[j] = (float) (std::exp((double) row.l[idx[j]] - m) / z);
}

int32_t choose_constrained(token_constraint & c, const logits_row & row, const sampling_params & p, int64_t pos,
                           const char * where, token_logprobs * lp) {
    if (plain_greedy(p, lp)) {  // accept() takes exactly what the mask allows
        const int64_t i = finite_argmax(row);
        if (i >= 0 && c.accept(row.id(i))) return row.id(i);
    }
    std::vector<uint32_t> mask((size_t) mask_words(row.n));
    c.fill_mask(mask.data(), (int64_t) mask.size());
    const int32_t t = choose_masked(row, mask.data(), p, pos, where, lp);
    if (!c.accept(t)) throw runtime_error(cat("[", where, "] the constraint rejected token ", t, " its mask allowed"));
    return t;
}

int32_t choose_next(token_constraint * c, const logits_row & row, const sampling_params & p, int64_t pos,
                    const char * where, token_logprobs * lp) {
    return c ? choose_constrained(*c, row, p, pos, where, lp) : choose_token(row, p, pos, where, lp);
}

}  // namespace dfn
