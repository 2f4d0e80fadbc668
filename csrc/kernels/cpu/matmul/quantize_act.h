// The integer path of the batch-invariant matmul (matmul.h has the contract and the math):
// activations quantized to Q8_0 / Q8_K as ggml's reference quantizers do, weight rows decoded to
// integer codes and integer scales. Internal to matmul*.cpp; the per-ISA dot loops are in
// int_portable.inc.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <vector>

namespace dfn {

// How a weight type's activations are quantized: none (the type takes the F32 path), Q8_0
// (Q4_0, Q8_0: blocks of 32) or Q8_K (Q4_K, Q5_K, Q6_K: superblocks of 256).
enum class q8_kind { none, q8_0, q8_K };
q8_kind q8_kind_of(ggml_type type);

// N columns of K activations, quantized: qs [N][ldq = K] int8 codes. Q8_0: d [N][ldd] (the
// F16-rounded block scales as F32, ldd = nb16 = K / 32 rounded up to 16, zero past K / 32), and
// bias [N][K / 4]: -off x the sum of each 4 codes, off the offset of the weight type's unsigned
// codes on the SIMD paths (Q4_0: 8, its nibbles; Q8_0: 128, its codes xor 0x80), so that a
// 4-code sum of unsigned codes u times a plus the bias is the sum of the signed codes times a.
// Q8_K: d [N][ldd = K / 256], bsums [N][K / 16] (sums of 16 codes).
struct q8_acts {
    q8_kind kind = q8_kind::none;
    int64_t K = 0, N = 0, nb16 = 0, ldq = 0, ldd = 0;
    std::vector<int8_t> qs;
    std::vector<float> d;
    std::vector<int16_t> bsums;
    std::vector<int32_t> bias;
};

// Quantizes x (N columns, column n at x + n * ldx, K values) into A for weights of `type` (a
// q8_kind_of type), column by column with one function per kind (so a column's codes do not
// depend on N). False when the scratch cannot be had (noted; matmul.cpp throws it after the
// compute).
//   Q8_0 (ggml's quantize_row_q8_0_ref): per block of 32, amax = max |x|, d = amax / 127,
//        id = d ? 1 / d : 0, q = roundf(x * id), and d is stored as F16.
//   Q8_K (ggml's quantize_row_q8_K_ref): per 256, max = the x of largest |x| (first one), iscale =
//        -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale (F32); all zero: d = 0.
// A block holding NaN or Inf gets codes 0 and d = NaN: the outputs it feeds are NaN.
bool q8_quantize_acts(ggml_type type, const float * x, int64_t ldx, int64_t K, int64_t N, q8_acts & A);

// One block of 32 as quantize_row_q8_0_ref (above): the codes into q, the F16-rounded scale
// returned (NaN with codes 0 for a block holding NaN or Inf).
float quantize_q8_0_block(const float * x, int8_t * q);

// One superblock of 256 as quantize_row_q8_K_ref (above): the codes into q, their sums per 16 into
// bsums, d returned (NaN with codes 0 for a superblock holding NaN or Inf).
float quantize_q8_K_block(const float * x, int8_t * q, int16_t * bsums);

// int_portable.inc, q8_0_rows.inc, kq_rows.inc: the dot loops, per ISA.

}  // namespace dfn
