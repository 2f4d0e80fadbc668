"""Question: how big is the self-contained wheel, and how long do installing it into a fresh venv
and running `dflash-native demo` take? (Issue 19's goal: install + demo < 60 s on this machine;
wheel < 60 MB with the embedded default pair.)

Builds here what cibuildwheel builds in CI ([tool.cibuildwheel] in pyproject.toml), then measures:

1. ggml, portable: llama-cpp-python==0.3.36 built once as a wheel with ggml's portable CPU flags
   (the CMAKE_ARGS of [tool.cibuildwheel]: GGML_NATIVE=OFF; on x86-64 SSE4.2 AVX AVX2 FMA F16C BMI2,
   no AVX-512), cached in --llama-wheelhouse. A -march=native ggml would make a wheel that faults
   on other CPUs.
2. `pip wheel . --no-deps` against that ggml (offline: --no-index, the build requirements from the
   wheelhouse), then `auditwheel repair` (manylinux; the policy follows this machine's glibc).
3. A fresh venv, `pip install --only-binary :all: <repaired wheel>` (numpy, gguf, jinja2 and their
   dependencies as wheels from the index; no pip cache unless --pip-cache), then
   `dflash-native demo` from a directory outside the source tree, PYTHONPATH unset.

    python bench/wheel_install.py --json bench/results/wheel_install.jsonl
    python bench/wheel_install.py --wheel build/wheel/wheelhouse/dflash_native-*.whl  # a built wheel

Prints the steps and one JSON line (written with --json). Timings on a loaded machine are smoke
figures: the JSON line says `"load"` (1-minute load average at the start) so they can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # = [build-system].requires


def portable_cmake_args() -> str:
    """ggml's portable CPU flags for this machine's manylinux wheels: the CMAKE_ARGS of the
    `*-manylinux_<arch>` override in [tool.cibuildwheel] (pyproject.toml), one source for both.
    On x86-64: x86-64-v3 (AVX2 FMA F16C BMI2), what the wheel requires of the CPU; the package's own
    kernels (matmul.cpp) pick AVX-512 at run time where there is one."""
    import tomllib  # this script runs on Python >= 3.11 (the package itself on >= 3.10)

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["cibuildwheel"]
    for o in cfg.get("overrides", []):
        if o["select"] == f"*-manylinux_{platform.machine()}":
            return o["environment"]["CMAKE_ARGS"]
    raise SystemExit(f"no [[tool.cibuildwheel.overrides]] for *-manylinux_{platform.machine()} in pyproject.toml")


# scikit-build-core asks for cmake and ninja wheels when it finds none it can use
BUILD_REQUIRES = ["scikit-build-core>=0.10", "pybind11>=2.13", "cmake>=3.21", "ninja>=1.10"]
DEFAULT_WHEELHOUSE = Path.home() / ".cache" / "dflash-native-wheels"


def run(cmd: list[str], **kw) -> float:
    """Run a command (echoed), fail loudly, return its wall time in seconds."""
    print("$", " ".join(str(c) for c in cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run([str(c) for c in cmd], check=True, **kw)
    return time.perf_counter() - t0


def capture(cmd: list[str], **kw) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw).stdout


def portable_wheelhouse(house: Path) -> Path:
    """The wheelhouse with the portable llama-cpp-python wheel and the build requirements."""
    house.mkdir(parents=True, exist_ok=True)
    if not list(house.glob("llama_cpp_python-0.3.36-*.whl")):
        print(f"[wheel_install] building {LLAMA_CPP_PYTHON} with portable ggml (once; minutes)", flush=True)
        env = dict(os.environ, CMAKE_ARGS=portable_cmake_args())
        print(f"[wheel_install] CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
        # --no-cache-dir: pip's wheel cache may hold a -march=native build of the same version
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", house, LLAMA_CPP_PYTHON],
            env=env)
    # the build requirements and llama-cpp-python's own dependencies (numpy, jinja2, ...), as wheels
    (llama,) = house.glob("llama_cpp_python-0.3.36-*.whl")
    run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", house, llama, *BUILD_REQUIRES])
    return house


def build_wheel(house: Path, out: Path) -> Path:
    """pip wheel . against the portable ggml, then auditwheel repair; returns the repaired wheel."""
    dist, repaired = out / "dist", out / "wheelhouse"
    for d in (dist, repaired):
        shutil.rmtree(d, ignore_errors=True)
    # pip wheel from a bare venv, as cibuildwheel builds: CMake searches the interpreter's own
    # site-packages too (CMakeLists.txt), and one holding llama-cpp-python (a dev env) would shadow
    # the build-isolation environment's. Offline, from the wheelhouse only: the isolation
    # environment gets exactly the portable llama-cpp-python (an index or pip's cache could offer a
    # native build of 0.3.36).
    buildenv = out / "buildenv"
    if not (buildenv / "bin" / "python").exists():
        run([sys.executable, "-m", "venv", buildenv])
    run([buildenv / "bin" / "python", "-m", "pip", "wheel", ROOT, "--no-deps", "--no-index", "--find-links", house,
         "-w", dist], env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    (wheel,) = dist.glob("dflash_native-*.whl")
    auditwheel = shutil.which("auditwheel") or str(Path(sys.executable).parent / "auditwheel")
    run([auditwheel, "repair", "-w", repaired, wheel])
    (fixed,) = repaired.glob("dflash_native-*.whl")
    print(capture([auditwheel, "show", fixed]), flush=True)
    return fixed


def measure(wheel: Path, *, extras: str, pip_cache: bool, find_links: Path | None, demo_args: list[str]) -> dict:
    """Fresh venv, install the wheel (binary only), run the demo; wall times."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with tempfile.TemporaryDirectory(prefix="dfn-wheel-") as tmp:
        venv = Path(tmp) / "venv"
        venv_s = run([sys.executable, "-m", "venv", venv])
        py = venv / "bin" / "python"
        target = f"{wheel}[{extras}]" if extras else str(wheel)
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary", ":all:"]
        pip += ([] if pip_cache else ["--no-cache-dir"]) + (["--find-links", find_links] if find_links else [])
        install_s = run(pip + [target], env=env, cwd=tmp)
        demo_s = run([venv / "bin" / "dflash-native", "demo", *demo_args], env=env, cwd=tmp)
        # where the loaded ggml, libllama and the core came from (the wheel, not llama-cpp-python)
        probe = ("import dflash_native, importlib.util as u\n"
                 "from dflash_native import _core\n"
                 "libs = sorted({l.split()[-1] for l in open('/proc/self/maps')\n"
                 "               if any(n in l for n in ('libggml', 'libllama', 'libdflash_native', 'libgomp'))})\n"
                 "print(json.dumps({'isa': _core.testing.matmul_isa(), 'libs': libs,\n"
                 "                  'llama_cpp_installed': u.find_spec('llama_cpp') is not None}))\n")
        facts = json.loads(capture([py, "-c", "import json\n" + probe], env=env, cwd=tmp))
        n_packages = len(capture([py, "-m", "pip", "list", "--format", "freeze"], env=env, cwd=tmp).split())
    facts["libs"] = [p.split("site-packages/", 1)[-1] for p in facts["libs"]]
    return dict(venv_s=round(venv_s, 2), install_s=round(install_s, 2), demo_s=round(demo_s, 2),
                total_s=round(install_s + demo_s, 2), packages_installed=n_packages, **facts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, default=None, help="measure this repaired wheel (skip the build)")
    ap.add_argument("--llama-wheelhouse", type=Path, default=DEFAULT_WHEELHOUSE,
                    help="portable llama-cpp-python wheel + build requirements (built/downloaded once)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "wheel", help="dist/ and wheelhouse/ go here")
    ap.add_argument("--extras", default="", help="extras to install with the wheel, e.g. 'server'")
    ap.add_argument("--find-links", type=Path, default=None,
                    help="also install from this directory (wheels the index does not have)")
    ap.add_argument("--pip-cache", action="store_true", help="let pip use its cache (default: a cold install)")
    ap.add_argument("--demo-args", default="", help="extra arguments for `dflash-native demo` (default: none)")
    ap.add_argument("--json", type=Path, default=None, help="append the JSON line to this file")
    a = ap.parse_args()

    load = os.getloadavg()[0]
    build_s = None
    wheel = a.wheel
    if wheel is None:
        t0 = time.perf_counter()
        wheel = build_wheel(portable_wheelhouse(a.llama_wheelhouse), a.out)
        build_s = round(time.perf_counter() - t0, 1)
    m = measure(wheel.resolve(), extras=a.extras, pip_cache=a.pip_cache, find_links=a.find_links,
                demo_args=a.demo_args.split())
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    row = dict(bench="wheel_install", wheel=wheel.name, wheel_mb=round(wheel.stat().st_size / 2**20, 2),
               build_s=build_s, **m, extras=a.extras, find_links=str(a.find_links or ""), demo_args=a.demo_args,
               pip_cache=a.pip_cache, load=round(load, 2),
               smoke=load > 1.0, machine=f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
               python=platform.python_version(), rev=_git_rev())
    print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


def _git_rev() -> str:
    try:
        return capture(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
