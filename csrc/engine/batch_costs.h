// What one request's part of a shared target pass costs (engine/scheduler.h: the batch
// controller's prices). A pass of W tokens in all takes t(W) = a + b * W: a the weights' read and
// the graph's fixed cost, shared by the N requests in it, b the work per token. A request of n
// tokens is charged its share a / N + b * n, so the shares of a pass sum to its time, and a
// verified draft costs a token's work b while an AR step costs a / N + b: the more requests share
// a pass, the less an extra verified token is worth against the AR step it rides beside. Each
// request's controller (controller.h) prices its steps by these shares, so each chooses its
// verify length, or AR, against the costs it adds to the batch.
//
// a and b are fitted to the passes' floors per width (the least of a width's last k_floor
// times: a pass timed in a stall of the machine raises no price), by least squares over the
// widths seen lately; with one width only, each token pays t(W) / W.
#pragma once

#include <cstdint>
#include <vector>

namespace dfn {

class batch_costs {
public:
    explicit batch_costs(int64_t max_width);
    // A pass of `width` tokens in all took `seconds`.
    void observe(int64_t width, double seconds);
    // The share of a pass of `width` tokens over `n_requests` requests (this one's n tokens),
    // given that the pass took `seconds` (the share of what was measured, split by the fit's
    // proportions: a / N + b * n over a + b * W).
    double share(int64_t n, int64_t width, int64_t n_requests, double seconds) const;
    // The fit, for tests and metrics: t(W) = a + b * W (both >= 0); false with no pass seen.
    bool fit(double & a, double & b) const;

private:
    static constexpr int k_floor = 8;
    struct width_floor {
        double s[k_floor] = {};
        int64_t n = 0, last = 0;  // samples seen; the pass count at the last
        double value() const;
    };
    std::vector<width_floor> w_;  // [max_width + 1]
    int64_t passes_ = 0;
};

}  // namespace dfn
