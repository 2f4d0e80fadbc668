// The speculation controller: per request, decides each step between one exact AR step and a
// speculative round, and for a round how many of the drafts to verify, from measured costs and
// the drafter's measured calibration. It never changes what is committed (only target tokens
// are), only how fast they come.
//
// Model. A round that drafts (cost t_draft) and verifies `last` + k drafts (cost c(k + 1),
// commit and rollback included) commits 1 + A tokens, A the accepted run. With q_i the
// probability that draft i is accepted given drafts 1..i-1 were, E[1 + A] = 1 + sum_j prod_{i<=j}
// q_i. q_i comes from the drafter's own top-1 probability p_i through a calibration table
// (acceptance rate per p-bin over a sliding window of rounds). The long-run rate of a renewal
// process is E[tokens] / E[time]; the per-round choice that maximises it is the k maximising
// E[tokens | k] - lambda * c(k + 1) with lambda the rate to beat (Dinkelbach), here the best
// rate measured so far (speculation's over the window, or AR's).
//
// Modes. SPEC runs rounds and, every `ar_probe_every` rounds (times how many times AR's rate the
// window's rate is, 1..4), one AR step to keep the AR cost current (it grows with the context). When the window's speculative rate falls below the AR
// rate, AR mode runs `backoff` AR steps, then speculation is probed again for `min_rounds`
// rounds: kept when it beats AR, else back to AR with the backoff doubled (up to backoff_max).
// A probe costs at most min_rounds rounds, and the doubling bounds how often it is paid.
//
// Costs are measured on the steady clock per step (AR, draft, verify by size), and each is priced
// by its floor: the least of its last few samples. On a busy machine a step's wall time is its
// work plus the time its threads waited for a core, and the wait is heavy-tailed and unrelated to
// the step's size (a descheduled ggml worker stalls the whole graph at its next barrier): an
// average of samples taken at different moments mixes load into the cost, and the ratio of two
// such averages (a round against an AR step, measured far apart in time) is the ratio of two
// loads. The floor is the step's own cost, which a load slows for every kind of step alike, so
// that which step is faster does not change with it. The speculative rate the controller judges
// by is priced the same way: the window's tokens over its rounds' floor costs (draft + verify of
// their size), never over their wall seconds, and it is compared with the AR floor of the same
// moment. A step is priced at its floor plus the mean wait per graph run (AR steps, drafts and
// verifies pooled: a step's time over its kind's floor, over the last window_rounds graph runs), so
// that a round (two graphs: draft, verify) pays two waits and an AR step one, by waits measured in
// whichever mode the controller is in. A verify of n is priced by a line c(n) = c(1) + slope * (n - 1): c(1) the AR floor (or a
// verify of 1's, the same work), and the slope the least of the bounds (verify(m) - c(1)) / (m - 1)
// that the last k_floor rounds of m >= 2 gave (a wait only adds: each is the slope or more, so a
// round timed in a stall raises no price; a size's first verify, which builds its graph, gives
// none). Bounds older than window_rounds steps (rounds or AR steps) expire, and with none the
// prior slope holds: costs grow with the context, and a slope that once priced the drafts out
// would otherwise never be measured again (a stalled estimate would keep the controller in AR).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <vector>

namespace dfn {

// The controller's regime key of a request's sampling settings: 0 for greedy, else a hash of
// (temperature, top_k, top_p, min_p) that is never 0.
uint64_t regime_key(double temperature, int64_t top_k, double top_p, double min_p);

struct controller_params {
    int64_t window_rounds = 64;   // rounds the calibration and the speculative rate look back on
    int64_t min_rounds = 4;       // rounds before speculation is judged against AR (and a probe's length)
    int64_t ar_probe_every = 32;  // in SPEC mode, one AR step per this many rounds (x the lead, 1..4)
    int64_t backoff_min = 16;     // AR steps before the first re-probe of speculation
    int64_t backoff_max = 1024;
};

class controller {
public:
    enum class mode { ar, spec };
    static constexpr int k_bins = 12;

    explicit controller(int64_t max_block, controller_params p = {});
    controller(const controller &) = delete;  // r_ points into regimes_
    controller & operator=(const controller &) = delete;

    // A new request in sampling regime `regime` (0: greedy; else a key of the sampling settings,
    // regime_key): its mode and back-off start afresh; the cost estimates carry over as starting
    // points (properties of the machine and the pair, re-measured as it runs), and so does the
    // regime's window (the drafter's calibration depends on how the target's tokens are chosen: at
    // a temperature a confident draft is accepted far less often than under the argmax). When that
    // calibration says no round can beat an AR step, the request starts in AR: the count-down the
    // regime's last request left, or its last back-off (at least backoff_min), then a probe.
    void begin_request(uint64_t regime = 0);
    // What the next step is: AR or a round. The first step of a request is AR (it measures AR).
    mode next() const;
    // Drafts to verify, 0..n, from the drafter's top-1 probabilities p[0..n) of one draft pass.
    int64_t choose(const float * p, int64_t n) const;
    // Tree nodes to verify besides the root, 0..n-1, of a best-first tree (tree.h: parent[i] < i,
    // prob[i] node i's own drafter probability): the prefix of the node order (a tree itself,
    // parents come first) maximising E[committed] - lambda * c(nodes + 1), where a node's path
    // is accepted with the product of its nodes' calibrated probabilities.
    int64_t choose_tree(const int32_t * parent, const float * prob, int64_t n) const;

    // What a step cost and did (seconds: measured, or the fixed costs under set_fixed_costs).
    void observe_ar(double seconds);
    // k verified drafts with probabilities p[0..k), `accepted` of them accepted; next_hit (0 or 1,
    // -1: unknown): whether draft k + 1 (probability p[k]), drafted but not verified, equals the
    // bonus token after all k were accepted.
    void observe_round(const float * p, int64_t k, int64_t accepted, double draft_s, double verify_s,
                       int next_hit = -1);
    // A tree round of n_verified tokens (root included) that committed `committed`; outcomes:
    // each child of each accepted node (the root first), (its probability, accepted or not).
    void observe_tree_round(const std::vector<std::pair<float, bool>> & outcomes, int64_t n_verified,
                            int64_t committed, double draft_s, double verify_s);

    // Tests: replace the measured times by c(n) = v0 + v1 * n, t_draft and t_ar.
    void set_fixed_costs(double t_ar, double t_draft, double v0, double v1);
    // Tests: a busy machine, made up: each step's measured time is replaced by those costs plus,
    // with probability spike_p (a seeded draw per step), spike_s seconds, and the estimates are
    // made from these times as from measured ones.
    void set_synthetic_costs(double t_ar, double t_draft, double v0, double v1, double spike_s, double spike_p,
                             uint64_t seed);

    // Read-outs (engine stats, benchmarks, tests).
    double ar_cost() const { return ar_.value() + stall(); }
    double draft_cost() const { return draft_.value() + stall(); }
    double stall() const;  // the mean wait per graph run (a step's time over its floor) of late
    double verify_cost(int64_t n) const;  // c(n): the line under the timed sizes' floors
    double calibrated(float p) const;     // acceptance probability of a draft of top-1 probability p
    double spec_rate() const;             // tokens/s of the window's rounds (0: none yet)
    // Whether a round of the best case the calibration allows (every draft in the top p-bin, any
    // number of drafts) would commit tokens faster than AR steps, at the current costs.
    bool round_can_win() const;
    int64_t n_regimes() const { return (int64_t) regimes_.size(); }
    mode current() const { return mode_; }
    int64_t switches() const { return switches_; }
    // The window's drafts per p-bin: (observed, accepted), bins split at k_bin_edges.
    std::pair<int64_t, int64_t> bin_counts(int b) const { return {r_->bin_n[b], r_->bin_hit[b]}; }

private:
    // A cost's last k_floor samples, each with the step it was taken at; its value is their least
    // (0: none yet), or the least of those taken at step `since` or later (-1: none).
    static constexpr int k_floor = 8;
    struct floor_cost {
        double s[k_floor] = {};
        int64_t at[k_floor] = {};
        int64_t n = 0;  // samples seen
        void add(double seconds, int64_t step) { s[n % k_floor] = seconds, at[n % k_floor] = step, ++n; }
        double value(int64_t since = INT64_MIN) const;
    };
    struct round_obs {
        int64_t n = 0;  // verified tokens (its price: t_draft + c(n) at the current costs)
        int64_t tokens = 0;
        std::vector<std::pair<uint8_t, bool>> outcomes;  // (p-bin, accepted) per observed draft
        bool timed = true;  // counts in the speculative rate (false: a round of an earlier request)
    };
    static int bin_of(float p);
    // bin b's observed acceptance with the prior "q = p" (weight k_prior_weight) folded in
    double calibrated_in(int b, double p) const;
    void line(double & a, double & b) const;  // the floors' c(n) = a + b * n, b >= 0
    void add_excess(double seconds);          // one graph run's time over its floor
    double synthetic(double base);            // set_synthetic_costs: base + a spike, or not
    void forget_rounds();  // empties the window (a new probe measures fresh)
    void forget_rate();    // keeps the window's calibration, drops its rounds from the rate
    void settle_mode();    // after a round or an AR step: switch when the evidence says so
    // observe_round's and observe_tree_round's common part: a round of n verified tokens
    void observe(round_obs o, int64_t n, double draft_s, double verify_s);
    double lambda() const;  // the rate to beat

    controller_params p_;
    int64_t max_block_;
    // costs (seconds)
    floor_cost ar_, draft_, v1_;  // an AR step, a draft pass, a verify of 1 token
    // bounds on the verify slope, (verify(n) - c(1)) / (n - 1), from rounds of n >= 2 tokens
    floor_cost slope_;
    std::deque<double> excess_;  // the last window_rounds graph runs' times over their floors
    double excess_sum_ = 0;
    std::vector<int64_t> timed_verify_;  // [max_block + 1]: verifies of n tokens timed
    int64_t n_steps_ = 0;                // steps observed (all requests): the clock of the samples
    bool fixed_ = false;
    double fixed_ar_ = 0, fixed_draft_ = 0, fixed_v0_ = 0, fixed_v1_ = 0;
    bool synthetic_ = false;  // set_synthetic_costs: the fixed_ costs plus spikes, measured
    double spike_s_ = 0, spike_p_ = 0;
    uint64_t rng_ = 0;
    // Per sampling regime: the acceptance calibration over the window, the window's rate, and the
    // back-off its last fall-back left (kept for the regime's next request). The most recently
    // used k_max_regimes regimes are kept, the current one first.
    struct regime_state {
        std::deque<round_obs> window;
        int64_t bin_hit[k_bins] = {}, bin_n[k_bins] = {};
        int64_t win_n = 0;  // verified and committed tokens of the window's timed rounds
        int64_t win_tokens = 0;
        int64_t win_timed = 0;  // the window's timed rounds
        int64_t backoff = 0;
        int64_t ar_left = 0;  // AR steps its last request had left before a probe (0: none)
    };
    static constexpr size_t k_max_regimes = 8;
    std::list<std::pair<uint64_t, regime_state>> regimes_;
    regime_state * r_ = nullptr;  // the current request's: regimes_.front()
    // mode
    mode mode_ = mode::ar;
    bool probing_ = false;
    int64_t ar_left_ = 1;          // AR steps before the next round (the first step measures AR)
    int64_t rounds_since_ar_ = 0;  // SPEC: rounds since the last AR probe
    int64_t backoff_ = 0;
    int64_t switches_ = 0;
};

}  // namespace dfn
