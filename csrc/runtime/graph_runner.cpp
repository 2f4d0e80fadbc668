#include "runtime/graph_runner.h"

#include "base/alloc.h"
#include "base/common.h"
#include "runtime/devices.h"
#include "base/profile.h"

#include "ggml-cpu.h"

#if !defined(_WIN32)
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace dfn {

bool cpu_uses_openmp() {
    // ggml's CPU backend lists "OPENMP" among its features when its thread pool is OpenMP's
    ggml_backend_reg_t cpu = ggml_backend_reg_by_name("CPU");
    auto features = cpu ? (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(cpu, "ggml_backend_get_features")
                        : nullptr;
    for (ggml_backend_feature * f = features ? features(cpu) : nullptr; f && f->name; ++f)
        if (std::strcmp(f->name, "OPENMP") == 0) return true;
    return false;
}

namespace {

long process_id() {
#if defined(_WIN32)
    return 0;  // no fork()
#else
    return (long) getpid();
#endif
}

// The process whose runners ran ggml's OpenMP thread pool on more than one thread (0: none yet).
// fork() copies no threads and GNU libgomp cannot start a pool again in the child: there a graph on
// more than one thread waits for ever, so a runner on more than one thread is refused in a fork()
// of that process (Python's Engine and the C API alike).
std::atomic<long> g_pool_pid{0};

}  // namespace

graph_runner::graph_runner(const std::string & device, int n_threads, matmul_kind kernels, size_t max_nodes)
    : n_threads_(n_threads), gov_(n_threads), kernels_(kernels), max_nodes_(max_nodes) {
    if (const long pool = g_pool_pid.load(); n_threads != 1 && pool != 0 && pool != process_id())
        throw runtime_error(cat("[engine] this process is a fork() of process ", pool, ", whose engines ran ggml's "
                                "OpenMP worker threads; fork() does not copy them, and a graph on more than one thread "
                                "would wait for ever here. Use multiprocessing's 'spawn' or 'forkserver' start method "
                                "(or n_threads=1 in this process)"));
    const std::vector<ggml_backend_dev_t> devs = resolve_devices(device);  // empty: the CPU
    require_headroom(size_t(4) << 20, "engine", "the ggml CPU backend");  // its ggml_init aborts on failure
    cpu_.reset(ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr));
    if (!cpu_) throw runtime_error("[engine] cannot initialise the ggml CPU backend");
    ggml_backend_cpu_set_n_threads(cpu_.get(), n_threads);
    backend_ = cpu_.get();
    for (ggml_backend_dev_t dev : devs) {
        devs_.emplace_back(ggml_backend_dev_init(dev, nullptr));
        if (!devs_.back()) throw runtime_error(cat("[engine] cannot initialise device ", ggml_backend_dev_name(dev)));
    }
    if (!devs_.empty()) backend_ = devs_.front().get();
    meta_.resize(ggml_tensor_overhead() * max_nodes_ + ggml_graph_overhead_custom(max_nodes_, false));
}

std::string graph_runner::device_name() const {
    if (devs_.empty()) return "CPU";
    std::string out;
    for (const ggml_backend_ptr & b : devs_) out += cat(out.empty() ? "" : ",", ggml_backend_dev_name(ggml_backend_get_device(b.get())));
    return out;
}

ggml_backend_buffer_type_t graph_runner::layer_buffer_type(int il, int n_layer) const {
    if (devs_.size() < 2) return buffer_type();
    const size_t d = std::min(devs_.size() - 1, (size_t) il * devs_.size() / (size_t) std::max(1, n_layer));
    return ggml_backend_get_default_buffer_type(devs_[d].get());
}

ggml_backend_buffer_type_t graph_runner::last_buffer_type() const {
    return devs_.empty() ? buffer_type() : ggml_backend_get_default_buffer_type(devs_.back().get());
}

ggml_backend_buffer_type_t graph_runner::target_buffer_type(const char * name, int n_layer) const {
    int il = -1;
    if (std::sscanf(name, "blk.%d.", &il) == 1 && il >= 0) return layer_buffer_type(std::min(il, n_layer - 1), n_layer);
    if (std::strncmp(name, "token_embd", 10) == 0) return buffer_type();
    return last_buffer_type();  // output, output_norm, rope_freqs, ...
}

void graph_runner::check_placement(const std::string & shape_key, ggml_backend_sched_t sched, ggml_cgraph * gf) {
    const std::string graph = shape_key.substr(0, shape_key.find(':'));
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * t = ggml_graph_node(gf, i);
        if (t->op == GGML_OP_CUSTOM) {
            // ggml runs custom ops on the CPU only: a device graph must not hold one (an RPC server
            // would be sent a host function pointer)
            throw runtime_error(cat("[graph] graph '", shape_key, "' holds the CPU custom op '", t->name,
                                    "' but runs on device ", device_name()));
        }
        const bool view = t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE ||
                          t->op == GGML_OP_TRANSPOSE;
        if (!check_placement_ || view) continue;  // a view computes nothing
        if (ggml_backend_sched_get_tensor_backend(sched, t) == cpu_.get()) {  // any device of a split is fine
            placement_.push_back(cat(graph, " ", ggml_op_desc(t), " ", t->name));
        }
    }
}

// What ggml_backend_sched_new mallocs without checking (ggml-backend.cpp): an arena of graph_size *
// GGML_SCHED_MAX_SPLIT_INPUTS (30) * 2 tensors plus a graph, four id arrays as long, hash tables.
static size_t sched_bytes(size_t graph_size) {
    const size_t n = graph_size * 30 * 2;
    return n * (sizeof(ggml_tensor) + 4 * sizeof(int)) + ggml_graph_overhead_custom(graph_size, false) +
           graph_size * 64 + (size_t(1) << 20);
}

// A graph's compute buffers did not fit; `why` is ggml's log line naming the buffer and its size.
static memory_error compute_buffers_oom(const std::string & shape_key, const std::string & why) {
    return memory_error(cat("[graph] out of memory: cannot allocate the compute buffers of graph '", shape_key, "'",
                            why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
}

void graph_runner::make_room(size_t bytes, const std::string & what, const std::string & keep_key) {
    try {
        require_headroom(bytes, "graph", what);
    } catch (const memory_error &) {
        // the other plans' schedulers and compute buffers are only a cache: drop them and retry
        for (auto it = plans_.begin(); it != plans_.end();) it = it->first == keep_key ? std::next(it) : plans_.erase(it);
        require_headroom(bytes, "graph", what);
    }
}

graph_runner::graph_plan graph_runner::new_plan(const std::string & shape_key, ggml_cgraph * gf) {
    for (int attempt = 0;; ++attempt) {
        make_room(sched_bytes(max_nodes_), cat("the scheduler of graph '", shape_key, "'"), "");
        std::vector<ggml_backend_t> backends;
        for (const ggml_backend_ptr & b : devs_) backends.push_back(b.get());
        backends.push_back(cpu_.get());  // last: ggml's scheduler needs the CPU there
        graph_plan p;
        p.sched.reset(ggml_backend_sched_new(backends.data(), nullptr, (int) backends.size(), max_nodes_, false, true));
        if (!p.sched) throw runtime_error("[engine] cannot create the ggml scheduler");
        if (ggml_backend_sched_reserve(p.sched.get(), gf)) return p;
        const std::string why = last_ggml_error();  // names the buffer and its size
        if (attempt == 0 && !plans_.empty()) {
            plans_.clear();  // their compute buffers are only a cache; try again without them
            continue;
        }
        throw compute_buffers_oom(shape_key, why);
    }
}

ggml_backend_sched_t graph_runner::plan_for(const std::string & shape_key, ggml_cgraph * gf) {
    auto it = plans_.find(shape_key);
    if (it == plans_.end()) {
        it = plans_.emplace(shape_key, new_plan(shape_key, gf)).first;
        drop_old_plans(shape_key);
    }
    it->second.last_use = ++plan_clock_;
    return it->second.sched.get();
}

bool graph_runner::alloc_graph(const std::string & shape_key, ggml_cgraph * gf, ggml_backend_sched_t sched) {
    // a graph that outgrew its plan is planned again: ggml's allocator tables (unchecked)
    if (address_space_limited()) {
        make_room(max_nodes_ * 64 + (size_t(1) << 20), cat("allocating graph '", shape_key, "'"), shape_key);
    }
    ggml_backend_sched_reset(sched);
    return ggml_backend_sched_alloc_graph(sched, gf);
}

void graph_runner::drop_plans(const std::string & prefix) {
    for (auto it = plans_.begin(); it != plans_.end();) {
        it = it->first.compare(0, prefix.size(), prefix) == 0 ? plans_.erase(it) : std::next(it);
    }
}

// Drops the least recently used plans beyond k_max_plans and k_max_plan_bytes, never `keep`.
void graph_runner::drop_old_plans(const std::string & keep) {
    auto bytes = [&](const graph_plan & q) {
        size_t n = ggml_backend_sched_get_buffer_size(q.sched.get(), cpu_.get());
        for (const ggml_backend_ptr & b : devs_) n += ggml_backend_sched_get_buffer_size(q.sched.get(), b.get());
        return n;
    };
    for (;;) {
        size_t total = 0;
        auto lru = plans_.end();
        for (auto jt = plans_.begin(); jt != plans_.end(); ++jt) {
            total += bytes(jt->second);
            if (jt->first != keep && (lru == plans_.end() || jt->second.last_use < lru->second.last_use)) lru = jt;
        }
        if (lru == plans_.end() || (plans_.size() <= k_max_plans && total <= k_max_plan_bytes)) break;
        plans_.erase(lru);
    }
}

size_t graph_runner::compute_bytes(const std::vector<std::string> & prefixes, bool device_only) const {
    size_t n = 0;
    for (const auto & kv : plans_) {
        bool match = false;
        for (const std::string & p : prefixes) match = match || kv.first.compare(0, p.size(), p) == 0;
        if (!match) continue;
        if (!device_only || devs_.empty()) n += ggml_backend_sched_get_buffer_size(kv.second.sched.get(), cpu_.get());
        for (const ggml_backend_ptr & b : devs_) n += ggml_backend_sched_get_buffer_size(kv.second.sched.get(), b.get());
    }
    return n;
}

namespace {
// The graph's structure for a shared plan (graph_runner.h: run's plan_key): its nodes in order,
// each its op, its input / output flags and where its sources and view source come from (an
// earlier node, or a tensor outside them in the order of first use), not its shapes nor its
// op_params (a view's offset moves with the columns). ggml's allocator reuses a plan for a graph
// of as many nodes and leafs whose tensors fit it, without checking that the graph is the one it
// planned: a plan keeps tensors apart by the lifetimes of the graph it was made on, so a graph of
// another structure is planned again (the same count of nodes with a tap marked as an output
// crashed in the allocator; two requests' step kinds swapped reused a plan whose buffers overlap
// their live tensors).
uint64_t graph_structure(ggml_cgraph * gf) {
    // ids: the nodes 1, 2, ... in order; a tensor outside them (a leaf: an input, a weight, a
    // cache) -1, -2, ... in the order of its first use, with its flags
    std::unordered_map<const ggml_tensor *, int64_t> id;
    int64_t n_outside = 0;
    uint64_t h = 1469598103934665603ull;  // FNV-1a over 64-bit words
    auto mix = [&](int64_t v) {
        h ^= (uint64_t) v;
        h *= 1099511628211ull;
    };
    auto ref = [&](const ggml_tensor * t) -> int64_t {
        if (!t) return 0;
        auto it = id.find(t);
        if (it != id.end()) return it->second;
        mix(t->flags);
        return id[t] = -(++n_outside);
    };
    const int n_nodes = ggml_graph_n_nodes(gf);
    mix(n_nodes);
    for (int i = 0; i < n_nodes; ++i) {
        const ggml_tensor * t = ggml_graph_node(gf, i);
        mix(t->op), mix(t->flags), mix(ref(t->view_src));
        for (const ggml_tensor * src : t->src) mix(ref(src));
        id[t] = 1 + (int64_t) i;
    }
    return h;
}
}  // namespace

void graph_runner::run(const std::string & shape_key, const build_fn & build, const std::function<void()> & set_inputs,
                       const std::function<void()> & read_outputs, const std::string & plan_key) {
    std::string pk = plan_key.empty() || !devs_.empty() ? shape_key : plan_key;
    const int prof = profile_level();
    profile_graph pg{shape_key.substr(0, shape_key.find(':')), prof ? profile_now() : 0.0};
    auto phase = [&](const char * what) {
        if (!prof) return;
        const double now = profile_now();
        profile_add(pg.graph, what, now - pg.last);
        pg.last = now;
    };
    if (!broken_.empty()) throw runtime_error(cat("[graph] ", broken_, ": this engine cannot run any more, create a new one"));
    // The scheduler rewrites a graph it splits across backends (a node's source becomes the copy
    // of an input on the node's backend), so a graph is split once: a new plan is made on one
    // build of the graph and allocated on another. A single backend makes no copies.
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> ctx_guard(nullptr, ggml_free);
    ggml_cgraph * gf = nullptr;
    auto build_graph = [&] {
        ctx_guard.reset();
        ggml_init_params ip = {meta_.size(), meta_.data(), /*no_alloc =*/ true};
        ggml_context * ctx = ggml_init(ip);
        if (!ctx) throw runtime_error("[graph] ggml_init failed");
        ctx_guard.reset(ctx);
        gf = ggml_new_graph_custom(ctx, max_nodes_, false);
        build(build_context{ctx, gf, kernels_, &dispatch_, !devs_.empty()});
    };
    build_graph();
    // a shared plan (plan_key) is planned again for each graph of another structure than the last
    const bool shared = pk != shape_key;
    const uint64_t structure = shared ? graph_structure(gf) : 0;
    phase(":build");
    ggml_backend_sched_t sched = nullptr;
    for (int attempt = 0;; ++attempt) {
        const bool fresh = plans_.find(pk) == plans_.end();
        sched = plan_for(pk, gf);
        if (fresh && !devs_.empty()) build_graph();
        graph_plan & plan = plans_.at(pk);
        // (a fresh plan was reserved on this graph; ggml_backend_sched_reserve plans the lifetimes
        // of the graph it is given, whatever the last one's node count)
        const bool planned = fresh || !shared || plan.structure == structure || ggml_backend_sched_reserve(sched, gf);
        if (planned) plan.structure = structure;
        phase(":plan");
        if (planned && alloc_graph(pk, gf, sched)) break;
        // the graph outgrew its plan (the KV length grew) and the larger buffers did not fit
        const std::string why = last_ggml_error();
        plans_.erase(pk);
        if (attempt > 0) throw compute_buffers_oom(shape_key, why);
        plans_.clear();  // only a cache: plan again without the others
        if (!devs_.empty()) build_graph();
    }
    if (!devs_.empty()) check_placement(shape_key, sched, gf);
    phase(":alloc");
    set_inputs();
    phase(":inputs");
    ggml_backend_sched_set_eval_callback(sched, prof >= 2 ? profile_eval_cb : nullptr, prof >= 2 ? &pg : nullptr);
    const ggml_status st = compute(shape_key, pk, sched, gf);
    if (st != GGML_STATUS_SUCCESS) throw runtime_error(cat("[graph] compute failed with status ", (int) st));
    phase(":compute");
    read_outputs();
    phase(":read");
}

namespace {
// graph_runner::on_compute_thread's thread, and the one task it runs at a time
struct compute_worker {
    std::thread::id id;
    long pid = 0;  // the process that started it (a fork() has no such thread)
    std::mutex m;  // held while a caller hands a task over and waits for it (one task at a time)
    std::mutex hand;
    std::condition_variable cv;
    const std::function<void()> * task = nullptr;
    std::exception_ptr error;
    bool done = false;
};
compute_worker * g_worker = nullptr;  // never freed: the thread lives as long as the process
std::mutex g_worker_m;
}  // namespace

void graph_runner::on_compute_thread(const std::function<void()> & f) {
    compute_worker * w;
    {
        std::lock_guard<std::mutex> lock(g_worker_m);
        if (g_worker && g_worker->pid != process_id()) {
            throw runtime_error("[engine] this process is a fork() of the one whose engines ran the compute thread; "
                                "fork() does not copy threads, so no graph on more than one thread can run here");
        }
        if (!g_worker) {
            g_worker = new compute_worker();
            g_worker->pid = process_id();
            compute_worker & cw = *g_worker;
            std::thread t([&cw] {
                std::unique_lock<std::mutex> l(cw.m);
                while (true) {
                    cw.cv.wait(l, [&cw] { return cw.task != nullptr; });
                    const std::function<void()> * task = cw.task;
                    l.unlock();
                    std::exception_ptr e;
                    try {
                        (*task)();
                    } catch (...) {
                        e = std::current_exception();
                    }
                    l.lock();
                    cw.task = nullptr;
                    cw.error = e;
                    cw.done = true;
                    cw.cv.notify_all();
                }
            });
            cw.id = t.get_id();
            t.detach();
        }
        w = g_worker;
    }
    if (std::this_thread::get_id() == w->id) {  // a graph run from inside a graph's callback
        f();
        return;
    }
    std::lock_guard<std::mutex> one(w->hand);  // the engines' graphs take turns
    std::unique_lock<std::mutex> lock(w->m);
    w->task = &f;
    w->done = false;
    w->cv.notify_all();
    w->cv.wait(lock, [w] { return w->done; });
    std::exception_ptr e = w->error;
    w->error = nullptr;
    if (e) std::rethrow_exception(e);
}

// Computes an allocated graph; out of memory (checked before, or inside ggml or a kernel) throws.
ggml_status graph_runner::compute(const std::string & shape_key, const std::string & plan_key, ggml_backend_sched_t sched,
                                  ggml_cgraph * gf) {
    // ggml's CPU backend allocates its work buffer, threadpool and OpenMP threads without a check
    // that survives failure (a failed work buffer leaves a dangling pointer behind): make room first
    if (address_space_limited()) {  // else nothing can fail to map (alloc.h): no per-step cost
        const size_t work = backend_ == cpu_.get() ? ggml_graph_plan(gf, n_threads_, nullptr).work_size : 0;
        make_room(graph_headroom(n_threads_) + work, cat("running graph '", shape_key, "'"), plan_key);
    }
    static const bool openmp = cpu_uses_openmp();
    if (n_threads_ != 1 && openmp && g_pool_pid.load(std::memory_order_relaxed) == 0) g_pool_pid = process_id();
    ggml_status st;
    // the thread count for this graph: the governor's, timed by the computing thread's CPU clock
    // (DFLASH_NATIVE_FIXED_THREADS set, or no per-thread CPU clock: always n_threads)
    static const bool fixed = std::getenv("DFLASH_NATIVE_FIXED_THREADS") != nullptr || thread_cpu_seconds() <= 0;
    const bool governed = n_threads_ > 1 && backend_ == cpu_.get() && !fixed && override_threads_ == 0;
    const int nt = override_threads_ > 0 ? override_threads_ : governed ? gov_.threads(profile_now()) : n_threads_;
    if (n_threads_ > 1) ggml_backend_cpu_set_n_threads(cpu_.get(), nt);
    auto graph = [&] {
        const double w0 = profile_now(), c0 = thread_cpu_seconds();
        st = ggml_backend_sched_graph_compute(sched, gf);
        if (governed) gov_.observe(nt, profile_now() - w0, thread_cpu_seconds() - c0, profile_now());
    };
    try {
        // on one thread ggml starts no OpenMP team: the calling thread computes (no hand-over,
        // which on a busy machine waits for a core twice per graph)
        if (nt != 1 && openmp && backend_ == cpu_.get()) {
            on_compute_thread(graph);
        } else {
            graph();
        }
    } catch (const std::bad_alloc &) {
        // thrown by a backend's allocation inside ggml: its state may be inconsistent
        broken_ = cat("out of memory inside ggml while running graph '", shape_key, "'");
        (void) cpu_.release();  // may hold a freed work buffer: never free it again
        throw memory_error(cat("[graph] ", broken_, "; this engine cannot run any more, create a new one"));
    }
    throw_kernel_oom("graph");  // a kernel that could not get its scratch returned early
    if (st == GGML_STATUS_ALLOC_FAILED) throw memory_error(cat("[graph] out of memory running graph '", shape_key, "'"));
    return st;
}

}  // namespace dfn
