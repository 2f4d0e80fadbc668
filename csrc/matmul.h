// Batch-invariant CPU matmul: y = W x for F16 / F32 / BF16 / quantized weights and F32 activations.
//
// Every output y[n, r] is one 16-lane accumulator over k = 0, 16, 32, ... (fused multiply-add,
// the tail zero-padded) followed by a fixed pairwise sum of the lanes. Its bits therefore do not
// depend on the number of columns N, on the tile the output falls in, on the thread that
// computes it, or on the instruction set (AVX-512, AVX2 and the portable path round alike).
// That makes a verify pass over L tokens compute each token's matmuls exactly as the AR step
// over that token alone does.
//
// Other weight types (BF16, Q4_0 .. Q8_0, the K- and IQ-quants) are dequantized to F32 a tile of
// rows at a time by ggml's own dequantization of the type (one function, whatever N, tile, thread
// or ISA), then multiplied as F32 rows: the activations stay F32 (ggml's quantized matmul rounds
// them to Q8_0 / Q8_K first, and its batched paths -- llamafile sgemm, the tiled K-quant GEMM --
// sum in another order than its one-column vec_dot: not batch-invariant, docs/architecture.md).
//
// Speed: W is converted F16 -> F32 once per tile and reused for up to 8 columns, so the cost
// of a verify pass grows with its FLOPs, not with re-converting the weights per column (ggml's
// small-N F16 paths convert W for every column block and round x to F16).
#pragma once

#include "build_context.h"

#include "ggml.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dfn {

// The weight types the kernel takes: F16, F32, BF16, and every quantized type ggml can dequantize.
bool matmul_weight_type(ggml_type type);

// True when matmul_op can compute W x: W of a matmul_weight_type, 2-D with contiguous rows in a
// host buffer (or not yet allocated), x F32 2-D with contiguous rows, W->ne[0] == x->ne[0].
bool matmul_op_supported(const ggml_tensor * W, const ggml_tensor * x);

// ggml CPU custom op: W [K, M], x [K, N] -> F32 [M, N].
ggml_tensor * matmul_op(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x);

// Columns up to which matmul() takes matmul_op: decode steps, verify blocks and draft blocks.
// Wider inputs (prompt chunks) are compute-bound GEMMs where ggml's tiled kernels are faster
// (bench/ar_decode.py: prefill 0.77x of llama.cpp with matmul_op for 256 columns). 64 covers
// every verify (k_max_block_size tokens, or a tree of up to 63 nodes + root), so each is bitwise.
constexpr int64_t k_matmul_max_cols = 64;

// What every graph builder calls for a weight matmul: matmul_op where supported, b asks for
// our own kernels (the session's `matmul` setting) and x has at most k_matmul_max_cols
// columns, else ggml_mul_mat.
ggml_tensor * matmul(const build_context & b, ggml_tensor * W, ggml_tensor * x);

// The kernel itself, for tests and benchmarks: rows [r0, r1) of y[n * ldy + r] =
// sum_k W_r[k] x[n * ldx + k], n < N, where row W_r (w_type, K elements) starts at byte
// r * w_row_bytes of W. isa: one of matmul_isas(), or empty for the one matmul_op uses.
void matmul_rows(const void * W, ggml_type w_type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                 int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1, const std::string & isa = "");

// The instruction set matmul_op runs on this machine: "avx512f", "avx2" or "portable".
const char * matmul_isa();

// Those this machine can run, best first (tests compare them bit for bit).
std::vector<std::string> matmul_isas();

}  // namespace dfn
