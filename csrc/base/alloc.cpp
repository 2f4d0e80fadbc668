#include "base/alloc.h"

#include <algorithm>

#include "ggml-alloc.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace dfn {

std::string format_bytes(size_t n) {
    char buf[32];
    if (n < (size_t(1) << 20)) snprintf(buf, sizeof buf, "%.1f KiB", n / 1024.0);
    else snprintf(buf, sizeof buf, "%.1f MiB", n / (1024.0 * 1024.0));
    return buf;
}

bool address_space_limited() {
#if defined(__unix__) || defined(__APPLE__)
    struct rlimit rl;
    return getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY;
#else
    return false;
#endif
}

void require_headroom(size_t bytes, const char * where, const std::string & what) {
#if defined(__unix__) || defined(__APPLE__)
    // Without an address-space limit a PROT_NONE, NORESERVE mapping cannot fail, so there is
    // nothing to probe; and the probe is not free (munmap in a threaded process shoots down the
    // other threads' TLB entries), so the AR step must not pay for it.
    if (!address_space_limited()) return;
    // Address space, not RAM: PROT_NONE pages are never touched, but they count against RLIMIT_AS.
    void * p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        throw memory_error(cat("[", where, "] out of memory: ", what, " needs about ", format_bytes(bytes),
                               " more address space than this process may map"));
    }
    munmap(p, bytes);
#else
    (void) bytes, (void) where, (void) what;
#endif
}

size_t physical_memory_bytes() {
#if defined(__unix__) || defined(__APPLE__)
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t) pages * (size_t) page : 0;
#else
    return 0;
#endif
}

static size_t thread_stack_bytes() {
#if defined(__GLIBC__)
    // The OpenMP runtime (ggml's CPU threads) starts its threads with the default attributes.
    pthread_attr_t attr;
    size_t size = 0;
    if (pthread_getattr_default_np(&attr) == 0) {
        pthread_attr_getstacksize(&attr, &size);
        pthread_attr_destroy(&attr);
    }
    return size > 0 ? size : size_t(8) << 20;
#else
    return size_t(8) << 20;
#endif
}

size_t graph_headroom(int n_threads) {
    // thread stacks (only the first graph on a thread starts them, but a later one may run on
    // another calling thread), plus the threadpool, work buffer and allocator tables
    const size_t slack = size_t(8) << 20;
    return (size_t) (n_threads > 1 ? n_threads - 1 : 0) * (thread_stack_bytes() + (64 << 10)) + slack;
}

ggml_context * init_meta_ctx(size_t n_tensors, const char * where) {
    const size_t bytes = ggml_tensor_overhead() * (n_tensors + 1);
    // ggml_init aborts when its malloc fails: check that the arena (and its header) fit first
    require_headroom(bytes + (1 << 20), where, "tensor metadata");
    ggml_init_params ip = {bytes, nullptr, /*no_alloc =*/ true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) throw runtime_error(cat("[", where, "] ggml_init failed"));
    return ctx;
}

std::vector<ggml_backend_buffer_t> alloc_tensors_placed(const std::vector<ggml_tensor *> & tensors,
                                                        const std::function<ggml_backend_buffer_type_t(const ggml_tensor *)> & buft_of,
                                                        const char * where, const std::string & what) {
    std::vector<ggml_backend_buffer_type_t> types;
    std::vector<std::vector<ggml_tensor *>> groups;
    for (ggml_tensor * t : tensors) {
        ggml_backend_buffer_type_t b = buft_of(t);
        size_t i = std::find(types.begin(), types.end(), b) - types.begin();
        if (i == types.size()) {
            types.push_back(b);
            groups.emplace_back();
        }
        groups[i].push_back(t);
    }
    std::vector<ggml_backend_buffer_t> out;
    try {
        for (size_t i = 0; i < types.size(); ++i) {
            const size_t align = ggml_backend_buft_get_alignment(types[i]);
            size_t size = 0;
            for (ggml_tensor * t : groups[i]) size += GGML_PAD(ggml_backend_buft_get_alloc_size(types[i], t), align);
            ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(types[i], std::max<size_t>(size, 1));
            if (!buf) {
                throw memory_error(cat("[", where, "] out of memory: cannot allocate ", format_bytes(size), " for ", what,
                                       " (", ggml_backend_buft_name(types[i]), " buffer)"));
            }
            out.push_back(buf);
            ggml_tallocr talloc = ggml_tallocr_new(buf);
            for (ggml_tensor * t : groups[i]) {
                if (ggml_tallocr_alloc(&talloc, t) != GGML_STATUS_SUCCESS) {
                    throw runtime_error(cat("[", where, "] cannot place tensor '", t->name, "' in its buffer"));
                }
            }
        }
    } catch (...) {
        for (ggml_backend_buffer_t b : out) ggml_backend_buffer_free(b);
        throw;
    }
    return out;
}

ggml_backend_buffer_t alloc_ctx_tensors(ggml_context * ctx, ggml_backend_buffer_type_t buft, const char * where,
                                        const std::string & what) {
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buf) {
        const size_t need = ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft);
        throw memory_error(cat("[", where, "] out of memory: cannot allocate ", format_bytes(need), " for ", what,
                               " (", ggml_backend_buft_name(buft), " buffer)"));
    }
    return buf;
}

// The first failure a kernel noted since the last check: kernels cannot allocate a message.
static std::atomic<bool> g_kernel_oom{false};
static std::mutex g_kernel_oom_mutex;
static const char * g_kernel_oom_what = nullptr;
static size_t g_kernel_oom_bytes = 0;

void note_kernel_oom(const char * what, size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(g_kernel_oom_mutex);
    if (!g_kernel_oom.load()) {
        g_kernel_oom_what = what;
        g_kernel_oom_bytes = bytes;
        g_kernel_oom.store(true);
    }
}

void throw_kernel_oom(const char * where) {
    if (!g_kernel_oom.load()) return;
    const char * what;
    size_t bytes;
    {
        std::lock_guard<std::mutex> lock(g_kernel_oom_mutex);
        what = g_kernel_oom_what;
        bytes = g_kernel_oom_bytes;
        g_kernel_oom.store(false);
    }
    throw memory_error(cat("[", where, "] out of memory: a compute thread could not allocate ", format_bytes(bytes),
                           " of scratch for ", what, "; the results of this pass were discarded"));
}

}  // namespace dfn
