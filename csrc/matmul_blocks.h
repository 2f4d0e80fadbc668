// The block layouts of the quantized types the matmul decodes itself (the GGUF format's, as
// ggml-common.h has them; matmul_weight_type checks their sizes against ggml's before use), and
// the F16 -> F32 conversion of their scales. Internal to matmul*.cpp.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <cstring>

namespace dfn {

struct blk_q8_0 {
    ggml_fp16_t d;
    int8_t qs[32];
};
struct blk_q4_0 {
    ggml_fp16_t d;
    uint8_t qs[16];
};
struct blk_q4_K {
    ggml_fp16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
};
struct blk_q5_K {
    ggml_fp16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
};
struct blk_q6_K {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    ggml_fp16_t d;
};

// F16 -> F32 (exact) for the block scales, inline: a call into ggml per block of 32 codes costs more
// than dequantizing the block.
static inline float half_to_float(ggml_fp16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in F32
        const float v = (float) man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

}  // namespace dfn
