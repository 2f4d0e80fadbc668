#include "engine/batch_costs.h"

#include <algorithm>

namespace dfn {

// widths not passed for this many passes drop out of the fit (costs move with the context)
static constexpr int64_t k_stale = 256;

batch_costs::batch_costs(int64_t max_width) : w_(std::max<int64_t>(max_width, 1) + 1) {}

double batch_costs::width_floor::value() const {
    const int64_t m = std::min<int64_t>(n, k_floor);
    double v = s[0];
    for (int64_t i = 1; i < m; ++i) v = std::min(v, s[i]);
    return v;
}

void batch_costs::observe(int64_t width, double seconds) {
    if (width <= 0 || seconds <= 0) return;
    width = std::min<int64_t>(width, (int64_t) w_.size() - 1);
    width_floor & f = w_[width];
    f.s[f.n % k_floor] = seconds;
    f.n += 1;
    f.last = ++passes_;
}

bool batch_costs::fit(double & a, double & b) const {
    // least squares of the floors over the widths seen lately, each width once
    double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (size_t w = 1; w < w_.size(); ++w) {
        const width_floor & f = w_[w];
        if (f.n == 0 || passes_ - f.last > k_stale) continue;
        const double y = f.value(), x = (double) w;
        n += 1, sx += x, sy += y, sxx += x * x, sxy += x * y;
    }
    if (n == 0) return false;
    const double den = n * sxx - sx * sx;
    if (n < 2 || den <= 0) {  // one width: every token pays the same
        a = 0;
        b = sy / sx;
        return true;
    }
    b = std::max(0.0, (n * sxy - sx * sy) / den);
    a = std::max(0.0, (sy - b * sx) / n);
    return true;
}

double batch_costs::share(int64_t n, int64_t width, int64_t n_requests, double seconds) const {
    double a = 0, b = 0;
    if (!fit(a, b) || width <= 0 || n_requests <= 0) return seconds * (double) n / (double) std::max<int64_t>(width, 1);
    const double whole = a + b * (double) width;
    if (whole <= 0) return seconds * (double) n / (double) width;
    return seconds * (a / (double) n_requests + b * (double) n) / whole;
}

}  // namespace dfn
