// Runs ggml graphs on one set of backends: the schedulers and allocation plans per graph shape,
// the backends (CPU, and the GPU when asked for), and the graph metadata arena. The target
// session owns one; the drafter (spec_session) runs its graphs on the same one, so that its
// weights, the feature ring and the target's tensors share buffers and plans.
#pragma once

#include "graph/build_context.h"
#include "kernels/cpu/matmul/dispatch.h"
#include "runtime/thread_governor.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dfn {

// True when ggml's CPU backend runs its graphs on OpenMP's thread pool (which fork() does not copy).
bool cpu_uses_openmp();

class graph_runner {
public:
    // device: an Engine device string (devices.h: resolve_device): "cpu" runs the package's own
    // CPU kernels; any other device runs stock ggml ops only (build_context::device).
    // max_nodes: the most nodes one graph may have (the target's forward pass sizes it).
    graph_runner(const std::string & device, int n_threads, matmul_kind kernels, size_t max_nodes);
    graph_runner(const graph_runner &) = delete;
    graph_runner & operator=(const graph_runner &) = delete;

    using build_fn = std::function<void(const build_context &)>;

    // Builds a graph with `build` (given the metadata arena, the graph and this runner's kernel
    // choice), allocates it on the backends, calls
    // `set_inputs`, computes, then `read_outputs`.
    //
    // `shape_key` names the graph's structure (which op sequence, which outputs, how many tokens).
    // Each key keeps its own scheduler and allocation plan, so a speculative round, which
    // alternates draft, verify and ring-push graphs, re-plans none of them; ggml's allocator
    // re-plans by itself only when a tensor outgrows its plan (the KV length grows). The least
    // recently used plans are dropped beyond k_max_plans or k_max_plan_bytes of compute buffers.
    // `plan_key` (empty: the shape key) lets graphs of many shapes share a plan on a runner
    // without devices: the batched passes, whose shape changes with every step's mix of requests
    // (a plan a shape would make a scheduler and a compute buffer per step). The shared plan is
    // planned again (ggml_backend_sched_reserve) for each graph whose structure differs from the
    // last one's (graph_runner.cpp: graph_structure: its nodes, flags and sources in order, any
    // sizes); ggml's allocator re-plans it when a tensor outgrows it, and its buffer only grows.
    // On a device every shape keeps its own plan (the scheduler splits the graph it was planned on).
    // Out of memory it throws memory_error naming the graph (after dropping the other plans and
    // trying once more); the runner stays usable, except after a failure inside ggml's compute
    // that leaves the CPU backend inconsistent: then every later run throws.
    void run(const std::string & shape_key, const build_fn & build, const std::function<void()> & set_inputs,
             const std::function<void()> & read_outputs, const std::string & plan_key = "");

    // Where weights, caches and the ring are allocated: the main backend's buffers.
    ggml_backend_buffer_type_t buffer_type() const { return ggml_backend_get_default_buffer_type(backend_); }
    ggml_backend_t backend() const { return backend_; }
    // A model split by layers over several devices ("rpc://a,b"): layer il of n_layer lives on
    // device il * n_devices / n_layer; the embeddings on the first, the output head, the drafter,
    // the ring and the feature queue on the last. One device: its buffers for all of them.
    size_t n_devices() const { return devs_.size(); }
    ggml_backend_buffer_type_t layer_buffer_type(int il, int n_layer) const;
    ggml_backend_buffer_type_t last_buffer_type() const;
    // Where a target tensor lives, by its GGUF name (blk.<il>. on its layer's device).
    ggml_backend_buffer_type_t target_buffer_type(const char * name, int n_layer) const;
    // True when the runner computes on a device other than the CPU (stock ggml ops only).
    bool on_device() const { return !devs_.empty(); }
    // The ggml device name ("CPU", "CUDA0", "RPC0", ...).
    std::string device_name() const;
    // Checks every node of each graph the scheduler plans: nodes placed on the CPU backend while
    // the runner computes on a device are recorded (placement()); a custom op on a device throws.
    void set_check_placement(bool on) { check_placement_ = on; }
    // "<graph key prefix> <op> <node name>" per node that ran on the CPU backend of a device runner.
    const std::vector<std::string> & placement() const { return placement_; }
    // True after a failure inside ggml's compute left the CPU backend unusable (every run throws).
    bool broken() const { return !broken_.empty(); }
    int n_threads() const { return n_threads_; }
    // The threads the CPU graphs run on now (thread_governor.h: fewer while the machine is
    // oversubscribed), and how often the governor lowered them.
    int threads_now() const { return override_threads_ > 0 ? override_threads_ : gov_.current(); }
    int64_t thread_reductions() const { return gov_.reductions(); }
    // Tests: every CPU graph on this many threads (0: the governor's choice again).
    void set_threads_override(int n) { override_threads_ = n; }
    matmul_kind kernels() const { return kernels_; }
    size_t n_plans() const { return plans_.size(); }
    // Drops the cached plans whose shape key starts with `prefix` (tune_matmul's, once measured).
    void drop_plans(const std::string & prefix);
    // The level each weight type's matmul runs at on this runner (tune_matmul measures it).
    matmul_dispatch & dispatch() { return dispatch_; }
    const matmul_dispatch & dispatch() const { return dispatch_; }
    // Bytes of the compute buffers the cached plans hold, on every backend, summed over the plans
    // whose shape key starts with one of `prefixes`.
    // device_only: the main backend's buffers alone (a device's, not the host's input copies).
    size_t compute_bytes(const std::vector<std::string> & prefixes, bool device_only = false) const;

private:
    struct graph_plan {
        ggml_backend_sched_ptr sched;
        uint64_t last_use = 0;
        uint64_t structure = 0;  // a shared plan's: the structure of the graph it was last planned on
    };
    static constexpr size_t k_max_plans = 32;
    static constexpr size_t k_max_plan_bytes = size_t(512) << 20;
    ggml_backend_sched_t plan_for(const std::string & shape_key, ggml_cgraph * gf);
    void drop_old_plans(const std::string & keep);
    // Out of memory these throw memory_error (Python MemoryError), after one retry without the
    // other plans (a cache of compute buffers): a new plan, a graph's buffers, room to compute.
    graph_plan new_plan(const std::string & shape_key, ggml_cgraph * gf);
    // false: the graph outgrew its plan and the larger buffers did not fit
    bool alloc_graph(const std::string & shape_key, ggml_cgraph * gf, ggml_backend_sched_t sched);
    void make_room(size_t bytes, const std::string & what, const std::string & keep_key);
    ggml_status compute(const std::string & shape_key, const std::string & plan_key, ggml_backend_sched_t sched,
                        ggml_cgraph * gf);

    // The compute thread: with ggml's CPU backend on OpenMP and more than one thread, every graph
    // of every runner in the process computes on one thread, whichever thread called run(). OpenMP
    // keeps a team of workers per thread that starts parallel regions; callers on several threads
    // (the server's workers, the scheduler's steps run by whichever caller waits, several engines
    // in one process) would make a team each, more threads than cores, and libgomp then throttles
    // its spin-waits to sleeps at every barrier: a small model's step on a worker thread measured
    // 10x slower than on the main thread. One thread, one team; the graphs of several engines take
    // turns, each on all its threads. Started at the first such graph and kept for the process's
    // life; a fork() has no such thread, and its graphs throw.
    static void on_compute_thread(const std::function<void()> & f);

    // Declaration order is destruction order reversed: the plans go before the backends.
    ggml_backend_ptr cpu_;                  // CPU backend
    std::vector<ggml_backend_ptr> devs_;    // the devices' backends, when not the CPU (several: a split)
    ggml_backend_t backend_ = nullptr;      // the main compute backend: devs_[0] or cpu_
    bool check_placement_ = false;
    std::vector<std::string> placement_;
    void check_placement(const std::string & shape_key, ggml_backend_sched_t sched, ggml_cgraph * gf);
    int n_threads_ = 0;
    thread_governor gov_;      // the CPU graphs' thread count (read and written on the computing thread)
    int override_threads_ = 0;
    matmul_kind kernels_ = MATMUL_OWN;
    size_t max_nodes_ = 0;
    std::vector<uint8_t> meta_;             // graph metadata arena
    std::unordered_map<std::string, graph_plan> plans_;  // shape key -> its scheduler (see run)
    uint64_t plan_clock_ = 0;
    matmul_dispatch dispatch_;
    std::string broken_;  // set when ggml failed mid-compute in a way that cannot be undone
};

}  // namespace dfn
