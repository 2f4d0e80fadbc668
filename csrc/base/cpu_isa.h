// The instruction-set level the package's own CPU kernels run at: the CPU's best, capped by the
// DFLASH_NATIVE_ISA environment variable (read once, at the first use) or by set_isa_cap. Every
// runtime-dispatched kernel asks isa_in_use(): the matmul (matmul.cpp) and the DFN_MULTIVERSION
// kernels below (attention, conv, GDN tape, top-1, sampler). Their results are the same bits at
// every level (the kernels' contract); only speed differs. ggml's own kernels are not ours: their
// ISA is the one ggml was built for (bench/isa_env.py builds an AVX2-only one).
#pragma once

#include "base/common.h"

#include <string>

namespace dfn {

enum class isa_level { portable = 0, avx2 = 1, avx512 = 2 };

// The best level this CPU runs (AVX-512F; AVX2 + FMA + F16C; else portable).
isa_level isa_cpu_best();

// The level in use. A bad DFLASH_NATIVE_ISA never aborts here: the kernels then run the CPU's
// best, and isa_check (every engine's creation) raises it.
isa_level isa_in_use();

// Throws input_error when DFLASH_NATIVE_ISA names no level or one this CPU lacks.
void isa_check();

// True when the level was chosen by the user (a non-empty DFLASH_NATIVE_ISA, or set_isa with a
// name): every kernel then runs exactly that level, and no engine measures another one for its
// matmuls (dispatch.h).
bool isa_user_chosen();

// Cap the level at `name` ("avx512", "avx2", "portable"; "" the CPU's best, no cap), overriding
// DFLASH_NATIVE_ISA; throws input_error as isa_check does.
void set_isa_cap(const std::string & name);

// Tests: treat the CPU as one whose best level is `name` ("" undoes it), for the checks above
// (a level the CPU lacks) on a CPU that has them all. Call before the first kernel or engine.
void testing_pretend_cpu_best(const std::string & name);

// "avx512f", "avx2" or "portable"
const char * isa_level_name(isa_level level);

// The level in use for stats and benchmark lines: its name, with " (capped)" when it is below
// the CPU's best ("avx2 (capped)" on an AVX-512 machine under DFLASH_NATIVE_ISA=avx2).
std::string isa_description();

}  // namespace dfn

// GCC on x86-64: where the CPU kernels pick AVX-512 / AVX2 / baseline code at run time (the
// package is built once for every x86-64 machine, so -march=native is not an option).
//
//   DFN_MULTIVERSION(float, max_of, (const float * l, int64_t n), (l, n)) { ...body... }
//
// defines max_of(l, n), which calls the body compiled for AVX-512F, for Haswell's extensions (AVX2,
// FMA, F16C, BMI2) or for the baseline, by isa_in_use(). The body is one always-inline function
// each clone inlines (and vectorises for its own ISA); args names the parameters in order. (Not
// target("arch=haswell"): GCC inlines nothing across a change of arch.)
#if DFN_X86_GCC
#define DFN_TARGET_AVX2 "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe"
#define DFN_MULTIVERSION(ret, name, params, args)                                                              \
    static inline __attribute__((always_inline)) ret name##_body params;                                       \
    __attribute__((target("avx512f"), noinline)) static ret name##_avx512 params { return name##_body args; } \
    __attribute__((target(DFN_TARGET_AVX2), noinline)) static ret name##_avx2 params { return name##_body args; } \
    __attribute__((noinline)) static ret name##_base params { return name##_body args; }                      \
    ret name params {                                                                                          \
        switch (::dfn::isa_in_use()) {                                                                         \
            case ::dfn::isa_level::avx512: return name##_avx512 args;                                          \
            case ::dfn::isa_level::avx2: return name##_avx2 args;                                              \
            default: return name##_base args;                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    static inline __attribute__((always_inline)) ret name##_body params
#else
#define DFN_MULTIVERSION(ret, name, params, args) ret name params
#endif
