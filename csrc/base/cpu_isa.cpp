#include "base/cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace dfn {

namespace {

constexpr const char * k_env = "DFLASH_NATIVE_ISA";
constexpr int k_unresolved = -1;

// The level in use once resolved (k_unresolved before the first use); the env var's error, if any.
std::atomic<int> g_level{k_unresolved};
std::mutex g_mutex;
std::string g_error;
std::atomic<int> g_pretend_best{k_unresolved};  // testing_pretend_cpu_best
std::atomic<bool> g_user_chosen{false};          // a non-empty DFLASH_NATIVE_ISA or set_isa name

const char * cpu_feature_name(isa_level level) {
    return level == isa_level::avx512 ? "AVX-512F" : level == isa_level::avx2 ? "AVX2 + FMA + F16C" : "";
}

bool blank(const std::string & s) {
    return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace((unsigned char) c); });
}

// The level `name` asks for, checked against the CPU (throws input_error naming `source`).
isa_level parse_level(const std::string & name_in, const char * source) {
    const isa_level best = isa_cpu_best();
    std::string name;
    for (char c : name_in) {
        if (!std::isspace((unsigned char) c)) name += (char) std::tolower((unsigned char) c);
    }
    if (name.empty()) return best;
    isa_level want;
    if (name == "avx512" || name == "avx512f") want = isa_level::avx512;
    else if (name == "avx2") want = isa_level::avx2;
    else if (name == "portable") want = isa_level::portable;
    else throw input_error(cat("[isa] ", source, " = '", name_in, "' is not an instruction set: use avx512, avx2 or portable"));
    if (want > best) {
        throw input_error(cat("[isa] ", source, " = '", name_in, "': this CPU has no ", cpu_feature_name(want),
                              " (its best is ", isa_level_name(best), ")"));
    }
    return want;
}

// Reads DFLASH_NATIVE_ISA on the first call; a bad value is kept in g_error and the CPU's best used.
void resolve() {
    if (g_level.load(std::memory_order_acquire) != k_unresolved) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_level.load(std::memory_order_relaxed) != k_unresolved) return;
    const char * env = std::getenv(k_env);
    isa_level level = isa_cpu_best();
    try {
        level = parse_level(env ? env : "", k_env);
        g_user_chosen.store(env && !blank(env), std::memory_order_relaxed);
    } catch (const input_error & e) {
        g_error = e.what();
    }
    g_level.store((int) level, std::memory_order_release);
}

}  // namespace

isa_level isa_cpu_best() {
    const int pretend = g_pretend_best.load(std::memory_order_relaxed);
    if (pretend != k_unresolved) return (isa_level) pretend;
#if DFN_X86_GCC
    static const isa_level best = [] {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f")) return isa_level::avx512;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
            return isa_level::avx2;
        return isa_level::portable;
    }();
    return best;
#else
    return isa_level::portable;
#endif
}

isa_level isa_in_use() {
    int l = g_level.load(std::memory_order_relaxed);
    if (l == k_unresolved) {
        resolve();
        l = g_level.load(std::memory_order_acquire);
    }
    return (isa_level) l;
}

void isa_check() {
    resolve();
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_error.empty()) throw input_error(g_error);
}

void set_isa_cap(const std::string & name) {
    const isa_level level = parse_level(name, "set_isa");
    resolve();
    std::lock_guard<std::mutex> lock(g_mutex);
    g_error.clear();  // an explicit choice supersedes the environment's
    g_user_chosen.store(!blank(name), std::memory_order_relaxed);
    g_level.store((int) level, std::memory_order_release);
}

bool isa_user_chosen() {
    resolve();
    return g_user_chosen.load(std::memory_order_relaxed);
}

void testing_pretend_cpu_best(const std::string & name) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_pretend_best.store(name.empty() ? k_unresolved : (int) parse_level(name, "pretend_cpu_isa"),
                         std::memory_order_relaxed);
}

const char * isa_level_name(isa_level level) {
    switch (level) {
        case isa_level::avx512: return "avx512f";
        case isa_level::avx2: return "avx2";
        default: return "portable";
    }
}

std::string isa_description() {
    const isa_level level = isa_in_use();
    return cat(isa_level_name(level), level < isa_cpu_best() ? " (capped)" : "");
}

}  // namespace dfn
