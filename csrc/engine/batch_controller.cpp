#include "engine/batch_controller.h"

#include <algorithm>
#include <cstddef>

namespace dfn {

batch_controller::batch_controller(int max_requests, batch_controller_params p)
    : p_(p), w_((size_t) width_class(std::max(max_requests, 1)) + 1) {
    // left = 0: a width class's first steps are an AR run for every request (they measure AR)
}

int batch_controller::width_class(int n) {
    int c = 0;
    while (n > 1) n >>= 1, ++c;
    return c;
}

batch_controller::width_state * batch_controller::state(int n) {
    return n <= 0 || width_class(n) >= (int) w_.size() ? nullptr : &w_[width_class(n)];
}

const batch_controller::width_state * batch_controller::state(int n) const {
    return n <= 0 || width_class(n) >= (int) w_.size() ? nullptr : &w_[width_class(n)];
}

void batch_controller::set_params(const batch_controller_params & p) {
    p_ = p;
    w_.assign(w_.size(), width_state{});
    streak_ = 0;
}

bool batch_controller::speculate(int n) const {
    const width_state * s = state(n);
    if (!p_.enabled || !s) return true;
    return !s->ar_mode && s->left > 0;
}

double batch_controller::rate_of(const std::deque<sample> & w) {
    // a stall is a step that took far longer than the others, whatever it committed: a step's
    // tokens vary with its acceptance (a speculative step that committed little is its mode's
    // cost, not a stall), its seconds with its work and the machine
    std::vector<double> secs;
    for (const sample & x : w)
        if (x.tokens > 0) secs.push_back(x.seconds);
    if (secs.empty()) return 0;
    // the lower median: of two steps, one stalled, the other sets the cap
    const size_t mid = (secs.size() - 1) / 2;
    std::nth_element(secs.begin(), secs.begin() + (std::ptrdiff_t) mid, secs.end());
    const double cap = k_stall * secs[mid];
    double tokens = 0, seconds = 0;
    for (const sample & x : w) {
        if (x.tokens <= 0 || x.seconds > cap) continue;
        tokens += x.tokens, seconds += x.seconds;
    }
    return seconds > 0 ? tokens / seconds : 0;
}

double batch_controller::rate(int n, bool speculated) const {
    const width_state * s = state(n);
    return s ? rate_of(speculated ? s->spec : s->ar) : 0;
}

void batch_controller::judge(width_state & s) {
    const int64_t seen = s.probing ? s.probe_seen : (int64_t) s.spec.size();
    if (seen < p_.probe_steps || s.ar.empty()) return;
    if (rate_of(s.spec) < p_.margin * rate_of(s.ar)) {
        s.backoff = s.probing ? std::min(std::max(s.backoff * 2, p_.backoff_min), p_.backoff_max) : p_.backoff_min;
        s.ar_mode = true;
        s.probing = false;
        s.left = s.backoff;
        switches_ += 1;
    } else if (s.probing) {
        s.probing = false;
        s.backoff = p_.backoff_min;
    }
}

void batch_controller::observe(int n, bool speculated, int64_t tokens, double seconds, int n_stepping) {
    width_state * ps = state(n);
    if (!p_.enabled || !ps || tokens <= 0 || !(seconds > 0)) return;
    width_state & s = *ps;
    const bool imposed = !speculate(n);
    if (imposed && !speculated) forced_ += 1;
    // the first steps after a step of the other mode (or the very first) pay for the switch: not measured
    const int64_t same = speculated ? std::max<int64_t>(streak_, 0) : std::max<int64_t>(-streak_, 0);
    const bool measured = same >= p_.settle_steps;
    streak_ = speculated ? same + 1 : -(same + 1);
    std::deque<sample> & w = speculated ? s.spec : s.ar;
    if (measured) {
        w.push_back({(double) tokens / (double) (n_stepping > 0 ? n_stepping : n), seconds});
        while ((int64_t) w.size() > (speculated ? p_.spec_window : p_.ar_window)) w.pop_front();
    }
    if (s.ar_mode) {
        if (!speculated && --s.left <= 0) {  // the back-off is over: probe speculation afresh
            s.ar_mode = false;
            s.probing = true;
            s.probe_seen = 0;
            s.spec.clear();
            s.left = p_.ar_every;
            switches_ += 1;
        }
        return;
    }
    if (!speculated) {
        if (imposed && ++s.run >= p_.ar_run) {  // the periodic AR run was taken
            s.run = 0;
            s.left = p_.ar_every;
        }
        return;
    }
    s.left -= 1;
    if (s.probing && measured) s.probe_seen += 1;
    judge(s);
}

}  // namespace dfn
