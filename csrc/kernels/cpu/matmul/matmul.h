// Batch-invariant CPU matmul: y = W x for F16 / F32 / BF16 / quantized weights and F32 activations.
//
// The family's map: which file holds each path at each instruction set. matmul.cpp includes the
// .inc files into one namespace per ISA (isa_portable, isa_avx2, isa_avx512 for the F32 path,
// isa_avx512bw and isa_avx512vnni for the integer rows), each after it defines the primitives the
// .inc's first comment lists; wide_gemm.cpp does the same with wide_gemm.inc (wide256, wide512).
//
//   path              | portable           | AVX2               | AVX-512BW           | AVX-512 VNNI
//   ------------------+--------------------+--------------------+---------------------+---------------------
//   F32 tiles         | tile.inc           | tile.inc           | tile.inc (isa_avx512: AVX-512F, both columns)
//   dequant (F32 path)| dequant.inc        | dequant.inc        | dequant.inc (isa_avx512, both columns)
//   Q4_0 / Q8_0 rows  | int_portable.inc   | q8_0_avx2.inc      | q8_0_avx512.inc     | q8_0_avx512.inc
//                     |   (rows_q8)        | + q8_0_rows.inc    | + q8_0_rows.inc     | + q8_0_rows.inc
//   Q4_K/Q5_K/Q6_K    | int_portable.inc   | kq_avx2.inc        | kq_avx512.inc       | kq_avx512.inc
//     rows            | + kq_rows.inc      | + kq_rows.inc      | + kq_rows.inc tiles | + kq_rows.inc tiles
//   K-quant scale step| kq_scale.inc, every column (included by int_portable.inc, kq_avx2.inc, kq_avx512.inc)
//   activation quant. | quantize_act.{h,cpp}, every column (the rows kernels' Q8_0 / Q8_K columns)
//   wide GEMM         | - (rows kernels,   | wide_gemm.inc      | wide_gemm.inc       | wide_gemm.inc
//     (pack + tiles)  |   ggml_mul_mat)    |   (wide256)        |   (wide256)         |   (wide512)
//
// The AVX-512BW and VNNI columns are int_avx512.inc included twice (INT_VNNI 0 / 1: Q8_DPBUSD,
// KQ_DPWSSD); AVX-512 without BW runs the AVX2 integer rows. Around them: matmul.cpp (the
// primitives, the choice of path and level: rows_on, rows_q8_on, wide_min_cols), blocks.h (the block
// layouts), dispatch.h + tune.cpp (the level measured per weight type), wide_gemm.{h,cpp} (the wide
// GEMM's layout, math, primitives and ops).
//
// The contract: every output y[n, r] is computed by one fixed sequence of IEEE operations that
// depends on row r of W and column n of x only -- not on the number of columns N, the tile the
// output falls in, the thread that computes it, or the instruction set (AVX-512, AVX2 and the
// portable path round alike; tests/test_matmul.py compares them bit for bit). That makes a verify
// pass over L tokens compute each token's matmuls exactly as the AR step over that token alone.
//
// F32 path (F16, F32, BF16, and the quantized types not on the integer path): one 16-lane
// accumulator over k = 0, 16, 32, ... (fused multiply-add, the tail zero-padded) followed by a
// fixed pairwise sum of the lanes. Quantized / BF16 rows are dequantized to F32 a tile of rows at
// a time (one function per type) and multiplied as F32 rows; the activations stay F32.
//
// Integer path (Q4_0, Q8_0 -> activations as Q8_0; Q4_K, Q5_K, Q6_K -> activations as Q8_K: the
// vec_dot_type ggml's CPU backend pairs with each), what llama.cpp computes, in a fixed order:
//  1. each column of x is quantized (quantize_act.h, ggml's reference quantize_row_q8_0 / q8_K:
//     one function per column, so the codes do not depend on N or the thread): x_k ~ da_b * a_k
//     with int8 codes a_k and one scale da_b per block b (32 values for Q8_0, 256 for Q8_K);
//  2. the weights are w_k = dw_b * q_k (Q4_0: q - 8; Q8_0: q), or for the K-quants
//     w_k = d_s * sc_j * q_k - dmin_s * m_j per superblock s (256) and sub-block j (16 or 32);
//  3. block sums are exact integers (int8 x int8 -> int32; AVX-512 VNNI vpdpbusd, maddubs + madd on
//     512 / 256 bits, or plain C: exact, so how they are grouped cannot change them):
//       Q8_0 kind, per block b: s_b = sum_{k < 32} q_{32 b + k} a_{32 b + k}
//                  (with VNNI from unsigned codes: Q4_0 nibble_k, Q8_0 q_k xor 0x80, plus the
//                  activations' -8 or -128 x the sum of a; without, Q8_0 as |q_k| x (a_k signed
//                  by q_k): the same integer)
//       Q8_K kind, per superblock s: S = sum_k sc_k q_k a_k over its 256 codes (sc_k the scale of
//                  k's 16- or 32-code group; Q6_K: the signed q - 32), and (Q4_K / Q5_K)
//                  M = sum_j m_j bsum_j (m_j the min of sub-block j, bsum_j the sum of its codes a_k);
//  4. the float combination, per output: one accumulator from +0, one fused step per block in order
//       Q8_0 kind: acc = fmaf(fl(dw_b * da_b), (float) s_b, acc)
//       Q8_K kind: acc = fmaf(fl(d_s * da_s), (float) S, acc), then (Q4_K / Q5_K)
//                  acc = fmaf(-fl(dmin_s * da_s), (float) M, acc);  y = acc.
//     (float) of an int32 rounds to nearest even, the same everywhere. The sources are built with
//     -ffp-contract=off so that no compiler fuses what is written as separate operations.
//     tests/reference/q8_matmul_ref.py emulates these operations exactly; every path matches it
//     bit for bit (tests/test_matmul.py). A NaN or Inf in a column makes its outputs NaN on every
//     path; the NaN's sign and payload are not promised.
// That is llama.cpp's per-block structure (an exact block sum, a scale product, an accumulation per
// block; not its rounding: its reference rounds fl(fl(sumi dx) dy) and its SIMD paths keep partial
// sums), so the activations round as its quantized matmul does (but its x86 activation quantizers
// round differently from the reference: docs/architecture.md). One accumulator per output is what
// lets a batch run as a GEMM with the columns in the vector lanes (wide_gemm.h), and one column
// as lanes = rows.
//
// Speed: W is converted once per tile of rows and reused across the columns (F32 path: F16 -> F32
// for up to 8 columns at a time on AVX-512, 2 on AVX2; a tile's lane sums transposed, matmul.cpp's
// tile_sums). Integer path, by columns N:
//   N below wide_min_cols (matmul.cpp: on AVX-512 VNNI 12, Q6_K 14, Q4_0 16, Q8_0 22; on AVX2 and AVX-512
//     without VNNI 6, Q8_0 24): rows kernels. Q8_0 kind: 16 rows in the lanes (AVX-512: two rows'
//     block per vector, a tree of lane sums to the 16 block sums; AVX2: 8 rows per hadd tree), up
//     to 16 columns per pass (AVX-512 keeps each block's unpacked codes for them), the next tile's
//     blocks prefetched. K-quants: one column in tiles of 2 rows (each output's 16 integer lanes
//     summed), more columns 16 rows in the lanes x up to 13 columns in one pass, then 8 and 4 at a
//     time (AVX-512), or 1 row x 4 (AVX2);
//     the portable path one output at a time in plain C;
//   N from wide_min_cols: the GEMM of wide_gemm.h (columns in the lanes), the wider verify
//     passes and the prompt chunks,
// so the cost of a verify pass grows with its FLOPs, not with re-converting the weights per column.
#pragma once

#include "graph/build_context.h"
#include "kernels/cpu/matmul/dispatch.h"

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

// ggml CPU custom op: W [K, M], x [K, N] -> F32 [M, N], at dispatch's level for W's type and N
// (nullptr: isa_in_use()). dispatch must outlive the graph (the runner's own does).
ggml_tensor * matmul_op(ggml_context * ctx, ggml_tensor * W, ggml_tensor * x, const matmul_dispatch * dispatch = nullptr);

// Columns up to which matmul() takes matmul_op: decode steps, verify blocks and draft blocks.
// Wider inputs (prompt chunks) are compute-bound GEMMs where ggml's tiled kernels are faster for
// the F32 path (bench/ar_decode.py: prefill 0.77x of llama.cpp with matmul_op for 256 columns);
// the integer path's types take the GEMM of wide_gemm.h (AVX-512 VNNI or AVX2), the same bits
// as matmul_op's. 64 covers every verify (k_max_block_size tokens, or a tree of up to 63 nodes +
// root), so each is bitwise.
constexpr int64_t k_matmul_max_cols = 64;

// What every graph builder calls for a weight matmul: matmul_op where supported, b asks for
// our own kernels (the session's `matmul` setting) and x has at most k_matmul_max_cols
// columns, or any number in a batched pass (build_context::any_width: its columns are several
// requests' steps, each computed as alone); matmul_wide for wider x where it applies
// (wide_gemm.h); else ggml_mul_mat.
ggml_tensor * matmul(const build_context & b, ggml_tensor * W, ggml_tensor * x);

// The kernel itself, for tests and benchmarks: rows [r0, r1) of y[n * ldy + r] =
// sum_k W_r[k] x[n * ldx + k], n < N, where row W_r (w_type, K elements) starts at byte
// r * w_row_bytes of W. isa: one of matmul_isas(), or empty for the one matmul_op uses, or
// "avx512f-novnni" (where "avx512f" is listed): the AVX-512 integer rows a CPU without VNNI runs.
// f32_path: a type of the integer path (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) through the F32 path instead.
void matmul_rows(const void * W, ggml_type w_type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                 int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1, const std::string & isa = "",
                 bool f32_path = false);

// The kernel as matmul_op runs it, for the other CPU ops built on it (moe_experts.h): rows
// [r0, r1) of y = W x as matmul_rows above, at `level` (a matmul_dispatch's isa_for, never above
// isa_in_use()). Never throws: false when its scratch cannot be had (noted; the graph runner throws
// it after the compute). W's type a matmul_weight_type, K a multiple of its block.
bool matmul_rows_at(isa_level level, const void * W, ggml_type w_type, size_t w_row_bytes, const float * x,
                    int64_t ldx, float * y, int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1) noexcept;

// The instruction set matmul_op runs on this machine: "avx512f", "avx2" or "portable".
const char * matmul_isa();

// Those this machine can run, best first (tests compare them bit for bit).
std::vector<std::string> matmul_isas();

}  // namespace dfn
