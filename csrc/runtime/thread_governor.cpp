#include "runtime/thread_governor.h"

#include <algorithm>

namespace dfn {

int thread_governor::threads(double now) {
    if (cur_ < n_ && now >= next_probe_) return std::min(n_, 2 * cur_);  // a probe's graph
    return cur_;
}

void thread_governor::observe(int threads, double wall, double cpu, double now) {
    if (!(wall > 0) || cpu < 0) return;
    if (threads == cur_) {
        win_wall_ += wall, win_cpu_ += cpu, win_n_ += 1;
        if (win_n_ < k_window || win_wall_ < k_window_s) return;
        const double r = win_cpu_ / win_wall_;
        win_wall_ = win_cpu_ = 0, win_n_ = 0;
        if (r >= k_high && cur_ < n_) next_probe_ = std::min(next_probe_, now + k_probe_min_s);
        if (r < k_low && cur_ > 1) {
            cur_ = std::max(1, cur_ / 2);
            down_ += 1;
            interval_ = k_probe_min_s;
            next_probe_ = now + interval_;
            probe_wall_ = probe_cpu_ = 0, probe_n_ = 0;
        }
        return;
    }
    if (threads != std::min(n_, 2 * cur_)) return;  // a count from before the last change
    probe_wall_ += wall, probe_cpu_ += cpu, probe_n_ += 1;
    // a probe graph that waited most of its time ends the probe at once (each such graph is slow)
    if (probe_n_ < k_probe && cpu / wall >= k_low) return;
    const double r = probe_n_ < k_probe ? cpu / wall : probe_cpu_ / probe_wall_;
    probe_wall_ = probe_cpu_ = 0, probe_n_ = 0;
    if (r >= k_high) {
        cur_ = threads;
        interval_ = k_probe_min_s;
        win_wall_ = win_cpu_ = 0, win_n_ = 0;
    } else {
        interval_ = std::min(2 * interval_, k_probe_max_s);
    }
    next_probe_ = now + interval_;
}

}  // namespace dfn
