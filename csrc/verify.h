// Chain verify: which draft tokens the target agrees with.
#pragma once

#include <cstdint>
#include <vector>

namespace dfn {

// draft: d_1 .. d_{B-1} (the drafter's proposals after the last committed token);
// target: t_0 .. t_{B-1}, the target's argmax after each verified input [last, d_1 .. d_{B-1}].
// Returns the committed tokens: the longest prefix with d_i == t_{i-1} (the accepted tokens)
// plus the bonus token t_n at the first mismatch (or after the last draft): 1 .. B tokens.
std::vector<int32_t> accept_prefix(const int32_t * draft, int64_t n_draft, const int32_t * target, int64_t n_target);

}  // namespace dfn
