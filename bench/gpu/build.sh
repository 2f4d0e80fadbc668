#!/usr/bin/env bash
# Builds, on this (CPU-only) machine, what a GPU machine needs to run dflash-native's device path:
# llama-cpp-python 0.3.36 (ggml with CUDA for sm_90 + RPC, and llama.cpp as the peer) as a wheel,
# and the llama-cpp-python sdist's CMake prefix for building dflash-native there. nvcc comes from
# the system or from NVIDIA's pip wheels; cuBLAS (headers + library, needed to compile ggml-cuda)
# from the nvidia-cublas wheel. Output: bench/gpu/out/ (ignored), carried by bench/gpu/run.sh.
#
#   bash bench/gpu/build.sh            # ~1 hour on 2 cores (ggml-cuda's ~190 CUDA files)
#
# The GPU machine (Python 3.12, CUDA 13, no network) then runs `bash bench/gpu/run.sh` (see there).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/out"
work="${DFN_GPU_WORK:-/tmp/dfn-gpu-build}"
arch="${DFN_CUDA_ARCH:-90}"            # H100 / H200
mkdir -p "$out" "$work"

nvcc_bin="$(command -v nvcc || true)"
if [ -z "$nvcc_bin" ]; then
    python -m pip install -q --target "$work/nvcc" "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
    nvcc_bin="$(ls "$work"/nvcc/nvidia/cu13/bin/nvcc)"
fi
cuda_root="$(cd "$(dirname "$(readlink -f "$(sh -c "command -v $nvcc_bin" )")")/.." && pwd)"
# nvcc on PATH may be a wrapper script: find the toolkit it runs
if grep -q "exec " "$nvcc_bin" 2>/dev/null; then
    cuda_root="$(dirname "$(dirname "$(sed -n 's/^exec \([^ ]*\).*/\1/p' "$nvcc_bin")")")"
fi
echo "CUDA toolkit: $cuda_root"

# A toolkit root that also holds cuBLAS (FindCUDAToolkit looks for it beside the runtime)
tk="$work/toolkit"
if [ ! -e "$tk/.done" ]; then
    rm -rf "$tk" && mkdir -p "$tk/include" "$tk/lib"
    python -m pip install -q --no-deps --target "$work/cublas" "nvidia-cublas==13.0.*"
    cub="$(ls -d "$work"/cublas/nvidia/cu13)"
    for d in "$cuda_root"/*; do
        case "$(basename "$d")" in include|lib|lib64) ;; *) ln -s "$d" "$tk/";; esac
    done
    for f in "$cuda_root"/include/* "$cub"/include/*; do ln -sf "$f" "$tk/include/"; done
    for f in "$cuda_root"/lib/* "$cub"/lib/*; do ln -sf "$f" "$tk/lib/"; done
    ln -s lib "$tk/lib64"
    (cd "$tk/lib" && for f in libcublas.so.* libcublasLt.so.*; do ln -sf "$f" "${f%%.so.*}.so"; done)
    touch "$tk/.done"
fi
export CUDAToolkit_ROOT="$tk" CUDACXX="$tk/bin/nvcc" PATH="$tk/bin:$PATH"
# nvcc and CMake resolve the toolkit's own include directory: name cuBLAS's beside it
cub_inc="$(ls -d "$work"/cublas/nvidia/cu13/include)"

# ggml: CUDA (sm_$arch) + RPC + the CPU backend at x86-64-v3 (the GPU machine's CPU is unknown)
# (GGML_CUDA_NO_VMM: no libcuda to link here, only the toolkit from pip; ggml then uses its legacy pool.
#  GGML_CUDA_FA=OFF: ggml-cuda's ~80 flash-attention kernel instances compile empty, which halves the
#  build on 2 cores; the device graphs' attention is ggml_mul_mat + ggml_soft_max_ext there, and
#  llama.cpp, the peer, runs its own non-flash-attention path on the same build.)
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_RPC=on -DGGML_NATIVE=OFF \
-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_FA=OFF \
-DCUDAToolkit_ROOT=$tk -DCMAKE_CUDA_FLAGS=-I$cub_inc -DCMAKE_CXX_FLAGS=-I$cub_inc"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
rm -f "$out"/llama_cpp_python-*.whl
python -m pip wheel -v --no-deps --no-cache-dir -w "$out" llama-cpp-python==0.3.36 > "$work/wheel.log" 2>&1 \
    || { tail -40 "$work/wheel.log"; exit 1; }
# What travels to the GPU machine (64 MiB at most with the repository): the wheel's files once each.
# A wheel holds every library three times (libX.so, .so.0, .so.0.M.m: no symlinks in a zip) and the
# ggml libraries twice more under lib/ (for ggml's CMake package); the archive keeps llama_cpp/ with
# the versioned files only, stripped, and run.sh makes the links again.
w="$(ls "$out"/llama_cpp_python-*.whl)"
rm -rf "$work/unpacked" && mkdir -p "$work/unpacked" && (cd "$work/unpacked" && python -m zipfile -e "$w" .)
(cd "$work/unpacked" && rm -f lib/*.so* && find llama_cpp/lib -name "*.so*" ! -name "*.so.*.*" -delete \
    && strip --strip-unneeded llama_cpp/lib/*.so.* \
    && tar -cf - llama_cpp include lib llama_cpp_python-*.dist-info | xz -T0 -9 > "$out/llama-cuda.tar.xz")
rm -f "$w"
echo "built $out/llama-cuda.tar.xz ($(du -h "$out/llama-cuda.tar.xz" | cut -f1))"
# the gguf package dflash-native needs at run time (absent on the GPU image), as a wheel
python -m pip download -q --no-deps --only-binary=:all: -d "$out" "gguf>=0.17"
ls -la "$out"
