"""Both engines as an AVX2-only CPU runs them, on this machine: bench/ar_decode.py in a venv whose
ggml is built without AVX-512 / AVX-VNNI / AMX, with the package's own kernels capped at AVX2
(DFLASH_NATIVE_ISA=avx2). Issue 16's speed goals must hold on an AVX2-only CPU too; one is not
always at hand, and a -march=native ggml (the dev env's) would use AVX-512 here.

The venv, under ~/.cache/dflash-native-bench/venv-avx2 (made once, reused while its stamp matches):

1. llama-cpp-python==0.3.36 from source with AVX2_CMAKE_ARGS (GGML_NATIVE=OFF, AVX AVX2 FMA F16C
   BMI2 on; AVX-512*, AVX-VNNI, AMX off). No torch.
2. This checkout, `pip install --no-build-isolation` against that ggml, DFLASH_NATIVE_BUNDLE_GGML=OFF:
   _core then loads the very libggml files llama_cpp loads (its rpath points beside llama_cpp).
3. A check: llama.cpp's system info names no AVX512 / AVX_VNNI / AMX feature, and libggml-cpu holds
   no instruction on zmm registers (objdump; skipped when objdump is missing).

Then it runs bench/ar_decode.py in that venv with DFLASH_NATIVE_ISA=avx2 (its JSON lines say
"ISA avx2 (capped)" in `machine`). The GGUF files come from the benchmarks' cache; any missing one
is made first by this interpreter (the converter needs torch, the venv has none). Arguments after
`--` go to ar_decode.py:

    python bench/isa_env.py -- --threads 2 --outtypes f16,q8_0,q4_k_m --json bench/results/ar_decode_avx2.jsonl
    python bench/isa_env.py --setup-only   # build / check the venv only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # = [build-system].requires
# ggml's x86 options (ggml/CMakeLists.txt of that release): an AVX2-only (x86-64-v3) CPU
AVX2_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                   "-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF "
                   "-DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
                   "-DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF")
# what our build needs in the venv besides llama-cpp-python (no build isolation: see main's doc)
BUILD_REQUIRES = ["scikit-build-core>=0.10", "pybind11>=2.13", "cmake>=3.21", "ninja>=1.10"]
CACHE = Path(os.environ.get("DFLASH_BENCH_CACHE", Path.home() / ".cache" / "dflash-native-bench"))
# llama.cpp's system-info names of features an AVX2-only CPU lacks
NOT_AVX2 = ("AVX512", "AVX_VNNI", "AMX")


def run(cmd, **kw) -> None:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def clean_env(**extra) -> dict:
    """The environment for the venv's processes: no PYTHONPATH (the dev tree's package), no outer venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DFLASH_NATIVE_ISA")}
    env.update(extra)
    return env


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tree_dirty() -> bool:
    try:
        return bool(subprocess.check_output(["git", "-C", ROOT, "status", "--porcelain", "--", "csrc", "python",
                                             "CMakeLists.txt", "pyproject.toml"], text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        return True


def ensure_llama(venv: Path) -> None:
    """Step 1: the venv and its AVX2-only llama-cpp-python (rebuilt when the stamp differs)."""
    py = venv / "bin" / "python"
    stamp = venv / "dfn-llama-stamp.json"
    want = {"llama": LLAMA_CPP_PYTHON, "cmake_args": AVX2_CMAKE_ARGS}
    if py.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
        return
    if not py.exists():
        run([sys.executable, "-m", "venv", venv])
    print(f"[isa_env] building {LLAMA_CPP_PYTHON} for AVX2 only (once; 10+ minutes on 2 cores)", flush=True)
    # --no-binary: never a prebuilt (native) wheel; --no-cache-dir: nor pip's cached native build
    run([py, "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python", LLAMA_CPP_PYTHON,
         *BUILD_REQUIRES], env=clean_env(CMAKE_ARGS=AVX2_CMAKE_ARGS))
    stamp.write_text(json.dumps(want))


def ensure_package(venv: Path, rebuild: bool) -> None:
    """Step 2: this checkout built against the venv's ggml (rebuilt when the commit differs, the
    tree has local changes, or rebuild)."""
    py = venv / "bin" / "python"
    stamp = venv / "dfn-package-stamp.json"
    want = {"root": str(ROOT), "rev": git_rev()}
    if not rebuild and not tree_dirty() and stamp.exists() and json.loads(stamp.read_text()) == want:
        return
    # no build isolation: an isolated build would fetch and build llama-cpp-python natively again;
    # DFLASH_NATIVE_BUNDLE_GGML=OFF: _core loads the venv's libggml beside llama_cpp (one copy for both engines)
    # one CMake build folder per checkout (a CMake cache belongs to one source folder), kept: rebuilds are incremental
    build_dir = venv / f"dfn-build-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]}"
    run([py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--force-reinstall",
         "-C", f"build-dir={build_dir}", "-C", "cmake.define.DFLASH_NATIVE_BUNDLE_GGML=OFF", ROOT],
        env=clean_env())
    run([py, "-m", "pip", "install", "-q", "numpy>=1.24", "gguf>=0.17", "jinja2>=3.0"], env=clean_env())
    stamp.write_text(json.dumps(want))


PROBE = r"""
import json, llama_cpp
from dflash_native import _core
libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if any(n in l for n in ('libggml', 'libllama', 'libdflash'))})
print(json.dumps({'system_info': llama_cpp.llama_print_system_info().decode(), 'libs': libs,
                  'isa': _core.isa()}))
"""


def check(venv: Path) -> dict:
    """Step 3: the venv's ggml has no AVX-512 (nor AVX-VNNI, AMX); both engines load the same ggml;
    the own kernels run capped at AVX2."""
    out = subprocess.run([venv / "bin" / "python", "-c", PROBE], check=True, capture_output=True, text=True,
                         env=clean_env(DFLASH_NATIVE_ISA="avx2"), cwd="/").stdout
    facts = json.loads(out.strip().splitlines()[-1])
    info = facts["system_info"]
    print(f"[isa_env] llama.cpp system info: {info}", flush=True)
    on = [f for f in re.findall(r"(\w+) = 1", info) if f.startswith(NOT_AVX2)]
    if on:
        raise SystemExit(f"[isa_env] the venv's ggml uses {on}: not an AVX2-only build")
    if "AVX2 = 1" not in info:
        raise SystemExit("[isa_env] the venv's ggml has no AVX2 path")
    site = str(venv)
    if not facts["libs"] or not all(p.startswith(site) for p in facts["libs"]):
        raise SystemExit(f"[isa_env] ggml loaded from outside the venv: {facts['libs']}")
    cpu = next((p for p in facts["libs"] if "libggml-cpu" in p), None)
    objdump = shutil.which("objdump")
    if cpu and objdump:
        dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", cpu], check=True, capture_output=True,
                             text=True).stdout
        n_zmm = dis.count("%zmm")
        print(f"[isa_env] {Path(cpu).name}: {n_zmm} instructions on zmm registers (AVX-512)", flush=True)
        if n_zmm:
            raise SystemExit(f"[isa_env] {cpu} has AVX-512 code")
    if facts["isa"] != "avx2 (capped)":
        raise SystemExit(f"[isa_env] the own kernels report ISA {facts['isa']!r}, not 'avx2 (capped)'")
    print(f"[isa_env] ggml: {facts['libs']}; own kernels: {facts['isa']}", flush=True)
    return facts


def prepare_files(bench_args: list[str]) -> None:
    """Make ar_decode's cached GGUF files with this interpreter (torch for the converter), if missing."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--outtypes", default="f16,q8_0")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--moe", action="store_true")
    a, _ = ap.parse_known_args(bench_args)
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import CACHE as BENCH_CACHE, bench_target, cached_typed_gguf

    name, arch, shape = bench_target(a.moe, a.tiny)
    for t in a.outtypes.split(","):
        path = BENCH_CACHE / f"{name}-{t}-s0.gguf"  # _common.cached_gguf's name
        if not path.exists():
            try:
                import dflash_native  # noqa: F401
            except ImportError:
                sys.path.insert(0, str(ROOT / "python"))  # this checkout's dev build (tools/devbuild.sh)
            path = cached_typed_gguf(name, arch, t, **shape)
        print(f"[isa_env] {path}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=CACHE / "venv-avx2")
    ap.add_argument("--setup-only", action="store_true", help="build and check the venv, run no benchmark")
    ap.add_argument("--rebuild", action="store_true", help="reinstall this checkout into the venv")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench/ar_decode.py's arguments")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args

    a.venv.parent.mkdir(parents=True, exist_ok=True)
    ensure_llama(a.venv)
    ensure_package(a.venv, a.rebuild)
    check(a.venv)
    if a.setup_only:
        return 0
    prepare_files(bench_args)
    cmd = [a.venv / "bin" / "python", ROOT / "bench" / "ar_decode.py", *bench_args]
    print("$ DFLASH_NATIVE_ISA=avx2", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], env=clean_env(DFLASH_NATIVE_ISA="avx2"), cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
