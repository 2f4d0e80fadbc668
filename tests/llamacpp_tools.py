"""llama.cpp's own converter, as pip fetches it: the llama-cpp-python sdist's
vendor/llama.cpp/convert_hf_to_gguf.py with its `conversion` package and its matching gguf-py.

- `llamacpp_source(cache_dir)` downloads the sdist (`pip download --no-binary llama-cpp-python`:
  pip's cache makes a second download cheap) and extracts only the converter, `conversion/` and
  gguf-py. `DFLASH_LLAMACPP_SRC` may name an already-extracted tree instead (the sdist root or its
  vendor/llama.cpp).
- `llamacpp_tree(cache_dir)`: the sdist's whole vendor/llama.cpp tree (what cmake builds llama.cpp's
  tools from: bench/_llamacpp_server.py), extracted once; `DFLASH_LLAMACPP_SRC` may name it instead.
- `convert_with_llamacpp(src, jobs)` runs the converter in one child process (imports once, one
  forked child per job) with PYTHONPATH on the sdist's gguf-py: the converter's gguf-py is not the
  installed `gguf` the package and the tests use, and must not replace it in this process.

`python tests/llamacpp_tools.py fetch DIR` extracts into DIR and prints the converter's directory
(CI fetches it once, before the tests). `python tests/llamacpp_tools.py convert SRC JOBS.json` is
the child process itself.

The one thing the child changes in llama.cpp's converter: its BPE pre-tokenizer lookup
(`TextModel.get_vocab_base_pre`) identifies a tokenizer by the hash of its output on a fixed text
and refuses hashes of tokenizers it does not list. The tests' tokenizer is learned from a fixture
corpus, so no hash can list it; when the lookup refuses, the job's `tokenizer_pre` (the name our
converter derives from the tokenizer's regex, e.g. "qwen2") is used. Everything else is llama.cpp's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
ENV_SRC = "DFLASH_LLAMACPP_SRC"
_SDIST_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")


def plain_cpu_kernels() -> bool:
    """Make llama-cpp-python load every model without ggml's extra buffer types (weights repacked
    for AMX / the CPU's wider kernels): llama.cpp's plain CPU kernels. On a CPU with AMX,
    llama-cpp-python 0.3.36's extra buffer types segfault on Q8_0 hybrid files (qwen35, qwen35moe,
    qwen3next; measured 2026-11-23), as on batched Q4_0 / Q4_K_M matmuls and the tiny quantized
    drafters (SIGSEGV, SIGILL), and round F16 matmuls differently from ggml_mul_mat (1.7e-2 on the
    MoE parity models, 1.3e-3 without them). Patches the binding's own name (what llama_cpp.Llama
    calls) and the package's re-export (the C-API loads); idempotent. False without llama_cpp."""
    try:
        import llama_cpp
        import llama_cpp.llama as llama_module
    except ImportError:
        return False
    low = llama_module.llama_cpp
    default = low.llama_model_default_params
    if getattr(default, "_dflash_plain", False):
        return True

    def plain_params():
        p = default()
        p.use_extra_bufts = False
        return p

    plain_params._dflash_plain = True
    low.llama_model_default_params = plain_params
    llama_cpp.llama_model_default_params = plain_params
    return True


# The weight types llama.cpp's CPU_REPACK buffer repacks on x86 (ggml-cpu/repack.cpp,
# ggml_repack_get_optimal_repack_type, llama-cpp-python 0.3.36): with AVX2, Q4_0, Q4_K, IQ4_NL and
# MXFP4; with AVX-512 also Q2_K; each for a 2-D matrix whose rows are a multiple of 8. (Q5_K, Q6_K
# and Q8_0 repack on ARM only.)
_REPACK_X86 = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}
_REPACK_X86_AVX512 = {"Q2_K"}
_repack = {"overrides": None, "keep": []}


def clear_repack() -> None:
    """Undo repack_without_amx's overrides for the next loads (its patched defaults then load
    without extra buffer types, as plain_cpu_kernels does)."""
    _repack["overrides"] = None
    _repack["keep"] = []


def _cpu_repack_buft():
    """ggml's CPU_REPACK buffer type in llama-cpp-python's ggml (through the CPU backend registry's
    ggml_backend_dev_get_extra_bufts), or None."""
    import ctypes

    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    g = ctypes.CDLL(str(lib / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
    gb = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    vp = ctypes.c_void_p
    g.ggml_backend_dev_by_type.restype, g.ggml_backend_dev_by_type.argtypes = vp, [ctypes.c_int]
    g.ggml_backend_dev_backend_reg.restype, g.ggml_backend_dev_backend_reg.argtypes = vp, [vp]
    g.ggml_backend_reg_get_proc_address.restype = vp
    g.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    gb.ggml_backend_buft_name.restype, gb.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [vp]
    dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    fn = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not dev or not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(fn)(dev)
    i = 0
    while bufts and bufts[i]:
        if gb.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


def repack_without_amx(gguf_path: str | os.PathLike[str]) -> int:
    """Make the next llama_cpp.Llama load `gguf_path` as llama.cpp runs it on an x86 CPU without
    AMX (AMD Zen 4, most Intel parts): the matrices its CPU_REPACK buffer takes repacked for its
    GEMV / GEMM kernels, everything else in plain CPU buffers. On this AMX machine llama.cpp would
    put them in its AMX buffer, which crashes (plain_cpu_kernels); so extra buffer types are off
    and each repackable matrix is named in tensor_buft_overrides (llama.cpp's --override-tensor).
    The token embedding stays plain (a row lookup, which a repacked buffer cannot serve). Returns
    how many matrices were repacked (0: nothing repackable, or no CPU_REPACK in this ggml)."""
    import ctypes

    import gguf
    import llama_cpp.llama as llama_module

    import llama_cpp.llama_cpp as L

    # ggml's ggml_cpu_has_avx512() (this build's, not the CPU's flags) decides Q2_K
    avx512 = "AVX512 = 1" in L.llama_print_system_info().decode(errors="replace")
    kinds = _REPACK_X86 | (_REPACK_X86_AVX512 if avx512 else set())
    names = [t.name for t in gguf.GGUFReader(str(gguf_path)).tensors
             if t.tensor_type.name in kinds and len(t.shape) == 2 and int(t.shape[1]) % 8 == 0
             and t.name != "token_embd.weight"]
    buft = _cpu_repack_buft() if names else None

    class Override(ctypes.Structure):  # llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    arr = (Override * (len(names) + 1 if buft else 1))()  # the last {NULL, NULL} ends the list
    pats = [("^" + re.escape(n) + "$").encode() for n in (names if buft else [])]
    for i, pat in enumerate(pats):
        arr[i].pattern, arr[i].buft = pat, buft
    _repack["keep"] = [pats, arr]  # alive while llama.cpp may read them (the next load)
    _repack["overrides"] = arr
    low = llama_module.llama_cpp
    if not getattr(low.llama_model_default_params, "_dflash_repack", False):
        default = getattr(low.llama_model_default_params, "_dflash_default", low.llama_model_default_params)

        def repack_params():
            p = default()
            p.use_extra_bufts = False
            if _repack["overrides"] is not None:
                p.tensor_buft_overrides = ctypes.cast(_repack["overrides"], ctypes.c_void_p)
            return p

        repack_params._dflash_repack = True
        repack_params._dflash_default = default
        low.llama_model_default_params = repack_params
        import llama_cpp

        llama_cpp.llama_model_default_params = repack_params
    return len(names) if buft else 0


def _converter_dir(root: Path) -> Path | None:
    for d in (root, root / "vendor" / "llama.cpp", root / _SDIST_PREFIX):
        if (d / "convert_hf_to_gguf.py").is_file() and (d / "gguf-py" / "gguf").is_dir():
            return d
    return None


def llamacpp_source(cache_dir: str | os.PathLike[str]) -> Path:
    """The directory holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ from the
    llama-cpp-python sdist: $DFLASH_LLAMACPP_SRC when set, else extracted under cache_dir (once)."""
    if os.environ.get(ENV_SRC):
        d = _converter_dir(Path(os.environ[ENV_SRC]))
        if d is None:
            raise FileNotFoundError(f"{ENV_SRC}={os.environ[ENV_SRC]} holds no convert_hf_to_gguf.py with gguf-py")
        return d
    cache = Path(cache_dir)
    d = _converter_dir(cache)
    if d is not None:
        return d
    _extract_sdist(cache, _MEMBERS)
    d = _converter_dir(cache)
    assert d is not None, f"the sdist of {LLAMA_CPP_PYTHON} has no {_SDIST_PREFIX}convert_hf_to_gguf.py"
    return d


def _extract_sdist(cache: Path, prefixes: tuple[str, ...]) -> None:
    """Download the llama-cpp-python sdist (pip's cache makes a second download cheap) and extract
    its vendor/llama.cpp members whose paths start with one of `prefixes` ("" : all) under cache."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # --no-binary for this one package only: ":all:" would also build its build dependencies
        # (cmake) from source to read the sdist's metadata
        subprocess.run([sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-deps",
                        "--no-binary", "llama-cpp-python", "-d", tmp, "-q"], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(_SDIST_PREFIX)
                       and m.name[len(_SDIST_PREFIX):].startswith(prefixes) and (m.isfile() or m.isdir())]
            tar.extractall(cache, members=members, filter="data")


def _full_tree(root: Path) -> Path | None:
    for d in (root, root / "vendor" / "llama.cpp", root / _SDIST_PREFIX):
        if (d / "CMakeLists.txt").is_file() and (d / "src" / "llama.cpp").is_file() and (d / "tools" / "server").is_dir():
            return d
    return None


def llamacpp_tree(cache_dir: str | os.PathLike[str]) -> Path:
    """llama.cpp's whole source tree (what cmake builds its tools from) as the llama-cpp-python
    sdist vendors it: $DFLASH_LLAMACPP_SRC when set (the sdist root or its vendor/llama.cpp), else
    the sdist's vendor/llama.cpp extracted under cache_dir (once)."""
    if os.environ.get(ENV_SRC):
        d = _full_tree(Path(os.environ[ENV_SRC]))
        if d is None:
            raise FileNotFoundError(f"{ENV_SRC}={os.environ[ENV_SRC]} is not llama.cpp's full source tree "
                                    "(no CMakeLists.txt, src/llama.cpp and tools/server)")
        return d
    cache = Path(cache_dir)
    d = _full_tree(cache)
    if d is None:
        _extract_sdist(cache, ("",))
        d = _full_tree(cache)
    assert d is not None, f"the sdist of {LLAMA_CPP_PYTHON} has no full {_SDIST_PREFIX} tree"
    return d


def convert_with_llamacpp(src: Path, jobs: Sequence[Mapping[str, Any]], *, timeout: float = 600) -> None:
    """Run llama.cpp's converter in `src` on each job: {"model": HF dir, "outfile": path,
    "outtype": "f32" | "f16" | ..., "args": [more CLI args], "tokenizer_pre": name}. Raises
    RuntimeError with the converter's output when a job fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), str(src)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([dict(j, model=str(j["model"]), outfile=str(j["outfile"])) for j in jobs], f)
    try:
        r = subprocess.run([sys.executable, __file__, "convert", str(src), f.name], env=env, capture_output=True,
                           text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed (exit {r.returncode}):\n{r.stderr[-6000:]}")


def _child(src: Path, jobs_file: Path) -> int:
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    import importlib.util

    import gguf
    assert Path(gguf.__file__).resolve().is_relative_to(src.resolve()), f"not the sdist's gguf-py: {gguf.__file__}"
    from conversion import base

    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", src / "convert_hf_to_gguf.py")
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    lookup = base.TextModel.get_vocab_base_pre
    failed = 0
    for job in json.loads(jobs_file.read_text()):
        def pre(self, tokenizer, _pre=job.get("tokenizer_pre")):
            try:
                return lookup(self, tokenizer)
            except NotImplementedError:
                if _pre is None:
                    raise
                return _pre

        log = Path(job["outfile"] + ".log")
        pid = os.fork()  # one job per child: the converter keeps state on its model classes
        if pid == 0:
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                base.TextModel.get_vocab_base_pre = pre
                sys.argv = ["convert_hf_to_gguf.py", job["model"], "--outfile", job["outfile"],
                            "--outtype", job["outtype"], *job.get("args", [])]
                converter.main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"job failed: {job}\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
            failed += 1
        log.unlink(missing_ok=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "fetch":
        os.environ.pop(ENV_SRC, None)  # fetch into DIR
        print(llamacpp_source(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "convert":
        sys.exit(_child(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit("usage: llamacpp_tools.py fetch DIR | convert SRC JOBS.json")
