// Which instruction set each weight type's matmul runs at, per engine, chosen by measuring it.
//
// The matmul computes the same bits at every level (matmul.h's contract), so the level is only a
// matter of speed, and the CPU's best is not always the fastest: AMD Zen 4 executes a 512-bit
// instruction as two 256-bit halves, and a kernel whose inner loop is shuffles or conversions can
// lose to its AVX2 form there. So an engine times its own matmuls when it loads (tune_matmul):
//
//   for each weight type it holds (target, then drafter; a type measured once per engine):
//     W = the first rows (at most k_tune_bytes) of its largest matrix of that type
//     for N in {1 (decode), k_tune_cols (a verify / draft block)}:
//       x = [K, N] fixed values; y = matmul_op(W, x) in a graph on the engine's own runner
//       (its threads, its backend), at every candidate level: the CPU's best, and AVX2 below
//       AVX-512. Each level once to warm up, then k_tune_reps runs alternating the levels;
//       each level's time is its fastest run.
//     level[type][regime] = the fastest level, except that the CPU's best is kept unless another
//       is faster by more than k_tune_margin (the machine's run-to-run noise is ~1-5%).
//
// matmul_op then runs level[W's type][N == 1 ? 0 : 1] (never above isa_in_use()). Not measured,
// every matmul at isa_in_use(): when the user chose the level (DFLASH_NATIVE_ISA or set_isa: that
// level everywhere), with DFLASH_NATIVE_TUNE=0, with ggml's kernels (matmul="ggml"), or on the GPU.
// The other own kernels (attention, conv, GDN, top-1, sampler) run isa_in_use() always.
//
// Cost: per type 2 regimes x 2 levels x (1 + k_tune_reps) matmuls over <= k_tune_bytes of weights:
// tens of milliseconds at load for a 0.5B model (bench/ar_decode.py records it per file), about a
// millisecond for the tiny test models.
#pragma once

#include "base/cpu_isa.h"

#include "ggml.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dfn {

class graph_runner;

struct matmul_dispatch {
    static constexpr int k_regimes = 2;            // 0: one column (decode); 1: more (verify, draft)
    static constexpr int64_t k_tune_cols = 16;     // the columns regime 1 is measured at
    static constexpr size_t k_tune_bytes = size_t(16) << 20;
    static constexpr int k_tune_reps = 5;
    static constexpr double k_tune_margin = 0.05;

    // One measurement: the matrix, the seconds per level (fastest run), the level chosen.
    struct choice {
        ggml_type type = GGML_TYPE_F32;
        int regime = 0;
        std::string tensor;
        int64_t rows = 0, K = 0, N = 0;
        std::vector<std::pair<isa_level, double>> seconds;
        isa_level level = isa_level::portable;
        double wall = 0.0;  // seconds the measurement took (warm-up and every run)
    };

    matmul_dispatch() {
        for (auto & r : level_) r.fill(-1);
    }

    // The level a matmul of `type` weights over n_cols columns runs at.
    isa_level isa_for(ggml_type type, int64_t n_cols) const {
        const isa_level cap = isa_in_use();
        if ((int) type < 0 || (int) type >= GGML_TYPE_COUNT || isa_user_chosen()) return cap;
        const int l = level_[type][n_cols > 1 ? 1 : 0];
        return l < 0 || (isa_level) l > cap ? cap : (isa_level) l;
    }
    bool measured(ggml_type type) const { return level_[type][0] >= 0; }
    void set(const choice & c) {
        force(c.type, c.regime, c.level);
        choices.push_back(c);
    }
    void force(ggml_type type, int regime, isa_level level) { level_[type][regime] = (int8_t) level; }
    // Undoes a type's measurement (both regimes back to isa_in_use(); its choices dropped).
    void forget(ggml_type type) {
        level_[type].fill(-1);
        choices.erase(std::remove_if(choices.begin(), choices.end(), [&](const choice & c) { return c.type == type; }),
                      choices.end());
    }
    // The measured choices that differ from isa_in_use(), for stats and benchmark lines:
    // "" or "matmul q4_K x1 avx2, q6_K x16 avx2".
    std::string deviations() const;

    std::vector<choice> choices;  // in the order measured

private:
    std::array<std::array<int8_t, k_regimes>, GGML_TYPE_COUNT> level_{};  // -1: not measured
};

// Measures the levels for the weight types among `weights` not measured yet on this runner (see
// above) and records them in runner.dispatch(). Does nothing where nothing is to be chosen. Never
// throws for the measurement itself: a run that fails (out of memory) undoes that type's
// measurement and ends the tuning, and the engine loads with the types left at isa_in_use().
void tune_matmul(graph_runner & runner, const std::vector<ggml_tensor *> & weights);

// matmul_op's per-call hook for testing_slow_matmul (a relaxed atomic load when not slowed).
void testing_matmul_delay(isa_level level);

// Tests: every matmul_op at `level` ("avx512f", "avx2", "portable") also spins `seconds` per call
// and thread (0 undoes it), so that tune_matmul must choose another level.
void testing_slow_matmul(const std::string & level, double seconds);

}  // namespace dfn
