// tune_matmul: each weight type's matmul level, measured on the engine's own runner
// (dispatch.h says what and why).
#include "kernels/cpu/matmul/dispatch.h"

#include "base/common.h"
#include "runtime/graph_runner.h"
#include "kernels/cpu/matmul/matmul.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>

namespace dfn {

namespace {

std::atomic<int> g_slow_level{-1};
std::atomic<double> g_slow_seconds{0.0};

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The levels worth measuring: the CPU's best, and AVX2 below AVX-512 (the portable path is never
// faster where AVX2 exists).
std::vector<isa_level> candidates() {
    const isa_level best = isa_in_use();
    std::vector<isa_level> out{best};
    if (best == isa_level::avx512) out.push_back(isa_level::avx2);
    return out;
}

bool tuning_off() {
    const char * env = std::getenv("DFLASH_NATIVE_TUNE");
    return env && std::strcmp(env, "0") == 0;
}

// The weights measured per type: its largest matrix (by bytes) that the kernel takes and that is a
// matmul weight (K a multiple of 32 and >= 64: not a conv kernel or a per-head vector).
std::map<ggml_type, ggml_tensor *> largest_per_type(const std::vector<ggml_tensor *> & weights) {
    std::map<ggml_type, ggml_tensor *> out;
    for (ggml_tensor * t : weights) {
        if (!t || !t->data || ggml_n_dims(t) != 2 || t->ne[0] < 64 || t->ne[0] % 32 != 0 || t->ne[1] < 64) continue;
        if (!matmul_weight_type(t->type) || (t->buffer && !ggml_backend_buffer_is_host(t->buffer))) continue;
        auto it = out.find(t->type);
        if (it == out.end() || ggml_nbytes(t) > ggml_nbytes(it->second)) out[t->type] = t;
    }
    return out;
}

// Seconds per run of y = W[:rows] x at each level (fastest of k_tune_reps, alternating levels).
matmul_dispatch::choice measure(graph_runner & runner, ggml_tensor * W, int regime, const std::vector<isa_level> & levels) {
    matmul_dispatch & d = runner.dispatch();
    matmul_dispatch::choice c;
    c.type = W->type;
    c.regime = regime;
    c.tensor = ggml_get_name(W);
    c.K = W->ne[0];
    c.N = regime == 0 ? 1 : matmul_dispatch::k_tune_cols;
    c.rows = std::min<int64_t>(W->ne[1], std::max<int64_t>(64, (int64_t) (matmul_dispatch::k_tune_bytes / W->nb[1])));
    const std::string key = cat("tune:", ggml_type_name(W->type), ":", c.N);
    // x [K, N]: fixed values in [-0.5, 0.5) (the time does not depend on them)
    std::vector<float> xv((size_t) (c.K * c.N));
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = (float) ((i * 2654435761u) >> 22 & 1023) / 1024.0f - 0.5f;
    ggml_tensor * x = nullptr;
    auto build = [&](const build_context & b) {
        x = ggml_new_tensor_2d(b.ctx, GGML_TYPE_F32, c.K, c.N);
        ggml_set_input(x);
        ggml_tensor * w = ggml_view_2d(b.ctx, W, c.K, c.rows, W->nb[1], 0);
        ggml_tensor * y = matmul_op(b.ctx, w, x, &d);
        ggml_set_output(y);
        ggml_build_forward_expand(b.gf, y);
    };
    auto set_inputs = [&] { ggml_backend_tensor_set(x, xv.data(), 0, xv.size() * sizeof(float)); };
    const double t_start = now_s();
    std::vector<double> best(levels.size(), 1e30);
    auto run_at = [&](size_t i) {
        d.force(W->type, regime, levels[i]);
        const double t0 = now_s();
        runner.run(key, build, set_inputs, [] {});
        best[i] = std::min(best[i], now_s() - t0);
    };
    for (size_t i = 0; i < levels.size(); ++i) run_at(i);  // warm-up (plan, pages, caches): not kept
    std::fill(best.begin(), best.end(), 1e30);
    for (int r = 0; r < matmul_dispatch::k_tune_reps; ++r) {
        for (size_t j = 0; j < levels.size(); ++j) run_at(r % 2 ? levels.size() - 1 - j : j);
    }
    size_t pick = 0;  // levels[0] is the CPU's best: another must beat it by the margin
    for (size_t i = 1; i < levels.size(); ++i) {
        if (best[i] < best[pick] * (1.0 - matmul_dispatch::k_tune_margin)) pick = i;
    }
    for (size_t i = 0; i < levels.size(); ++i) c.seconds.emplace_back(levels[i], best[i]);
    c.level = levels[pick];
    c.wall = now_s() - t_start;
    return c;
}

}  // namespace

std::string matmul_dispatch::deviations() const {
    std::string out;
    for (const choice & c : choices) {
        if (c.level == isa_for(c.type, c.N) && c.level != isa_in_use()) {
            out += cat(out.empty() ? "matmul " : ", ", ggml_type_name(c.type), " x", c.N, " ", isa_level_name(c.level));
        }
    }
    return out;
}

void tune_matmul(graph_runner & runner, const std::vector<ggml_tensor *> & weights) {
    if (runner.kernels() != MATMUL_OWN || runner.on_device() || isa_user_chosen() || tuning_off()) return;
    const std::vector<isa_level> levels = candidates();
    if (levels.size() < 2) return;
    matmul_dispatch & d = runner.dispatch();
    for (const auto & kv : largest_per_type(weights)) {
        if (d.measured(kv.first)) continue;
        try {
            for (int regime = 0; regime < matmul_dispatch::k_regimes; ++regime) d.set(measure(runner, kv.second, regime, levels));
        } catch (const std::exception &) {
            d.forget(kv.first);  // a measurement is only an optimisation: load without it
            runner.drop_plans("tune:");
            if (runner.broken()) throw;  // the engine cannot run at all: say so at load
            return;
        }
    }
    runner.drop_plans("tune:");
}

void testing_slow_matmul(const std::string & level, double seconds) {
    int l = -1;
    for (isa_level i : {isa_level::avx512, isa_level::avx2, isa_level::portable}) {
        if (level == isa_level_name(i)) l = (int) i;
    }
    DFN_REQUIRE(seconds == 0.0 || l >= 0, "matmul", "no instruction set named '", level, "'");
    g_slow_seconds.store(seconds, std::memory_order_relaxed);
    g_slow_level.store(seconds > 0.0 ? l : -1, std::memory_order_relaxed);
}

void testing_matmul_delay(isa_level level) {
    if (g_slow_level.load(std::memory_order_relaxed) != (int) level) return;
    const double until = now_s() + g_slow_seconds.load(std::memory_order_relaxed);
    while (now_s() < until) {
    }
}

}  // namespace dfn
