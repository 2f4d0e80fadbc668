"""Quantize a GGUF with llama.cpp's own quantizer (`llama_model_quantize` in the llama-cpp-python
binding the package builds over): targets (qwen3, qwen35, ...) and DFlash drafters (arch `dflash`,
which llama.cpp's quantizer accepts like any arch it knows), so users need no second tool.

The file types are llama.cpp's `LLAMA_FTYPE_MOSTLY_*` (the names `llama-quantize` takes): a mix
such as Q4_K_M keeps some tensors in other types, and a tensor whose rows do not fit the type's
blocks (256 for the K- and IQ4_XS quants) falls back to another type, as llama.cpp decides.
1-D tensors (norms) stay F32. Every type it writes runs in the Engine through the package's own
batch-invariant matmul (docs/architecture.md, "Weight types").
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

# CLI / API name -> LLAMA_FTYPE_MOSTLY_* suffix (llama-quantize's names, lower case).
FTYPES = {
    "f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
    "q2_k": "MOSTLY_Q2_K", "q2_k_s": "MOSTLY_Q2_K_S", "q3_k_s": "MOSTLY_Q3_K_S", "q3_k_m": "MOSTLY_Q3_K_M",
    "q3_k_l": "MOSTLY_Q3_K_L", "q4_k_s": "MOSTLY_Q4_K_S", "q4_k_m": "MOSTLY_Q4_K_M", "q5_k_s": "MOSTLY_Q5_K_S",
    "q5_k_m": "MOSTLY_Q5_K_M", "q6_k": "MOSTLY_Q6_K", "iq4_nl": "MOSTLY_IQ4_NL", "iq4_xs": "MOSTLY_IQ4_XS",
}
# The plain K-quant names mean llama-quantize's default mix of that family.
ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}

_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s*(\S+)")


def quantize_types() -> list[str]:
    """The type names `quantize` takes."""
    return sorted(FTYPES) + sorted(ALIASES)


def _check_gguf(path: Path, what: str) -> None:
    if not path.is_file():
        raise ValueError(f"[quantize] {what} '{path}' does not exist or is not a file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"[quantize] {what} '{path}' is not a GGUF file (bad magic)")


def quantize(src: str | os.PathLike, dst: str | os.PathLike, type: str = "q4_k_m", *, n_threads: int | None = None,
             progress: bool = True) -> Path:
    """Write `src` (a GGUF target or DFlash drafter, usually F32 / F16 / BF16) to `dst` quantized to
    `type` (see `quantize_types()`, e.g. "q4_k_m", "q8_0", "iq4_xs") by llama.cpp's quantizer.
    progress: a per-tensor progress bar on stderr. Returns dst. Bad arguments, a missing or
    non-GGUF source, or a failure inside llama.cpp (its last error lines quoted) raise ValueError.
    Needs the [llama] extra (llama-cpp-python); without it, ImportError saying so."""
    try:
        import llama_cpp
    except ImportError as e:  # an optional extra: the wheels carry no llama-cpp-python (issue 19)
        raise ImportError(f"[quantize] quantizing uses llama.cpp's quantizer from llama-cpp-python, which is not "
                          f"installed: pip install 'dflash-native[llama]' ({e})") from None

    name = str(type).strip().lower()
    name = ALIASES.get(name, name)
    if name not in FTYPES:
        raise ValueError(f"[quantize] unknown type '{type}'; one of: {', '.join(quantize_types())}")
    src, dst = Path(src), Path(dst)
    _check_gguf(src, "source")
    if dst.resolve() == src.resolve():
        raise ValueError(f"[quantize] destination '{dst}' is the source file")
    if not dst.parent.is_dir():
        raise ValueError(f"[quantize] destination directory '{dst.parent}' does not exist")
    if n_threads is not None and (not isinstance(n_threads, int) or isinstance(n_threads, bool) or n_threads < 1):
        raise ValueError(f"[quantize] n_threads must be a positive int, got {n_threads!r}")

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{FTYPES[name]}")
    params.nthread = n_threads or os.cpu_count() or 1
    errors: list[str] = []

    # llama.cpp reports through its log callback only: one "[ i/ n] tensor ..." line per tensor,
    # and its errors. Listen while it runs, then give the binding its own callback back.
    @llama_cpp.llama_log_callback
    def on_log(level, text, _user):
        line = text.decode("utf-8", "replace")
        m = _PROGRESS.match(line)
        if m and progress:
            i, n = int(m.group(1)), int(m.group(2))
            bar = "#" * (30 * i // n)
            sys.stderr.write(f"\r[dflash-native quantize] {name} [{bar:<30}] {i}/{n} {m.group(3)[:40]:<40}")
            if i == n:
                sys.stderr.write("\n")
            sys.stderr.flush()
        if level == 3 or "error" in line.lower() or "failed" in line.lower():
            errors.append(line.strip())

    from llama_cpp import _logger

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if rc != 0:
        detail = "; ".join(e for e in errors[-3:] if e) or "no message"
        raise ValueError(f"[quantize] llama.cpp could not quantize '{src}' to {name}: {detail}")
    return dst
