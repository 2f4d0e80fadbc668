#include "kernels/cpu/constraint.h"

#include "base/common.h"

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

int32_t choose_masked(const logits_row & row, const uint32_t * mask, const sampling_params & p, int64_t pos,
                      const char * where, token_logprobs * lp) {
    std::vector<float> buf;
    int64_t n_allowed = 0;
    const logits_row masked = mask_row(row, mask, buf, &n_allowed);
    if (n_allowed == 0) throw runtime_error(cat("[", where, "] the constraint allows no token at position ", pos));
    return choose_token(masked, p, pos, where, lp);
}

int32_t choose_constrained(token_constraint & c, const logits_row & row, const sampling_params & p, int64_t pos,
                           const char * where, token_logprobs * lp) {
    std::vector<uint32_t> mask((size_t) mask_words(row.n));
    c.fill_mask(mask.data(), (int64_t) mask.size());
    const int32_t t = choose_masked(row, mask.data(), p, pos, where, lp);
    if (!c.accept(t)) throw runtime_error(cat("[", where, "] the constraint rejected token ", t, " its mask allowed"));
    return t;
}

}  // namespace dfn
