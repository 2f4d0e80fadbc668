// CUDA versions of the GDN tape kernels (csrc/gdn_tape.cpp is the reference they are tested against).
// All pointers are device pointers; layouts as in gdn_tape.h.
#pragma once

#include "../gdn_tape.h"

#include <cstdint>

namespace dfn::cuda {

bool available();  // a CUDA device is usable from this build

// Same contract as dfn::gdn_tape_record for all value heads. `scratch`: S*S*H_v floats of
// device memory for the working state (state0 stays untouched).
void gdn_tape_record(const gdn_inputs & in, const float * state0, float * scratch, float * o, gdn_tape_view tape,
                     int64_t S, int64_t H_k, int64_t H_v, int64_t T, void * stream);

// Same contract as dfn::gdn_tape_replay for all value heads, in place on device memory.
void gdn_tape_replay(float * state, const gdn_tape_view & tape, int64_t S, int64_t H_v, int64_t n, void * stream);

}  // namespace dfn::cuda

namespace dfn::cuda {

// Host-memory wrappers for tests and benchmarks: copy in, run the kernel, copy out.
// Inputs are contiguous: q, k [T, H_k, S]; v [T, H_v, S]; g, beta [T, H_v]; state [H_v, S, S].
void gdn_tape_record_host(const float * q, const float * k, const float * v, const float * g, const float * beta,
                          const float * state0, float * o, float * tape_k, float * tape_u, float * tape_g,
                          int64_t S, int64_t H_k, int64_t H_v, int64_t T);
void gdn_tape_replay_host(float * state, const float * tape_k, const float * tape_u, const float * tape_g,
                          int64_t S, int64_t H_v, int64_t T, int64_t n);

}  // namespace dfn::cuda
