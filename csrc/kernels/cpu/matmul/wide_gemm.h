// Wide matmuls of Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K weights: a GEMM on AVX-512 VNNI (groups of 16
// columns) or AVX2 (groups of 8), computing every output by the batch-invariant contract's
// operations (matmul.h, integer path). Two callers: matmul() for prompt chunks (more than
// k_matmul_max_cols columns: the ops below), and the batch-invariant kernel itself for verify
// passes and drafts of wide_min_cols columns and more (matmul.cpp, through matmul_wide_span).
//
// Why: llama.cpp on a CPU without AMX repacks Q4_0 weights for its GEMM (ggml's CPU_REPACK), and
// there its prefill ran 1.2x ours, which went through ggml_mul_mat on the plain layout (llamafile's
// tinyBLAS, one 32-code block dot per output and block, on 256 bits). This GEMM keeps the file's
// layout and gets its speed from the activations instead, packed once per matmul so that one
// vpdpbusd sums 4 codes for 16 columns at once:
//
//   pack (op "q8_pack", columns split across threads): each column quantized per block of 32 by
//     ggml's quantize_row_q8_0_ref (the codes a, the F16-rounded scale da; in 512-bit registers
//     at width 16, 256-bit ones at width 8, the same operations per value), into groups of 16
//     columns; per group g and block b, 640 bytes:
//       8 x 64 bytes: chunk j < 8, lane c < 16: the codes a[16 g + c][32 b + 4 j .. + 3]
//       16 int32:     bias[c] = -off x sum of the block's 32 codes of column 16 g + c
//       16 float:     da[c]
//     (columns past N in the last group: codes 0, da 0). off is the offset of the weight's
//     unsigned codes u: Q4_0 8 (u the nibble), Q8_0 128 (u = q xor 0x80), so that
//     sum_k u_k a_k + bias = sum_k w_k a_k with w the signed codes, exactly (int32).
//   gemm (op "matmul_wide", rows split across threads): per tile of 8 rows, the rows' blocks
//     unpacked once to unsigned code bytes and F32 scales dw (L1-sized scratch); per group of 16
//     columns, per row r, 16 float lanes (one per column), from 0, for each block b in order:
//       s = bias + sum_{j < 8} vpdpbusd(broadcast(u[r][b][4 j .. 4 j + 3]), a-chunk j)   (exact)
//       lane = fmaf(fl(dw[r][b] * da[c]), (float) s, lane)
//     then lane c is y[16 g + c][r]. AVX2 (groups of 8, tiles of 4 rows): the same integer sums by
//     maddubs + madd (Q4_0: the nibbles' pairs summed in int16 over the 8 chunks, at most
//     8 x 2 x 15 x 127; Q8_0: |w| times a signed by w, off 0) and the same float operations, so
//     the same bits as AVX-512 -- and as the rows kernels of matmul.cpp at one column: these are
//     the contract's operations (matmul.h, steps 3-4), so a prompt's chunk, a verify pass and an
//     AR step compute a token alike. An output's operations are fixed: its bits do not depend on
//     N, on the other columns, on the thread split or on the level.
//
// Q4_K, Q5_K and Q6_K (activations as Q8_K, ggml's quantize_row_q8_K_ref, in 512- or 256-bit
// registers with the same rounding; per group and superblock of 256: 64 chunks of the codes, 8
// pairs of int16 lanes holding Q8_K's bsums (sums of 16 codes),
// the scales da): per row and superblock, S = sum_g sc_g t_g over the scale groups (Q4_K / Q5_K: 8
// sub-blocks of 32, codes 0..15 / 0..31; Q6_K: 16 groups of 16, codes 0..63, signed scales; t_g the
// exact sums of unsigned code x activation code, vpdpbusd; AVX2 maddubs pairs in int16 and one madd
// by sc_g) and M, the bsum pairs times (m_p, m_p) for Q4_K / Q5_K's mins or (sc_2p, sc_2p+1) for
// Q6_K's offset 32 (vpdpwssd / madd); then
//   Q4_K, Q5_K: lane = fmaf(fl(d * da), S, lane), lane = fmaf(fl(-dmin * da), M, lane)
//   Q6_K:       lane = fmaf(fl(d * da), S - 32 M, lane)     (S - 32 M: the signed codes' sum, exact)
// the same bits at both levels.
//
// Taken (matmul_wide) for Q4_0 / Q8_0 (K a multiple of 32) and Q4_K / Q5_K / Q6_K (of 256) weights
// in host memory, more than k_matmul_max_cols columns, the own kernels, when the level in use is
// AVX-512 on a CPU with AVX-512 VNNI (AMD Zen 4, Intel since Ice Lake: 16 columns) or AVX2 (8
// columns; also AVX-512 without VNNI); else (the portable level) ggml_mul_mat. Prompt chunks run
// the level in use (isa_in_use()); inside the batch-invariant kernel, the level its measured
// dispatch chose (dispatch.h).
#pragma once

#include "graph/build_context.h"
#include "base/cpu_isa.h"

#include "ggml.h"

#include <string>

namespace dfn {

// W [K, M] (Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K), x F32 [K, N] -> F32 [M, N]: the pack and gemm ops
// above, or nullptr where they do not apply (then matmul() takes ggml_mul_mat).
ggml_tensor * matmul_wide(const build_context & b, ggml_tensor * W, ggml_tensor * x);

// Tests: the GEMM on rows [0, M) of W against x (N columns, any N), one thread; isa "avx512f"
// (16 columns, VNNI), "avx2" (8 columns) or "" (the one the engine runs).
void matmul_wide_rows(const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx, float * y,
                      int64_t ldy, int64_t K, int64_t M, int64_t N, const std::string & isa = "");

// True when the engine's prompt matmuls take it here (the level in use is AVX-512 with VNNI, or AVX2).
bool matmul_wide_available();

// The group width of the GEMM at `level` on this CPU: 16 (AVX-512 with VNNI, unless no_vnni), 8
// (AVX2, and AVX-512 without VNNI), 0 (none: the portable level, or not x86).
int matmul_wide_width(isa_level level, bool no_vnni = false);

// For the batch-invariant matmul's wider calls (matmul.cpp: wide_min_cols columns and more): rows
// [r0, r1) of y[n * ldy + r] = (W x)[r, n] through the pack and the GEMM of `width` in the calling
// thread, which packs all N columns itself (as the rows path quantizes them). The same operations
// per output as the rows path (matmul.h), so the same bits. False (noted) when the scratch cannot
// be had; W's rows must suit the GEMM (K a multiple of the type's block).
bool matmul_wide_span(int width, const void * W, ggml_type type, size_t w_row_bytes, const float * x, int64_t ldx,
                      float * y, int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t r1);

}  // namespace dfn
