// Allocation that fails with an exception instead of an abort.
//
// ggml reports a failed backend buffer by returning NULL, but aborts (GGML_ASSERT / GGML_ABORT) on
// most of its small internal allocations (contexts, graph allocator tables, the CPU threadpool), and
// the OpenMP runtime ends the process when it cannot start a compute thread. Under a memory limit
// (RLIMIT_AS, a container) those are the allocations that fail right after a large one succeeded.
// The helpers here check every large allocation, and check for headroom before the calls into ggml
// whose small allocations are unchecked, so that running out of memory raises Python MemoryError
// with the buffer and its size named, and never kills the process.
#pragma once

#include "base/common.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstddef>
#include <new>
#include <functional>
#include <string>
#include <vector>
#include <vector>

namespace dfn {

// Out of memory for a named buffer: maps to Python MemoryError (pybind11 translates std::bad_alloc).
struct memory_error : std::bad_alloc {
    explicit memory_error(std::string msg) : msg_(std::move(msg)) {}
    const char * what() const noexcept override { return msg_.c_str(); }

private:
    std::string msg_;
};

std::string format_bytes(size_t n);  // "12.5 MiB"

// Throws memory_error "[where] ..." unless `bytes` of address space can be mapped right now (a
// PROT_NONE probe, unmapped again). Where memory is not limited this always succeeds.
void require_headroom(size_t bytes, const char * where, const std::string & what);
// True when the process runs under an address-space limit (RLIMIT_AS): the only case in which a
// headroom probe can fail. Cheap (one getrlimit).
bool address_space_limited();

// The machine's physical memory in bytes (0 where it cannot be read): what a cache that is
// zeroed when made (every page touched) can never exceed.
size_t physical_memory_bytes();

// Headroom for the small allocations ggml makes without checking them (graph allocator tables,
// CPU threadpool, OpenMP thread stacks) before a graph runs on n_threads threads.
size_t graph_headroom(int n_threads);

// ggml_init for a no_alloc (metadata only) context of n_tensors tensors, checked.
ggml_context * init_meta_ctx(size_t n_tensors, const char * where);

// Gives each tensor of `tensors` its place in a buffer of buft_of(tensor): one buffer per buffer type
// (a model split over several devices), returned in the order the types first appear. Checked as
// alloc_ctx_tensors is.
std::vector<ggml_backend_buffer_t> alloc_tensors_placed(const std::vector<ggml_tensor *> & tensors,
                                                        const std::function<ggml_backend_buffer_type_t(const ggml_tensor *)> & buft_of,
                                                        const char * where, const std::string & what);

// ggml_backend_alloc_ctx_tensors_from_buft, checked: throws memory_error naming `what` and its size.
ggml_backend_buffer_t alloc_ctx_tensors(ggml_context * ctx, ggml_backend_buffer_type_t buft, const char * where,
                                        const std::string & what);

// Kernels (ggml custom ops) run on ggml's worker threads, inside C frames and an OpenMP region, where
// an exception would call std::terminate. They size their scratch with kernel_scratch(), which notes
// a failure and returns false instead of throwing; the kernel then returns early, and the graph
// runner throws the noted failure after the compute (throw_kernel_oom).
void note_kernel_oom(const char * what, size_t bytes) noexcept;
void throw_kernel_oom(const char * where);  // no-op when nothing was noted

template <typename T>
bool kernel_scratch(std::vector<T> & v, size_t n, const char * what) noexcept {
    try {
        v.resize(n);
        return true;
    } catch (...) {
        note_kernel_oom(what, n * sizeof(T));
        return false;
    }
}

}  // namespace dfn
