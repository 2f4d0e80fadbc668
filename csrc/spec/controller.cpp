#include "spec/controller.h"

#include <algorithm>
#include <cmath>

namespace dfn {

namespace {
// Upper edges of the p-bins: finer near 1, where a good drafter's probabilities gather.
constexpr float k_bin_edges[controller::k_bins - 1] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f,
                                                       0.7f, 0.8f, 0.9f, 0.95f, 0.98f};
// Weight of the prior "the drafter is calibrated" (q = p) against a bin's observed rounds.
constexpr double k_prior_weight = 2.0;
// Before any verify of more than one token has been timed: c(n) = c(1) * (1 + slope * (n - 1)).
// On a CPU a verify of n tokens costs about an AR step plus a share per token.
constexpr double k_prior_slope = 0.15;
}  // namespace

uint64_t regime_key(double temperature, int64_t top_k, double top_p, double min_p) {
    if (temperature == 0.0) return 0;
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the settings' bytes
    auto mix = [&](const void * v, size_t n) {
        for (size_t i = 0; i < n; ++i) h = (h ^ ((const unsigned char *) v)[i]) * 0x100000001b3ull;
    };
    mix(&temperature, sizeof temperature);
    mix(&top_k, sizeof top_k);
    mix(&top_p, sizeof top_p);
    mix(&min_p, sizeof min_p);
    return h == 0 ? 1 : h;
}

controller::controller(int64_t max_block, controller_params p)
    : p_(p), max_block_(max_block), timed_verify_(max_block + 1, 0) {
    regimes_.emplace_front(0, regime_state{});
    r_ = &regimes_.front().second;
}

void controller::begin_request(uint64_t regime) {
    r_->ar_left = mode_ == mode::ar && backoff_ > 0 ? ar_left_ : 0;  // the outgoing request's count-down
    auto it = std::find_if(regimes_.begin(), regimes_.end(), [&](const auto & e) { return e.first == regime; });
    if (it != regimes_.end()) {
        regimes_.splice(regimes_.begin(), regimes_, it);
    } else {
        regimes_.emplace_front(regime, regime_state{});
        if (regimes_.size() > k_max_regimes) regimes_.pop_back();
    }
    r_ = &regimes_.front().second;
    // The window's calibration carries over: how often this drafter's drafts of a given
    // confidence are accepted changes slowly, and a short request would otherwise spend its few
    // rounds on the prior (a request's own rounds replace the old ones as they run). Its
    // speculative rate does not: it was measured at another context length, on other text, and
    // speculation is judged against AR on this request's rounds only.
    forget_rate();
    mode_ = mode::ar;
    ar_left_ = 1;
    probing_ = false;
    backoff_ = 0;
    rounds_since_ar_ = 0;
    switches_ = 0;
    if (!round_can_win()) {
        // the regime's calibration says speculation loses: AR first, continuing the count-down
        // its last request left (so that short requests still reach a probe), then a probe
        backoff_ = std::max(r_->backoff, p_.backoff_min);
        ar_left_ = r_->ar_left > 0 ? r_->ar_left : backoff_;
    }
}

bool controller::round_can_win() const {
    // q: the best acceptance the calibration allows, over the p-bins it has seen drafts in (each
    // at its upper edge, so the prior leans optimistic)
    double q = -1.0;
    for (int b = 0; b < k_bins; ++b) {
        if (r_->bin_n[b] > 0) q = std::max(q, calibrated_in(b, b < k_bins - 1 ? k_bin_edges[b] : 1.0));
    }
    const double t_ar = ar_cost(), t_draft = draft_cost();
    if (t_ar <= 0 || q < 0) return true;  // nothing measured: find out
    const double ar_rate = 1.0 / t_ar;
    double expect = 1.0, run = 1.0;
    for (int64_t k = 1; k < max_block_; ++k) {
        run *= q;
        expect += run;
        if (expect / (t_draft + verify_cost(k + 1)) > ar_rate) return true;
    }
    return false;
}

void controller::forget_rounds() {
    r_->window.clear();
    std::fill(std::begin(r_->bin_hit), std::end(r_->bin_hit), 0);
    std::fill(std::begin(r_->bin_n), std::end(r_->bin_n), 0);
    forget_rate();
}

void controller::forget_rate() {
    for (round_obs & o : r_->window) o.timed = false;
    r_->win_n = 0;
    r_->win_tokens = 0;
    r_->win_timed = 0;
}

controller::mode controller::next() const {
    if (mode_ == mode::ar) return mode::ar;
    // The AR cost decides only near the margin (fall back or not; lambda is the spec rate while
    // it is higher): the further ahead speculation is, the rarer the probe, up to 4x apart.
    const double ahead = std::clamp(spec_rate() * ar_cost(), 1.0, 4.0);
    return rounds_since_ar_ >= (int64_t) std::lround(p_.ar_probe_every * ahead) ? mode::ar : mode::spec;
}

int controller::bin_of(float p) {
    int b = 0;
    while (b < k_bins - 1 && p >= k_bin_edges[b]) ++b;
    return b;
}

double controller::calibrated_in(int b, double p) const {
    return (r_->bin_hit[b] + k_prior_weight * p) / (r_->bin_n[b] + k_prior_weight);
}

double controller::calibrated(float p) const { return calibrated_in(bin_of(p), p); }

double controller::floor_cost::value(int64_t since) const {
    double v = -1;
    for (int64_t i = 0; i < std::min<int64_t>(n, k_floor); ++i)
        if (at[i] >= since && (v < 0 || s[i] < v)) v = s[i];
    return since == INT64_MIN && v < 0 ? 0 : v;
}

double controller::spec_rate() const {
    // the window's rounds at the current costs (see the header: not their wall seconds)
    double a, b;
    line(a, b);
    const double seconds = (double) r_->win_timed * (draft_cost() + a + stall()) + b * (double) r_->win_n;
    return r_->win_timed > 0 && seconds > 0 ? r_->win_tokens / seconds : 0.0;
}

double controller::verify_cost(int64_t n) const {
    double a, b;
    line(a, b);
    return std::max(a + b * n, 1e-9) + stall();
}

double controller::stall() const { return excess_.empty() ? 0.0 : excess_sum_ / (double) excess_.size(); }

void controller::add_excess(double seconds) {
    excess_.push_back(std::max(seconds, 0.0));
    excess_sum_ += excess_.back();
    if ((int64_t) excess_.size() > p_.window_rounds) excess_sum_ -= excess_.front(), excess_.pop_front();
}

void controller::line(double & a, double & b) const {
    a = b = 0;
    if (fixed_ && !synthetic_) {
        a = fixed_v0_, b = fixed_v1_;
        return;
    }
    // c(1): the least of the AR floor and the floor of a verify of one token (the same work)
    double c1 = ar_.value();  // the floors, without the stall
    if (v1_.n > 0) c1 = c1 > 0 ? std::min(c1, v1_.value()) : v1_.value();
    if (c1 <= 0) return;
    // the slope: the least of its recent bounds; before any, c(n) = c(1) * (1 + slope * (n - 1))
    const double lo = slope_.value(n_steps_ - p_.window_rounds);
    b = lo < 0 ? c1 * k_prior_slope : lo;
    a = c1 - b;
}

double controller::lambda() const {
    // no AR time yet cannot happen: a request starts with an AR step
    const double t_ar = ar_cost();
    return std::max(spec_rate(), t_ar > 0 ? 1.0 / t_ar : 0.0);
}

int64_t controller::choose(const float * p, int64_t n) const {
    const double lambda = this->lambda();
    int64_t best_k = 0;
    double best = 1.0 - lambda * verify_cost(1);
    double run = 1.0, expect = 1.0;  // P(d_1..d_j all accepted), E[committed | k = j]
    for (int64_t j = 1; j <= n; ++j) {
        run *= calibrated(p[j - 1]);
        expect += run;
        const double v = expect - lambda * verify_cost(j + 1);
        if (v > best) best = v, best_k = j;
        if (run < 1e-4) break;  // nothing further can pay for itself
    }
    return best_k;
}

int64_t controller::choose_tree(const int32_t * parent, const float * prob, int64_t n) const {
    const double lambda = this->lambda();
    std::vector<double> reach((size_t) std::max<int64_t>(n, 1), 1.0);  // P(the path to node i is accepted)
    int64_t best_m = 0;
    double best = 1.0 - lambda * verify_cost(1), expect = 1.0;
    for (int64_t i = 1; i < n && i < max_block_; ++i) {
        reach[i] = reach[parent[i]] * calibrated(prob[i]);
        expect += reach[i];
        const double v = expect - lambda * verify_cost(i + 1);
        if (v > best) best = v, best_m = i;
    }
    return best_m;
}

void controller::set_fixed_costs(double t_ar, double t_draft, double v0, double v1) {
    fixed_ = true;
    synthetic_ = false;
    fixed_ar_ = t_ar, fixed_draft_ = t_draft, fixed_v0_ = v0, fixed_v1_ = v1;
    ar_ = draft_ = floor_cost{};
    ar_.add(t_ar, n_steps_);
    draft_.add(t_draft, n_steps_);
}

void controller::set_synthetic_costs(double t_ar, double t_draft, double v0, double v1, double spike_s, double spike_p,
                                     uint64_t seed) {
    set_fixed_costs(t_ar, t_draft, v0, v1);
    synthetic_ = true;
    spike_s_ = spike_s, spike_p_ = spike_p, rng_ = seed;
    ar_ = draft_ = v1_ = slope_ = floor_cost{};
    excess_.clear();
    excess_sum_ = 0;
    std::fill(timed_verify_.begin(), timed_verify_.end(), 0);
}

double controller::synthetic(double base) {
    rng_ += 0x9e3779b97f4a7c15ull;  // splitmix64
    uint64_t z = rng_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double) (z >> 11) * 0x1.0p-53 < spike_p_ ? base + spike_s_ : base;
}

void controller::observe_ar(double seconds) {
    if (synthetic_) seconds = synthetic(fixed_ar_);
    if (!fixed_ || synthetic_) {
        ar_.add(seconds, n_steps_);
        add_excess(seconds - ar_.value());
    }
    ++n_steps_;
    if (mode_ == mode::ar) {
        --ar_left_;
    } else {
        rounds_since_ar_ = 0;
    }
    settle_mode();
}

void controller::observe_round(const float * p, int64_t k, int64_t accepted, double draft_s, double verify_s,
                               int next_hit) {
    round_obs o;
    o.tokens = accepted + 1;
    for (int64_t i = 0; i < std::min(accepted + 1, k); ++i) o.outcomes.emplace_back((uint8_t) bin_of(p[i]), i < accepted);
    if (next_hit >= 0 && accepted == k) o.outcomes.emplace_back((uint8_t) bin_of(p[k]), next_hit == 1);
    observe(std::move(o), k + 1, draft_s, verify_s);
}

void controller::observe_tree_round(const std::vector<std::pair<float, bool>> & outcomes, int64_t n_verified,
                                    int64_t committed, double draft_s, double verify_s) {
    round_obs o;
    o.tokens = committed;
    for (auto [p, hit] : outcomes) o.outcomes.emplace_back((uint8_t) bin_of(p), hit);
    observe(std::move(o), n_verified, draft_s, verify_s);
}

void controller::observe(round_obs o, int64_t n, double draft_s, double verify_s) {
    if (synthetic_) draft_s = synthetic(fixed_draft_), verify_s = synthetic(fixed_v0_ + fixed_v1_ * (double) n);
    if (!fixed_ || synthetic_) {
        draft_.add(draft_s, n_steps_);
        add_excess(draft_s - draft_.value());
        // a size's first verify builds its graph: a stall like a wait, left out of the slope
        const bool first = n <= max_block_ && timed_verify_[n]++ == 0;
        double a, b;
        if (n == 1) {
            v1_.add(verify_s, n_steps_);
        } else if (!first) {
            line(a, b);
            slope_.add(std::max((verify_s - (a + b)) / (double) (n - 1), 0.0), n_steps_);  // a + b: c(1)
        }
        line(a, b);
        if (!first) add_excess(verify_s - (a + b * (double) n));
    }
    ++n_steps_;
    o.n = n;
    regime_state & r = *r_;
    for (auto [b, hit] : o.outcomes) r.bin_n[b] += 1, r.bin_hit[b] += hit;
    r.win_n += o.n;
    r.win_tokens += o.tokens;
    ++r.win_timed;
    r.window.push_back(std::move(o));
    if ((int64_t) r.window.size() > p_.window_rounds) {
        const round_obs & old = r.window.front();
        for (auto [b, hit] : old.outcomes) r.bin_n[b] -= 1, r.bin_hit[b] -= hit;
        if (old.timed) {
            r.win_n -= old.n;
            r.win_tokens -= old.tokens;
            --r.win_timed;
        }
        r.window.pop_front();
    }
    ++rounds_since_ar_;
    settle_mode();
}

void controller::settle_mode() {
    if (mode_ == mode::ar) {
        if (ar_left_ > 0) return;
        // speculation (again): a probe when it was left for losing, with a fresh window (at a
        // request's start only the rate is fresh: begin_request)
        probing_ = backoff_ > 0;
        if (probing_) {
            ++switches_;
            forget_rounds();
        }
        mode_ = mode::spec;
        rounds_since_ar_ = 0;
        return;
    }
    const double t_ar = ar_cost();
    if (r_->win_timed < p_.min_rounds || t_ar <= 0) return;
    if (spec_rate() < 1.0 / t_ar) {  // losing to AR: fall back, for longer after a failed probe
        backoff_ = probing_ ? std::min(2 * backoff_, p_.backoff_max) : p_.backoff_min;
        r_->backoff = backoff_;
        ar_left_ = backoff_;
        probing_ = false;
        mode_ = mode::ar;
        ++switches_;
    } else if (probing_) {  // the probe won: the next fall-back starts from the shortest backoff
        probing_ = false;
        backoff_ = 0;
        r_->backoff = 0;
    }
}

}  // namespace dfn
