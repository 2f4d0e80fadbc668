// How many threads a runner's CPU graphs use now (graph_runner::compute): fewer than asked while
// the machine is oversubscribed.
//
// On a busy machine a graph on several threads waits at every node's barrier for whichever of its
// threads the kernel descheduled: with 2 threads and ten other busy tasks on 2 cores, an AR step
// of the embedded pair measured 40-50x slower than on 1 thread (bench/README.md,
// `threads_load.py`). Every op is thread-count invariant (each output element is computed whole by
// one thread, in the same order: test_threads.py), so the count may change between any two graphs
// with the same results, bit for bit.
//
// The signal is the compute thread's own CPU time over the graph's wall time: on an idle machine
// the thread computes or spins at the barriers all along (near 1); when it waits for a core, or
// sleeps at a barrier for a descheduled peer, the ratio falls. Over each window of graphs
// (k_window of them and at least k_window_s of wall time) at the current count, a ratio under
// k_low halves the count (down to 1). While below the asked count, every probe interval (0.5 s,
// doubling on each failed probe up to 4 s) the next k_probe graphs run at twice the count: kept
// when their ratio is k_high or more; a probe graph whose own ratio is under k_low fails the probe
// at once (on a busy machine each such graph is many times slower). A window at the lower count
// whose ratio is k_high or more (its threads run freely: the load may have gone) brings the next
// probe to within k_probe_min_s.
#pragma once

#include <cstdint>

namespace dfn {

class thread_governor {
public:
    explicit thread_governor(int n_threads) : n_(n_threads < 1 ? 1 : n_threads), cur_(n_) {}
    // The threads the next graph runs on (now: seconds on the steady clock).
    int threads(double now);
    // A graph on `threads` threads took `wall` seconds, `cpu` of them on the computing thread's CPU.
    void observe(int threads, double wall, double cpu, double now);
    int current() const { return cur_; }
    int asked() const { return n_; }
    int64_t reductions() const { return down_; }  // times the count was halved

    static constexpr int k_window = 8;
    static constexpr double k_window_s = 0.005;
    static constexpr int k_probe = 4;
    static constexpr double k_low = 0.5, k_high = 0.75;
    static constexpr double k_probe_min_s = 0.5, k_probe_max_s = 4.0;

private:
    int n_, cur_;
    // the window at cur_, and the probe at 2 * cur_
    double win_wall_ = 0, win_cpu_ = 0, probe_wall_ = 0, probe_cpu_ = 0;
    int win_n_ = 0, probe_n_ = 0;
    double next_probe_ = 0, interval_ = k_probe_min_s;
    int64_t down_ = 0;
};

}  // namespace dfn
