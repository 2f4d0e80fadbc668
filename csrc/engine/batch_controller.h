// The batch's own check on speculation (engine/scheduler.h; issue 35, "Speculate for the batch"):
// a batch never commits fewer tokens per second than batched AR would on the same requests.
//
// Each request's controller (spec/controller.h) chooses its verify length, or AR, from its share
// of the shared pass (batch_costs.h). Those prices leave out what a step costs besides the target
// pass: the drafter's pass, the planning, acceptance and commit of every request, which on a small
// pair with many requests outweigh what the verified drafts save. This controller judges the
// whole step instead, by what it measured: the engine's committed tokens per second over its steps
// that speculated (any request verified drafts) against its steps that were AR for every request,
// at the same number of requests in the pass. When speculation is the slower, every speculative
// request takes AR steps (spec_session::plan_ar: exact, the ring kept in step) for a back-off of
// steps, then speculation is probed again for `probe_steps` steps: kept when it wins by `margin`
// (1.1: per measured step it must commit 10% more than AR, because what those rates leave out --
// the admissions of requests that finish apart, their riding prompts, the drain of the last ones
// -- costs speculation more: on the embedded pair at 8-16 requests whole runs of speculative
// requests measured 0.8-0.9x batched AR while their steps measured 1.0-1.1x), else the
// back-off doubles (up to backoff_max). While speculation is kept, a run of `ar_run` steps in every
// `ar_every` + `ar_run` is AR for every request, so that the AR rate stays current (it moves with
// the contexts' lengths).
//
// The first `settle_steps` steps after a step of the other mode are not measured: they pay for the
// switch, not for their mode. The first AR steps after speculative ones find the target's weights
// out of the caches that the drafter's pass and the wide verify filled (on the embedded pair at 8
// requests: 6.9, 4.6, 3.6, then 2.9-3.3 ms), and the first speculative step after AR steps pushes
// the features of every token they committed into the drafter. Measured with them, a lone
// periodic AR step priced AR at 0.6-0.7x its steady rate, and the batch kept speculating where
// batched AR was the faster.
//
// Steps are judged by width class (the number of requests in the step's pass, riding prompts too:
// 1, 2-3, 4-7, 8-15, ...), so that a batch whose requests come and go still gathers enough steps
// of each kind; within a class a step counts as committed tokens per request per second (tokens
// over the requests that stepped, over seconds), which compares steps of neighbouring widths.
// Rates are ratios of sums over each mode's last measured steps, without the steps whose seconds
// exceed k_stall times the window's lower median (a stall of the machine, not the step's cost; not
// seconds per token, which a speculative step's acceptance moves as much as a stall does), so that
// a heavy-tailed wait for a core enters neither rate; a steady load slows both alike, and both are
// measured within a few dozen steps of each other.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace dfn {

struct batch_controller_params {
    bool enabled = true;        // false: the batch always speculates (each request's controller alone)
    int64_t ar_every = 32;      // SPEC: speculative steps between two runs of all-AR steps
    int64_t ar_run = 6;         // SPEC: all-AR steps a run takes (> settle_steps: the first are not measured)
    int64_t settle_steps = 3;   // steps after a change of mode that are not measured
    double margin = 1.1;        // speculation is kept while its rate is at least this times AR's
    int64_t probe_steps = 4;    // speculative steps a probe (and the first judgement) takes
    int64_t backoff_min = 16;   // all-AR steps before the first re-probe
    int64_t backoff_max = 1024;
    int64_t spec_window = 32;   // speculative steps the rate looks back on
    int64_t ar_window = 8;      // all-AR steps the rate looks back on
};

class batch_controller {
public:
    explicit batch_controller(int max_requests, batch_controller_params p = {});
    // New settings (tests); the measurements and modes start afresh.
    void set_params(const batch_controller_params & p);
    const batch_controller_params & params() const { return p_; }
    // Whether the next step over n requests may speculate (false: each speculative request's step
    // is an AR step).
    bool speculate(int n) const;
    // A step over n requests committed `tokens` in `seconds` (its riding prompts' share of the pass
    // left out); speculated: any of them verified drafts. n is the step's width class: the requests
    // in its pass, prompts riding in it too; n_stepping (default n) those that committed tokens,
    // whose rate per request the step measures.
    void observe(int n, bool speculated, int64_t tokens, double seconds, int n_stepping = 0);

    // Read-outs (metrics, tests): tokens per request per second of each mode's window in n's width
    // class (0: no step yet), the mode's changes so far, and the all-AR steps the controller imposed.
    double rate(int n, bool speculated) const;
    static int width_class(int n);  // 0 for 1, 1 for 2-3, 2 for 4-7, ...
    int64_t switches() const { return switches_; }
    int64_t forced_ar_steps() const { return forced_; }

private:
    static constexpr double k_stall = 3.0;
    struct sample {
        double tokens;  // committed tokens per request in the step
        double seconds;
    };
    struct width_state {
        std::deque<sample> spec, ar;
        bool ar_mode = false;
        bool probing = false;  // SPEC for probe_steps steps after an AR back-off
        int64_t left = 0;      // AR mode: all-AR steps before the probe; SPEC: steps before an AR run
        int64_t run = 0;       // SPEC: all-AR steps taken in the current run
        int64_t backoff = 0;
        int64_t probe_seen = 0;  // speculative steps measured in this probe
    };
    static double rate_of(const std::deque<sample> & w);
    void judge(width_state & s);

    batch_controller_params p_;
    std::vector<width_state> w_;  // by width class
    width_state * state(int n);
    const width_state * state(int n) const;
    int64_t switches_ = 0, forced_ = 0;
    int64_t streak_ = 0;  // the last observed steps of one mode: +k speculative, -k AR, 0 none yet
};

}  // namespace dfn
