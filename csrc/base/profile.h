// Op-level timing of the forward graphs, for finding where a round's time goes.
//
// Off by default. Level 1 (profile_set_level(1), or DFLASH_NATIVE_PROFILE=1 at load) times the
// phases of every graph that graph_runner::run runs: graph build, allocation, input
// upload, compute, output read-back, keyed "<graph>/:build" etc. (graph: the shape key's first
// field, e.g. "target" or "draft"). Level 2 also computes each graph one node at a time through
// the scheduler's eval callback and adds each node's wall time to "<graph>/<op>" (op: the ggml
// op, or the name of one of our custom ops); ":compute" then holds only what the nodes leave over.
// Node-at-a-time compute adds a thread wake-up per node, so level-2 totals run high: compare
// shares, not absolute times.
#pragma once

#include "ggml-backend.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dfn {

struct profile_entry {
    std::string key;
    int64_t calls = 0;
    double seconds = 0.0;
};

// 0: off; 1: the phases around each graph's compute; 2: also every node (slower, see above).
void profile_set_level(int level);
int profile_level();
void profile_reset();
std::vector<profile_entry> profile_report();  // sorted by key

// Used by graph_runner::run: adds `seconds` under "<graph>/<what>".
void profile_add(const std::string & graph, const std::string & what, double seconds);
// The scheduler eval callback; user_data: a profile_graph.
bool profile_eval_cb(ggml_tensor * t, bool ask, void * user_data);

struct profile_graph {
    std::string graph;
    double last = 0.0;  // time the previous node finished (or the compute began)
};

double profile_now();  // seconds on the steady clock (also the round timings in spec.cpp)
double thread_cpu_seconds();  // the calling thread's CPU time (thread_governor.h); 0 where unknown

// Adds its lifetime under "<graph>/<what>" when profiling is on (level >= 1).
class profile_scope {
public:
    profile_scope(const char * graph, const char * what)
        : graph_(graph), what_(what), t0_(profile_level() > 0 ? profile_now() : 0.0) {}
    ~profile_scope() {
        if (t0_ > 0.0) profile_add(graph_, what_, profile_now() - t0_);
    }
    profile_scope(const profile_scope &) = delete;
    profile_scope & operator=(const profile_scope &) = delete;

private:
    const char * graph_;
    const char * what_;
    double t0_;
};

}  // namespace dfn
