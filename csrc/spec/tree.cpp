#include "spec/tree.h"

#include "base/common.h"

#include <algorithm>
#include <queue>

namespace dfn {

namespace {

struct candidate {
    double score;
    int32_t parent;  // node index
    int32_t pos;     // block position - 1: the row of top_tok
    int32_t rank;    // column of top_tok
    int32_t depth;
};

}  // namespace

draft_tree build_tree(int32_t root, const int32_t * top_tok, const float * top_p, int64_t n_pos, int64_t K,
                      int64_t budget, double min_score) {
    DFN_REQUIRE(budget >= 0 && n_pos >= 0 && K >= 1, "build_tree", "bad sizes: budget ", budget, ", positions ", n_pos,
                ", K ", K);
    draft_tree t;
    t.parent = {-1};
    t.token = {root};
    t.depth = {0};
    t.score = {1.0};
    t.prob = {1.0f};
    // Ties: shallower first, then the path's tokens in lexicographic order. Comparing paths is
    // needed only on exact score ties (rare outside tests); it walks the two paths to the root.
    auto path_less = [&](const candidate & a, const candidate & b) {
        // the tokens of each path, root excluded: compare from the top down
        std::vector<int32_t> pa, pb;
        pa.push_back(top_tok[a.pos * K + a.rank]);
        for (int32_t n = a.parent; n > 0; n = t.parent[n]) pa.push_back(t.token[n]);
        pb.push_back(top_tok[b.pos * K + b.rank]);
        for (int32_t n = b.parent; n > 0; n = t.parent[n]) pb.push_back(t.token[n]);
        return std::lexicographical_compare(pa.rbegin(), pa.rend(), pb.rbegin(), pb.rend());
    };
    auto later = [&](const candidate & a, const candidate & b) {  // the heap's "a after b"
        if (a.score != b.score) return a.score < b.score;
        if (a.depth != b.depth) return a.depth > b.depth;
        return path_less(b, a);
    };
    std::priority_queue<candidate, std::vector<candidate>, decltype(later)> frontier(later);
    auto push = [&](int32_t parent, int32_t pos, int32_t rank) {
        if (pos >= n_pos || rank >= K) return;
        const float p = top_p[pos * K + rank];
        const double s = t.score[parent] * p;
        if (!(s >= min_score) || !(p > 0.0f)) return;  // below the cutoff (or no probability at all)
        frontier.push({s, parent, pos, rank, t.depth[parent] + 1});
    };
    push(0, 0, 0);
    while (t.size() <= budget && !frontier.empty()) {
        const candidate c = frontier.top();
        frontier.pop();
        const int32_t node = (int32_t) t.size();
        t.parent.push_back(c.parent);
        t.token.push_back(top_tok[c.pos * K + c.rank]);
        t.depth.push_back(c.depth);
        t.score.push_back(c.score);
        t.prob.push_back(top_p[c.pos * K + c.rank]);
        push(node, c.pos + 1, 0);            // its first child
        push(c.parent, c.pos, c.rank + 1);  // its next sibling
    }
    return t;
}

}  // namespace dfn
