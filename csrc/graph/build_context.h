// What every graph builder builds with, passed down explicitly from graph_runner::run to each
// block and op choice (no per-thread switch).
#pragma once

#include "ggml.h"

namespace dfn {

struct matmul_dispatch;

// Which kernels the graph builders use for weight matmuls (and attention, the conv and the
// argmax): MATMUL_OWN, this package's batch-invariant CPU ops where they apply, or MATMUL_GGML.
enum matmul_kind { MATMUL_OWN, MATMUL_GGML };

// The target's builders get it inside graph_inputs (graph.h), which adds the target's hparams,
// cache and inputs; the drafter's builders take it alone and read their own hparams.
struct build_context {
    ggml_context * ctx = nullptr;  // the runner's metadata arena (no_alloc)
    ggml_cgraph * gf = nullptr;
    matmul_kind kernels = MATMUL_OWN;
    const matmul_dispatch * dispatch = nullptr;  // the runner's matmul levels per weight type (dispatch.h)
    // The graph runs on a ggml device other than the CPU (CUDA, Metal, Vulkan, RPC): stock ggml ops
    // only, no custom op (ggml runs custom ops on the CPU alone; one would drag activations back to
    // the host every layer). docs/architecture.md, "Devices".
    bool device = false;
    // A batched pass (target_session::decode_batch): matmul_op at any width, not only up to
    // k_matmul_max_cols, so that each column computes as it does alone in a one-sequence pass
    // however many requests' columns the pass holds (matmul.h).
    bool any_width = false;
    bool own_kernels() const { return kernels == MATMUL_OWN && !device; }
};

}  // namespace dfn
