#include "graph_runner.h"

#include "common.h"
#include "profile.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <memory>

namespace dfn {

graph_runner::graph_runner(device_kind device, int n_threads, matmul_kind kernels, size_t max_nodes)
    : n_threads_(n_threads), kernels_(kernels), max_nodes_(max_nodes) {
    cpu_.reset(ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr));
    if (!cpu_) throw runtime_error("[engine] cannot initialise the ggml CPU backend");
    ggml_backend_cpu_set_n_threads(cpu_.get(), n_threads);
    backend_ = cpu_.get();
    if (device == DEVICE_GPU) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        DFN_REQUIRE(dev != nullptr, "engine", "device='gpu' asked for, but the ggml this package runs "
                    "on was built without a GPU backend. Reinstall llama-cpp-python with one, e.g. "
                    "CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir "
                    "llama-cpp-python==0.3.36, then reinstall dflash-native");
        gpu_.reset(ggml_backend_dev_init(dev, nullptr));
        if (!gpu_) throw runtime_error(cat("[engine] cannot initialise GPU device ", ggml_backend_dev_name(dev)));
        backend_ = gpu_.get();
        // the backend registry, not a device or buffer name, says whether it is CUDA
        ggml_backend_reg_t cuda = ggml_backend_reg_by_name("CUDA");
        gpu_is_cuda_ = cuda != nullptr && ggml_backend_dev_backend_reg(dev) == cuda;
    }
    meta_.resize(ggml_tensor_overhead() * max_nodes_ + ggml_graph_overhead_custom(max_nodes_, false));
}

bool graph_runner::on_cuda(ggml_backend_buffer_t buf) const {
    if (!gpu_is_cuda_ || buf == nullptr) return false;
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    return dev != nullptr && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU &&
           dev == ggml_backend_get_device(gpu_.get());
}

ggml_backend_sched_t graph_runner::plan_for(const std::string & shape_key, ggml_cgraph * gf) {
    auto it = plans_.find(shape_key);
    if (it == plans_.end()) {
        ggml_backend_t backends[2] = {backend_, cpu_.get()};
        graph_plan p;
        p.sched.reset(ggml_backend_sched_new(backends, nullptr, gpu_ ? 2 : 1, max_nodes_, false, true));
        if (!p.sched) throw runtime_error("[engine] cannot create the ggml scheduler");
        if (!ggml_backend_sched_reserve(p.sched.get(), gf)) throw runtime_error("[graph] cannot reserve the compute graph");
        it = plans_.emplace(shape_key, std::move(p)).first;
        drop_old_plans(shape_key);
    }
    it->second.last_use = ++plan_clock_;
    return it->second.sched.get();
}

// Drops the least recently used plans beyond k_max_plans and k_max_plan_bytes, never `keep`.
void graph_runner::drop_old_plans(const std::string & keep) {
    auto bytes = [&](const graph_plan & q) {
        return ggml_backend_sched_get_buffer_size(q.sched.get(), backend_) +
               (gpu_ ? ggml_backend_sched_get_buffer_size(q.sched.get(), cpu_.get()) : 0);
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

void graph_runner::run(const std::string & shape_key, const build_fn & build, const std::function<void()> & set_inputs,
                       const std::function<void()> & read_outputs) {
    const int prof = profile_level();
    profile_graph pg{shape_key.substr(0, shape_key.find(':')), prof ? profile_now() : 0.0};
    auto phase = [&](const char * what) {
        if (!prof) return;
        const double now = profile_now();
        profile_add(pg.graph, what, now - pg.last);
        pg.last = now;
    };
    ggml_init_params ip = {meta_.size(), meta_.data(), /*no_alloc =*/ true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) throw runtime_error("[graph] ggml_init failed");
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> ctx_guard(ctx, ggml_free);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, max_nodes_, false);
    build(build_context{ctx, gf, kernels_});
    phase(":build");
    ggml_backend_sched_t sched = plan_for(shape_key, gf);
    phase(":plan");
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw runtime_error("[graph] cannot allocate the compute graph");
    phase(":alloc");
    set_inputs();
    phase(":inputs");
    ggml_backend_sched_set_eval_callback(sched, prof >= 2 ? profile_eval_cb : nullptr, prof >= 2 ? &pg : nullptr);
    const ggml_status st = ggml_backend_sched_graph_compute(sched, gf);
    if (st != GGML_STATUS_SUCCESS) throw runtime_error(cat("[graph] compute failed with status ", (int) st));
    phase(":compute");
    read_outputs();
    phase(":read");
}

}  // namespace dfn
