#include "verify.h"

#include "common.h"

namespace dfn {

std::vector<int32_t> accept_prefix(const int32_t * draft, int64_t n_draft, const int32_t * target, int64_t n_target) {
    DFN_REQUIRE(n_target == n_draft + 1, "accept_prefix", "target must have one more token than draft (",
                n_draft, " draft, ", n_target, " target)");
    int64_t n = 0;
    while (n < n_draft && draft[n] == target[n]) ++n;
    std::vector<int32_t> out(draft, draft + n);
    out.push_back(target[n]);
    return out;
}

}  // namespace dfn
