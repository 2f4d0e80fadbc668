// The row heads of a graph (argmax, top-1 with its probability) in stock ggml ops, for graphs that
// run on a device (build_context::device). The CPU runs top1.h's custom ops instead; both pick the
// first maximum of a row, as ggml_argmax does.
#pragma once

#include "graph/build_context.h"

#include "ggml.h"

namespace dfn {

struct device_head {
    ggml_tensor * ids = nullptr;   // I32 [rows]: each row's first maximum (top-K: I32 [K, rows])
    ggml_tensor * p = nullptr;     // F32 [1, rows]: its softmax probability (top-1 heads only)
    ggml_tensor * sums = nullptr;  // F32 [1, rows]: the row's sum, non-finite when the row holds a NaN or an inf
};

// logits F32 [n, rows] -> the argmax of each row (with_p: and its probability), every output
// marked as a graph output. ggml_argmax cannot flag a non-finite row itself: the row sums let the
// host do it (device_head_finite), one float per row.
device_head device_argmax(const build_context & b, ggml_tensor * logits, bool with_p);

// logits F32 [n, rows] -> each row's K most probable entries, probability descending
// (ggml_argsort_top_k; ties in no fixed order: tree drafts only): ids I32 [K, rows], p F32
// [1, K, rows] (softmax values gathered by ggml_get_rows over the rows), sums as above.
device_head device_topk(const build_context & b, ggml_tensor * logits, int64_t K);

// Reads the head back: ids[rows * K], p[rows * K] when asked for (nullptr: not read), K = 1 but
// for device_topk. Returns the first row whose logits are not finite, or -1.
int64_t read_device_head(const device_head & h, int32_t * ids, float * p);

}  // namespace dfn
