// Chain and tree verify: which draft tokens the target agrees with.
#pragma once

#include <cstdint>
#include <vector>

namespace dfn {

// draft: d_1 .. d_{B-1} (the drafter's proposals after the last committed token);
// target: t_0 .. t_{B-1}, the target's argmax after each verified input [last, d_1 .. d_{B-1}].
// Returns the committed tokens: the longest prefix with d_i == t_{i-1} (the accepted tokens)
// plus the bonus token t_n at the first mismatch (or after the last draft): 1 .. B tokens.
std::vector<int32_t> accept_prefix(const int32_t * draft, int64_t n_draft, const int32_t * target, int64_t n_target);

// Tree verify over n nodes: node 0 is the root (the last committed token), parents[0] == -1 and
// 0 <= parents[i] < i (index order is a topological order); tokens[i] is node i's token and
// target[i] the target's argmax after node i. From the root, follow the child whose token equals
// the target's argmax at the current node (the lowest-index one, should two children share a
// token: the tree builder never makes such twins). Returns the committed tokens: the accepted
// path without the root plus the bonus token target[last path node]; 1 .. depth + 1 tokens.
// path (optional): the accepted path's node indices, root first (one fewer than the result).
// A chain (parents[i] == i - 1) gives accept_prefix(tokens + 1, n - 1, target, n).
std::vector<int32_t> accept_tree(const int32_t * parents, const int32_t * tokens, const int32_t * target, int64_t n,
                                 std::vector<int32_t> * path = nullptr);

// accept_tree with the target's token after node i given by target_of(i), called once per node of
// the accepted path, in path order (sampled tree verify draws only there).
template <class F>
std::vector<int32_t> accept_tree_by(const int32_t * parents, const int32_t * tokens, int64_t n, F && target_of,
                                    std::vector<int32_t> * path = nullptr) {
    std::vector<int32_t> out;
    if (path) path->assign(1, 0);
    int64_t cur = 0;
    for (;;) {
        const int32_t t = target_of(cur);
        // children of cur have larger indices; the first one with the target's token wins
        int64_t next = -1;
        for (int64_t i = cur + 1; i < n && next < 0; ++i) {
            if (parents[i] == cur && tokens[i] == t) next = i;
        }
        if (next < 0) {
            out.push_back(t);  // the bonus token
            return out;
        }
        out.push_back(tokens[next]);
        if (path) path->push_back((int32_t) next);
        cur = next;
    }
}

// The checks accept_tree and tree verify make of a parents array ("[where] ..." on failure).
void check_tree_parents(const int32_t * parents, int64_t n, const char * where);

}  // namespace dfn
