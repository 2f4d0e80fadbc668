// CUDA GDN tape kernels: record (one block per value head, one warp per state row at a time)
// and closed-form replay (one thread per state element). See csrc/gdn_tape.h for the math.
#include "gdn_tape_cuda.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace dfn::cuda {

namespace {

constexpr int WARP = 32;

void check(cudaError_t e, const char * what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("[cuda] ") + what + ": " + cudaGetErrorString(e));
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = WARP / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// grid: H_v blocks; block: n_warps warps. Row j of the head's state (column j of S) is handled by
// warp j % n_warps; lanes stride over its S elements.
__global__ void record_kernel(gdn_inputs in, const float * __restrict__ state0, float * __restrict__ work,
                              float * __restrict__ o, gdn_tape_view tape, int S, int H_k, int H_v, int T) {
    extern __shared__ float sh[];  // k[S], q[S]
    float * ks = sh;
    float * qs = sh + S;
    const int h = blockIdx.x, hk = h % H_k;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    float * M = work + (size_t) h * S * S;
    for (int x = threadIdx.x; x < S * S; x += blockDim.x) M[x] = state0[(size_t) h * S * S + x];
    const float scale = rsqrtf((float) S);

    for (int t = 0; t < T; ++t) {
        __syncthreads();  // the previous token's rows are done with ks / qs
        const float * k = in.k + hk * in.k_s1 + (int64_t) t * in.k_s2;
        const float * q = in.q + hk * in.q_s1 + (int64_t) t * in.q_s2;
        float * tk = tape.k + (size_t) S * (h + (size_t) H_v * t);
        for (int i = threadIdx.x; i < S; i += blockDim.x) {
            ks[i] = k[i];
            qs[i] = q[i];
            tk[i] = k[i];
        }
        const float gt = in.g[h + (int64_t) t * in.g_s1];
        const float eg = __expf(gt);
        const float bt = in.beta[h + (int64_t) t * in.b_s1];
        if (threadIdx.x == 0) tape.g[h + H_v * t] = gt;
        __syncthreads();

        const float * v = in.v + h * in.v_s1 + (int64_t) t * in.v_s2;
        float * u = tape.u + (size_t) S * (h + (size_t) H_v * t);
        float * ot = o + (size_t) S * (h + (size_t) H_v * t);
        for (int j = warp; j < S; j += n_warps) {
            float * row = M + (size_t) j * S;
            float d = 0.0f;
            for (int i = lane; i < S; i += WARP) d += row[i] * ks[i];
            d = warp_sum(d);
            const float uj = bt * (v[j] - eg * d);
            float od = 0.0f;
            for (int i = lane; i < S; i += WARP) {
                const float x = eg * row[i] + uj * ks[i];
                row[i] = x;
                od += x * qs[i];
            }
            od = warp_sum(od);
            if (lane == 0) {
                u[j] = uj;
                ot[j] = od * scale;
            }
        }
    }
}

// grid: (ceil(S*S / blockDim), H_v); coef_t = exp(G_n - G_t) computed once per block.
__global__ void replay_kernel(float * __restrict__ state, gdn_tape_view tape, int S, int H_v, int n) {
    extern __shared__ float coef[];  // [n + 1]: coef_0 .. coef_{n-1}, exp(G_n)
    const int h = blockIdx.y;
    if (threadIdx.x == 0) {
        double G = 0.0;
        for (int t = 0; t < n; ++t) G += tape.g[h + H_v * t];
        double Gt = 0.0;
        for (int t = 0; t < n; ++t) {
            Gt += tape.g[h + H_v * t];
            coef[t] = (float) exp(G - Gt);
        }
        coef[n] = (float) exp(G);
    }
    __syncthreads();
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= S * S) return;
    const int j = x / S, i = x % S;
    float * s = state + (size_t) h * S * S + x;
    float acc = *s * coef[n];
    for (int t = 0; t < n; ++t) {
        const size_t off = (size_t) S * (h + (size_t) H_v * t);
        acc += coef[t] * tape.u[off + j] * tape.k[off + i];
    }
    *s = acc;
}

}  // namespace

bool available() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void gdn_tape_record(const gdn_inputs & in, const float * state0, float * scratch, float * o, gdn_tape_view tape,
                     int64_t S, int64_t H_k, int64_t H_v, int64_t T, void * stream) {
    if (T <= 0) return;
    const int threads = 128;
    record_kernel<<<(unsigned) H_v, threads, 2 * S * sizeof(float), (cudaStream_t) stream>>>(
        in, state0, scratch, o, tape, (int) S, (int) H_k, (int) H_v, (int) T);
    check(cudaGetLastError(), "gdn_tape_record launch");
}

void gdn_tape_replay(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n, void * stream) {
    if (n <= 0) return;
    const int threads = 256;
    const dim3 grid((unsigned) ((S * S + threads - 1) / threads), (unsigned) H_v);
    replay_kernel<<<grid, threads, (n + 1) * sizeof(float), (cudaStream_t) stream>>>(state, tape, (int) S, (int) H_v, (int) n);
    check(cudaGetLastError(), "gdn_tape_replay launch");
}

namespace {

struct dev_buf {
    float * p = nullptr;
    explicit dev_buf(size_t n) { check(cudaMalloc(&p, n * sizeof(float)), "cudaMalloc"); }
    dev_buf(const float * src, size_t n) : dev_buf(n) {
        check(cudaMemcpy(p, src, n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    }
    ~dev_buf() { cudaFree(p); }
    void to_host(float * dst, size_t n) const {
        check(cudaMemcpy(dst, p, n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    }
};

}  // namespace

void gdn_tape_record_host(const float * q, const float * k, const float * v, const float * g, const float * beta,
                          const float * state0, float * o, float * tape_k, float * tape_u, float * tape_g,
                          int64_t S, int64_t H_k, int64_t H_v, int64_t T) {
    const size_t nq = (size_t) T * H_k * S, nv = (size_t) T * H_v * S, ng = (size_t) T * H_v, ns = (size_t) H_v * S * S;
    dev_buf dq(q, nq), dk(k, nq), dv(v, nv), dg(g, ng), db(beta, ng), ds(state0, ns);
    dev_buf work(ns), dout(nv), dtk(nv), dtu(nv), dtg(ng);
    gdn_inputs in{dq.p, S, S * H_k, dk.p, S, S * H_k, dv.p, S, S * H_v, dg.p, H_v, db.p, H_v};
    gdn_tape_record(in, ds.p, work.p, dout.p, {dtk.p, dtu.p, dtg.p}, S, H_k, H_v, T, nullptr);
    check(cudaDeviceSynchronize(), "gdn_tape_record");
    dout.to_host(o, nv);
    dtk.to_host(tape_k, nv);
    dtu.to_host(tape_u, nv);
    dtg.to_host(tape_g, ng);
}

void gdn_tape_replay_host(float * state, const float * tape_k, const float * tape_u, const float * tape_g,
                          int64_t S, int64_t H_v, int64_t T, int64_t n) {
    const size_t nt = (size_t) T * H_v * S, ns = (size_t) H_v * S * S;
    dev_buf ds(state, ns), dk(tape_k, nt), du(tape_u, nt), dg(tape_g, (size_t) T * H_v);
    gdn_tape_replay(ds.p, {dk.p, du.p, dg.p}, S, H_v, n, nullptr);
    check(cudaDeviceSynchronize(), "gdn_tape_replay");
    ds.to_host(state, ns);
}

}  // namespace dfn::cuda
