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
    : p_(p), max_block_(max_block), t_verify_(max_block + 1, 0.0), n_verify_(max_block + 1, 0),
      seen_verify_(max_block + 1, 0) {
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
    if (t_ar_ <= 0 || q < 0) return true;  // nothing measured: find out
    const double ar_rate = 1.0 / t_ar_;
    double expect = 1.0, run = 1.0;
    for (int64_t k = 1; k < max_block_; ++k) {
        run *= q;
        expect += run;
        if (expect / (t_draft_ + verify_cost(k + 1)) > ar_rate) return true;
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
    r_->win_s = 0;
    r_->win_tokens = 0;
    r_->win_timed = 0;
}

controller::mode controller::next() const {
    if (mode_ == mode::ar) return mode::ar;
    // The AR cost decides only near the margin (fall back or not; lambda is the spec rate while
    // it is higher): the further ahead speculation is, the rarer the probe, up to 4x apart.
    const double ahead = std::clamp(spec_rate() * t_ar_, 1.0, 4.0);
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

double controller::spec_rate() const { return r_->win_s > 0 ? r_->win_tokens / r_->win_s : 0.0; }

double controller::verify_cost(int64_t n) const {
    if (fixed_) return fixed_v0_ + fixed_v1_ * n;
    // Weighted least squares over the timed sizes, the AR step standing for size 1 (timed every
    // ar_probe_every rounds at most, so always recent); a size's weight halves every
    // window_rounds rounds since it was last timed.
    double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    auto add = [&](double x, double y, double w) {
        sw += w, sx += w * x, sy += w * y, sxx += w * x * x, sxy += w * x * y;
    };
    if (n_ar_ > 0) add(1, t_ar_, 1);
    for (int64_t m = 1; m <= max_block_; ++m)
        if (n_verify_[m] > 0) {
            const double age = (double) (n_rounds_ - seen_verify_[m]) / (double) p_.window_rounds;
            add((double) m, t_verify_[m], (double) std::min<int64_t>(n_verify_[m], 8) * std::exp2(-age));
        }
    if (sw == 0) return 0;
    const double den = sw * sxx - sx * sx;
    if (den <= 1e-12 * sw * sw) {  // one size known: the prior slope through it
        const double x0 = sx / sw, y0 = sy / sw;
        const double c1 = y0 / (1 + k_prior_slope * (x0 - 1));
        return c1 * (1 + k_prior_slope * (n - 1));
    }
    const double b = (sw * sxy - sx * sy) / den, a = (sy - b * sx) / sw;
    return std::max(a + b * n, 1e-9);
}

double controller::lambda() const {
    // no AR time yet cannot happen: a request starts with an AR step
    return std::max(spec_rate(), t_ar_ > 0 ? 1.0 / t_ar_ : 0.0);
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

double controller::ewma(double old, double sample, int64_t n_seen) {
    if (n_seen <= 1) return sample;
    // a graph built for a new shape, or a stolen time slice, is one slow sample, not a new cost
    sample = std::min(sample, 3.0 * old);
    const double a = std::max(1.0 / (double) n_seen, 0.2);
    return old + a * (sample - old);
}

void controller::set_fixed_costs(double t_ar, double t_draft, double v0, double v1) {
    fixed_ = true;
    t_ar_ = t_ar, t_draft_ = t_draft, fixed_v0_ = v0, fixed_v1_ = v1;
    n_ar_ = n_draft_ = 1;
}

void controller::observe_ar(double seconds) {
    if (!fixed_) t_ar_ = ewma(t_ar_, seconds, ++n_ar_);
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
    if (fixed_) {
        draft_s = t_draft_;
        verify_s = verify_cost(n);
    } else {
        t_draft_ = ewma(t_draft_, draft_s, ++n_draft_);
        if (n <= max_block_) {
            // a size's first time is priced no higher than 3x what the line says it should cost
            // (later samples are capped by ewma against the size's own estimate)
            double s = verify_s;
            if (n_verify_[n] == 0) {
                const double line = verify_cost(n);
                if (line > 0) s = std::min(s, 3.0 * line);
            }
            t_verify_[n] = ewma(t_verify_[n], s, ++n_verify_[n]);
            seen_verify_[n] = n_rounds_;
        }
    }
    o.seconds = draft_s + verify_s;
    regime_state & r = *r_;
    for (auto [b, hit] : o.outcomes) r.bin_n[b] += 1, r.bin_hit[b] += hit;
    r.win_s += o.seconds;
    r.win_tokens += o.tokens;
    ++r.win_timed;
    r.window.push_back(std::move(o));
    if ((int64_t) r.window.size() > p_.window_rounds) {
        const round_obs & old = r.window.front();
        for (auto [b, hit] : old.outcomes) r.bin_n[b] -= 1, r.bin_hit[b] -= hit;
        if (old.timed) {
            r.win_s -= old.seconds;
            r.win_tokens -= old.tokens;
            --r.win_timed;
        }
        r.window.pop_front();
    }
    ++rounds_since_ar_;
    ++n_rounds_;
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
    if (r_->win_timed < p_.min_rounds || t_ar_ <= 0) return;
    if (spec_rate() < 1.0 / t_ar_) {  // losing to AR: fall back, for longer after a failed probe
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
