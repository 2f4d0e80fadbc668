#include "base/profile.h"

#include <ctime>

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>

namespace dfn {

namespace {
struct state {
    std::mutex mu;
    std::map<std::string, profile_entry> entries;
    int level = 0;
    state() {
        const char * v = std::getenv("DFLASH_NATIVE_PROFILE");
        if (v && *v) level = std::atoi(v);
    }
};
state & st() {
    static state s;
    return s;
}
}  // namespace

double profile_now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double thread_cpu_seconds() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
    timespec ts{};
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
#endif
    return 0.0;
}

void profile_set_level(int level) { st().level = level; }
int profile_level() { return st().level; }

void profile_reset() {
    std::lock_guard<std::mutex> lock(st().mu);
    st().entries.clear();
}

std::vector<profile_entry> profile_report() {
    std::lock_guard<std::mutex> lock(st().mu);
    std::vector<profile_entry> out;
    for (const auto & kv : st().entries) out.push_back(kv.second);
    return out;
}

void profile_add(const std::string & graph, const std::string & what, double seconds) {
    std::lock_guard<std::mutex> lock(st().mu);
    profile_entry & e = st().entries[graph + "/" + what];
    if (e.key.empty()) e.key = graph + "/" + what;
    e.calls += 1;
    e.seconds += seconds;
}

bool profile_eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    if (ask) return true;  // every node: computed alone, then reported here
    auto * g = static_cast<profile_graph *>(user_data);
    const double now = profile_now();
    // our custom ops carry their names (matmul.cpp, gdn_tape.cpp, top1.cpp); ggml ops their op
    const std::string op = t->op == GGML_OP_CUSTOM && t->name[0] ? std::string(t->name) : std::string(ggml_op_desc(t));
    profile_add(g->graph, op, now - g->last);
    g->last = now;
    return true;
}

}  // namespace dfn
