// Tree construction for tree verify: the best-first tree of candidate continuations that one
// draft pass's per-position top-K distributions give (DDTree-style).
#pragma once

#include <cstdint>
#include <vector>

namespace dfn {

// Node 0 is the root (the last committed token, depth 0, score 1); node i > 0 is token[i] at
// block position depth[i] (the drafter's row depth[i] - 1), a child of parent[i] < i. Index
// order is the order the best-first search took the nodes, so a topological order.
struct draft_tree {
    std::vector<int32_t> parent;  // [n], parent[0] = -1
    std::vector<int32_t> token;   // [n]
    std::vector<int32_t> depth;   // [n]
    std::vector<double> score;    // [n]: product of the drafter's probabilities along the path
    std::vector<float> prob;      // [n]: the node's own probability (1 for the root)
    int64_t size() const { return (int64_t) parent.size(); }
};

// top_tok, top_p: [n_pos, K] row-major, each row the drafter's K most probable tokens at block
// position r + 1 (probability descending, ties by token id ascending, as topk_op gives them).
// Returns the tree of at most 1 + budget nodes whose path scores are the largest: a node's
// children are the top tokens of the next position, a path's score is the product of its
// tokens' probabilities (in double, root first: the same product cutoff_keep forms). Ties are
// broken by depth (shallower first), then by the path's token sequence (lexicographic), so the
// tree depends on nothing but the inputs. Nodes whose score falls below min_score are left out
// (draft_cutoff as a minimum path score). K = 1 gives the chain of top-1 drafts, cut where
// cutoff_keep cuts it.
//
// Best-first by a lazy frontier: a candidate is (parent node, position, rank); taking one adds
// its first child (rank 0 at the next position) and its next sibling (rank + 1) to the frontier.
// Scores never grow along either step (probabilities <= 1, ranks by probability), so the taken
// nodes are the global top by the order above; cost O(budget log budget).
draft_tree build_tree(int32_t root, const int32_t * top_tok, const float * top_p, int64_t n_pos, int64_t K,
                      int64_t budget, double min_score);

}  // namespace dfn
