#include "kernels/cpu/matmul/quantize_act.h"
#include "base/alloc.h"
#include "kernels/cpu/matmul/blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

// Built with -ffp-contract=off (CMakeLists.txt): iscale * x + 12582912.f must stay two roundings,
// as in ggml's reference quantizer, on every target (an FMA would round once).

namespace dfn {

q8_kind q8_kind_of(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q8_0: return q8_kind::q8_0;
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K:
        case GGML_TYPE_Q6_K: return q8_kind::q8_K;
        default: return q8_kind::none;
    }
}

namespace {

// A block holding NaN or Inf: codes 0 and the scale NaN, so that every output it feeds is NaN, as
// on the F32 path (the engine's non-finite-logits check then raises; ggml would convert NaN to int).
inline bool all_finite(const float * x, int n) {
    bool ok = true;
    for (int j = 0; j < n; ++j) ok &= std::isfinite(x[j]);
    return ok;
}

}  // namespace

// ggml's quantize_row_q8_0_ref for one block of 32; returns the F16-rounded scale.
float quantize_q8_0_block(const float * x, int8_t * q) {
    if (!all_finite(x, 32)) {
        std::memset(q, 0, 32);
        return std::numeric_limits<float>::quiet_NaN();
    }
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; ++j) {  // roundf (half away from zero), inline: t exact, v - t exact
        const float v = x[j] * id;
        const int t = (int) v;
        const float frac = v - (float) t;
        q[j] = (int8_t) (t + (frac >= 0.5f) - (frac <= -0.5f));
    }
    return half_to_float(ggml_fp32_to_fp16(d));
}

namespace {

// ggml's nearest_int: round half to even through the float's mantissa (|v| <= 2^22).
inline int nearest_int(float v) {
    const float r = v + 12582912.0f;
    int32_t i;
    std::memcpy(&i, &r, sizeof(i));
    return (i & 0x007fffff) - 0x00400000;
}

}  // namespace

// ggml's quantize_row_q8_K_ref for one superblock of 256; returns d.
float quantize_q8_K_block(const float * x, int8_t * q, int16_t * bsums) {
    if (!all_finite(x, 256)) {
        std::memset(q, 0, 256);
        std::memset(bsums, 0, 16 * sizeof(int16_t));
        return std::numeric_limits<float>::quiet_NaN();
    }
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < 256; ++j) {
        const float ax = std::fabs(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    if (amax == 0.0f) {
        std::memset(q, 0, 256);
        std::memset(bsums, 0, 16 * sizeof(int16_t));
        return 0.0f;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; ++j) q[j] = (int8_t) std::min(127, nearest_int(iscale * x[j]));
    for (int i = 0; i < 16; ++i) {
        int s = 0;
        for (int j = 0; j < 16; ++j) s += q[16 * i + j];
        bsums[i] = (int16_t) s;
    }
    return 1.0f / iscale;
}

bool q8_quantize_acts(ggml_type type, const float * x, int64_t ldx, int64_t K, int64_t N, q8_acts & A) {
    const q8_kind kind = q8_kind_of(type);
    A.kind = kind;
    A.K = K;
    A.N = N;
    if (kind == q8_kind::q8_0) {
        const int64_t nb = K / 32;
        A.nb16 = (nb + 15) / 16 * 16;
        A.ldd = A.nb16;
    } else {
        A.nb16 = 0;
        A.ldd = K / 256;
    }
    A.ldq = K;
    if (!kernel_scratch(A.qs, (size_t) (N * A.ldq), "the matmul's quantized activations") ||
        !kernel_scratch(A.d, (size_t) (N * A.ldd), "the matmul's activation scales") ||
        !kernel_scratch(A.bsums, (size_t) (kind == q8_kind::q8_K ? N * (K / 16) : 0), "the matmul's activation sums") ||
        !kernel_scratch(A.bias, (size_t) (kind == q8_kind::q8_0 ? N * (K / 4) : 0), "the matmul's activation sums"))
        return false;
    for (int64_t n = 0; n < N; ++n) {
        const float * xn = x + n * ldx;
        int8_t * q = A.qs.data() + n * A.ldq;
        float * d = A.d.data() + n * A.ldd;
        if (kind == q8_kind::q8_0) {
            const int64_t nb = K / 32;
            const int32_t off = type == GGML_TYPE_Q4_0 ? 8 : 128;
            int32_t * bias = A.bias.data() + n * (K / 4);
            for (int64_t b = 0; b < nb; ++b) d[b] = quantize_q8_0_block(xn + 32 * b, q + 32 * b);
            for (int64_t j = 0; j < K / 4; ++j) bias[j] = -off * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
            std::fill(d + nb, d + A.ldd, 0.0f);
        } else {
            int16_t * bs = A.bsums.data() + n * (K / 16);
            for (int64_t s = 0; s < K / 256; ++s) d[s] = quantize_q8_K_block(xn + 256 * s, q + 256 * s, bs + 16 * s);
        }
    }
    return true;
}

}  // namespace dfn
