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

struct child_entry {
    int32_t token;
    float p;
    int32_t col;  // the child's column in its row (a conditional table's key for its own children)
};

}  // namespace

// The best-first search of build_tree over any child table: child(pos, parent node, rank) is
// the rank-th child token of that parent at row pos and its probability (rank < K, ranks by
// probability descending); `col` records, per node, the column its child lists are keyed by.
template <class Child>
static draft_tree best_first(int32_t root, int64_t n_pos, int64_t K, int64_t budget, double min_score,
                             const Child & child) {
    DFN_REQUIRE(budget >= 0 && n_pos >= 0 && K >= 1, "build_tree", "bad sizes: budget ", budget, ", positions ", n_pos,
                ", K ", K);
    draft_tree t;
    t.parent = {-1};
    t.token = {root};
    t.depth = {0};
    t.score = {1.0};
    t.prob = {1.0f};
    std::vector<int32_t> col = {0};  // per node: the column of its row it sits in (0 for the root)
    // Ties: shallower first, then the path's tokens in lexicographic order. Comparing paths is
    // needed only on exact score ties (rare outside tests); it walks the two paths to the root.
    auto path_less = [&](const candidate & a, const candidate & b) {
        // the tokens of each path, root excluded: compare from the top down
        std::vector<int32_t> pa, pb;
        pa.push_back(child(a.pos, col[a.parent], a.rank).token);
        for (int32_t n = a.parent; n > 0; n = t.parent[n]) pa.push_back(t.token[n]);
        pb.push_back(child(b.pos, col[b.parent], b.rank).token);
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
        const float p = child(pos, col[parent], rank).p;
        const double s = t.score[parent] * p;
        if (!(s >= min_score) || !(p > 0.0f)) return;  // below the cutoff (or no probability at all)
        frontier.push({s, parent, pos, rank, t.depth[parent] + 1});
    };
    push(0, 0, 0);
    while (t.size() <= budget && !frontier.empty()) {
        const candidate c = frontier.top();
        frontier.pop();
        const int32_t node = (int32_t) t.size();
        const child_entry e = child(c.pos, col[c.parent], c.rank);
        t.parent.push_back(c.parent);
        t.token.push_back(e.token);
        t.depth.push_back(c.depth);
        t.score.push_back(c.score);
        t.prob.push_back(e.p);
        col.push_back(e.col);
        push(node, c.pos + 1, 0);            // its first child
        push(c.parent, c.pos, c.rank + 1);  // its next sibling
    }
    return t;
}

draft_tree build_tree(int32_t root, const int32_t * top_tok, const float * top_p, int64_t n_pos, int64_t K,
                      int64_t budget, double min_score) {
    return best_first(root, n_pos, K, budget, min_score, [&](int32_t pos, int32_t, int32_t rank) {
        return child_entry{top_tok[pos * K + rank], top_p[pos * K + rank], 0};
    });
}

draft_tree build_tree_conditional(int32_t root, const int32_t * cand, const float * cond_p, int64_t n_pos, int64_t K,
                                  int64_t budget, double min_score) {
    // per (row, predecessor column): the successor columns by probability descending, then token id
    std::vector<int32_t> order((size_t) n_pos * K * K);
    for (int64_t pos = 0; pos < n_pos; ++pos) {
        for (int64_t q = 0; q < K; ++q) {
            int32_t * o = order.data() + (pos * K + q) * K;
            const float * p = cond_p + (pos * K + q) * K;
            const int32_t * c = cand + pos * K;
            for (int32_t j = 0; j < K; ++j) o[j] = j;
            std::stable_sort(o, o + K, [&](int32_t a, int32_t b) { return p[a] != p[b] ? p[a] > p[b] : c[a] < c[b]; });
        }
    }
    return best_first(root, n_pos, K, budget, min_score, [&](int32_t pos, int32_t q, int32_t rank) {
        const int32_t j = order[((size_t) pos * K + q) * K + rank];
        return child_entry{cand[pos * K + j], cond_p[((size_t) pos * K + q) * K + j], j};
    });
}

}  // namespace dfn
