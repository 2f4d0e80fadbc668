#!/usr/bin/env bash
# On a GPU machine (x86-64, CUDA 13, Python 3.12 with torch, no network): installs what
# bench/gpu/build.sh built here (llama-cpp-python with ggml-cuda for sm_90 + RPC, the gguf wheel),
# builds dflash-native against it (16 cores: about a minute), runs the device tests on CUDA0 and
# bench/device.py on a Qwen3.5-4B-shaped random target. Two stages, so that each fits one call of a
# lent machine (the models are made in the background from the first stage on):
#
#   bash bench/gpu/run.sh setup    # install, build, start making the bench models, device tests
#   bash bench/gpu/run.sh bench    # wait for the models, bench/device.py (Q4_K_M, then Q8_0)
#
# Logs and JSON lines go to $OUT (the device tool's folder) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
site=/tmp/dfn-site
export PYTHONPATH="$site" CMAKE_PREFIX_PATH="$site" PYTHONUNBUFFERED=1 DFLASH_BENCH_CACHE=/tmp/dfn-bench-cache
# cuBLAS / the CUDA runtime for ggml-cuda: the toolkit's, else the NVIDIA wheels beside torch
for d in /usr/local/cuda/lib64 $(python3 -c "import nvidia, os; print(' '.join(os.path.join(p, 'cu13', 'lib') for p in nvidia.__path__))" 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
t0=$SECONDS
say() { echo "[run.sh +$((SECONDS - t0))s] $*"; }

models() {  # the bench's models, made once (cached under DFLASH_BENCH_CACHE)
    python3 - <<'EOF'
import sys
sys.path.insert(0, "bench")
import device
for t in ("q4_k_m", "q8_0"):
    device.bench_models("4b", t, 16)
print("models ready")
EOF
}

case "${1:-setup}" in
setup)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    say "install llama-cpp-python (CUDA) and gguf"
    mkdir -p "$site" && tar -xJf bench/gpu/out/llama-cuda.tar.xz -C "$site" || exit 1
    # the links a wheel install would have made: libX.so and libX.so.0 to libX.so.0.M.m, and lib/ for
    # ggml's CMake package
    (cd "$site/llama_cpp/lib" && for f in *.so.*.*.*; do b="${f%%.so.*}"; m="${f#*.so.}"; \
        ln -sf "$f" "$b.so.${m%%.*}"; ln -sf "$f" "$b.so"; done)
    for f in "$site"/llama_cpp/lib/*.so*; do ln -sf "$f" "$site/lib/$(basename "$f")"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" bench/gpu/out/*.whl || exit 1
    say "build dflash-native"
    CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$site" CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-index --no-deps \
        --no-build-isolation --target "$site" \
        --upgrade . > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
    python3 -c "import dflash_native as dn; print(dn.devices())" | tee "$out/devices.txt"
    say "making the bench models in the background (log: /tmp/dfn-models.log)"
    setsid bash -c "$(declare -f models); models; echo done > /tmp/dfn-models.done" > /tmp/dfn-models.log 2>&1 < /dev/null &
    say "device tests on CUDA0"
    (cd tests && DFLASH_NATIVE_TEST_DEVICE=CUDA0 timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
        test_device.py 2>&1) | tee "$out/tests.log" | tail -15
    say "setup done"
    ;;
bench)
    say "waiting for the models (at most 200 s; else the 0.5B shape)"
    model=4b
    for _ in $(seq 100); do [ -e /tmp/dfn-models.done ] && break; sleep 2; done
    [ -e /tmp/dfn-models.done ] || model=0.5b
    cp /tmp/dfn-models.log "$out/models.log"; tail -3 "$out/models.log"
    for t in q4_k_m q8_0; do
        say "bench/device.py $model $t"
        timeout 300 python3 bench/device.py --device CUDA0 --model $model --outtypes "$t" --threads 16 --reps 3 \
            --gen 64 --json "$out/device.jsonl" 2>&1 | tee -a "$out/bench.log"
    done
    say "bench done"
    ;;
esac
