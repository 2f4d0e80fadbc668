#include "spec/verify.h"

#include "base/common.h"

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

void check_tree_parents(const int32_t * parents, int64_t n, const char * where) {
    DFN_REQUIRE(n >= 1, where, "a tree needs its root (node 0): got 0 nodes");
    DFN_REQUIRE(parents[0] == -1, where, "parents[0] must be -1 (node 0 is the root), got ", parents[0]);
    for (int64_t i = 1; i < n; ++i) {
        DFN_REQUIRE(parents[i] >= 0 && parents[i] < i, where, "parents[", i, "] = ", parents[i],
                    " must be in [0, ", i, ") (a node's parent comes before it)");
    }
}

std::vector<int32_t> accept_tree(const int32_t * parents, const int32_t * tokens, const int32_t * target, int64_t n,
                                 std::vector<int32_t> * path) {
    check_tree_parents(parents, n, "accept_tree");
    return accept_tree_by(parents, tokens, n, [&](int64_t i) { return target[i]; }, path);
}

}  // namespace dfn
