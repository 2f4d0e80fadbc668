// NOT BUILT OR RUN: no CMake target compiles this file and no test runs it (no Apple machine here;
// docs/architecture.md, "Not built yet"). On a Metal device the package runs ggml's own stock ops
// (docs/architecture.md, "Devices"), so nothing depends on it.
// Metal GDN tape kernels, the same ops as csrc/kernels/cpu/gdn_tape.cpp (the reference). Layouts (floats, contiguous):
//   state [H_v][S][S] (row j = column j of S, k index fastest)
//   tape_k, tape_u [T][H_v][S]; tape_g [T][H_v]
//   q, k [T][H_k][S]; v [T][H_v][S]; g, beta [T][H_v]; o [T][H_v][S]
// NOTE: not yet built or run: this project has no Apple machine in CI. The host side (a
// Metal pipeline in the engine) is not written yet; see the README's status.
#include <metal_stdlib>
using namespace metal;

struct gdn_dims {
    uint S;
    uint H_k;
    uint H_v;
    uint T;
    uint n;  // replay: tokens to apply
};

// One threadgroup per value head; SIMD group g handles rows j = g, g + n_groups, ...
kernel void gdn_tape_record(device const float * q      [[buffer(0)]],
                            device const float * k      [[buffer(1)]],
                            device const float * v      [[buffer(2)]],
                            device const float * g      [[buffer(3)]],
                            device const float * beta   [[buffer(4)]],
                            device const float * state0 [[buffer(5)]],
                            device float * work         [[buffer(6)]],
                            device float * o            [[buffer(7)]],
                            device float * tape_k       [[buffer(8)]],
                            device float * tape_u       [[buffer(9)]],
                            device float * tape_g       [[buffer(10)]],
                            constant gdn_dims & d       [[buffer(11)]],
                            threadgroup float * shm     [[threadgroup(0)]],   // k[S], q[S]
                            uint h                      [[threadgroup_position_in_grid]],
                            uint tid                    [[thread_index_in_threadgroup]],
                            uint ntid                   [[threads_per_threadgroup]],
                            uint lane                   [[thread_index_in_simdgroup]],
                            uint sg                     [[simdgroup_index_in_threadgroup]],
                            uint n_sg                   [[simdgroups_per_threadgroup]]) {
    const uint S = d.S, H_v = d.H_v, hk = h % d.H_k;
    threadgroup float * ks = shm;
    threadgroup float * qs = shm + S;
    device float * M = work + (ulong) h * S * S;
    for (uint x = tid; x < S * S; x += ntid) M[x] = state0[(ulong) h * S * S + x];
    const float scale = rsqrt((float) S);
    for (uint t = 0; t < d.T; ++t) {
        threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
        for (uint i = tid; i < S; i += ntid) {
            ks[i] = k[((ulong) t * d.H_k + hk) * S + i];
            qs[i] = q[((ulong) t * d.H_k + hk) * S + i];
            tape_k[((ulong) t * H_v + h) * S + i] = ks[i];
        }
        const float gt = g[t * H_v + h];
        const float eg = exp(gt);
        const float bt = beta[t * H_v + h];
        if (tid == 0) tape_g[t * H_v + h] = gt;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint j = sg; j < S; j += n_sg) {
            device float * row = M + (ulong) j * S;
            float dd = 0.0f;
            for (uint i = lane; i < S; i += 32) dd += row[i] * ks[i];
            dd = simd_sum(dd);
            const float uj = bt * (v[((ulong) t * H_v + h) * S + j] - eg * dd);
            float od = 0.0f;
            for (uint i = lane; i < S; i += 32) {
                const float x = eg * row[i] + uj * ks[i];
                row[i] = x;
                od += x * qs[i];
            }
            od = simd_sum(od);
            if (lane == 0) {
                tape_u[((ulong) t * H_v + h) * S + j] = uj;
                o[((ulong) t * H_v + h) * S + j] = od * scale;
            }
        }
    }
}

// grid: (S*S, H_v) threads; closed form S_n = e^{G_n} S_0 + sum_t e^{G_n - G_t} k_t u_t^T.
kernel void gdn_tape_replay(device float * state        [[buffer(0)]],
                            device const float * tape_k [[buffer(1)]],
                            device const float * tape_u [[buffer(2)]],
                            device const float * tape_g [[buffer(3)]],
                            constant gdn_dims & d       [[buffer(4)]],
                            uint2 gid                   [[thread_position_in_grid]]) {
    const uint S = d.S, H_v = d.H_v, h = gid.y, x = gid.x;
    if (x >= S * S) return;
    const uint j = x / S, i = x % S;
    float G = 0.0f;
    for (uint t = 0; t < d.n; ++t) G += tape_g[t * H_v + h];
    device float * s = state + (ulong) h * S * S + x;
    float acc = *s * exp(G);
    float Gt = 0.0f;
    for (uint t = 0; t < d.n; ++t) {
        Gt += tape_g[t * H_v + h];
        const ulong off = ((ulong) t * H_v + h) * S;
        acc += exp(G - Gt) * tape_u[off + j] * tape_k[off + i];
    }
    *s = acc;
}
