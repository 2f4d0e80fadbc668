"""Quantize a GGUF with llama.cpp's own quantizer (`llama_model_quantize` in libllama, which the
core links: csrc/gguf/quantize.h): targets (qwen3, qwen35, ...) and DFlash drafters (arch `dflash`,
which llama.cpp's quantizer accepts like any arch it knows), so users need no second tool.

The file types are llama.cpp's `LLAMA_FTYPE_MOSTLY_*` (the names `llama-quantize` takes): a mix
such as Q4_K_M keeps some tensors in other types, and a tensor whose rows do not fit the type's
blocks (256 for the K- and IQ4_XS quants) falls back to another type, as llama.cpp decides.
1-D tensors (norms) stay F32. Every type it writes runs in the Engine through the package's own
batch-invariant matmul (docs/architecture.md, "Weight types").
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from . import _core

# CLI / API name -> llama.cpp's LLAMA_FTYPE_* (llama.h's enum llama_ftype; llama-quantize's names, lower case).
FTYPES = {
    "f32": 0, "f16": 1, "bf16": 32, "q8_0": 7,
    "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
    "q2_k": 10, "q2_k_s": 21, "q3_k_s": 11, "q3_k_m": 12,
    "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16,
    "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30,
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
    non-GGUF source, or a failure inside llama.cpp (its last error lines quoted) raise ValueError."""
    name = str(type).strip().lower()
    name = ALIASES.get(name, name)
    if name not in FTYPES:
        raise ValueError(f"[quantize] unknown type '{type}'; one of: {', '.join(quantize_types())}")
    from .convert import as_path

    src, dst = as_path("quantize", "src", src), as_path("quantize", "dst", dst)
    _check_gguf(src, "source")
    if dst.resolve() == src.resolve():
        raise ValueError(f"[quantize] destination '{dst}' is the source file")
    if not dst.parent.is_dir():
        raise ValueError(f"[quantize] destination directory '{dst.parent}' does not exist")
    if n_threads is not None and (not isinstance(n_threads, int) or isinstance(n_threads, bool) or n_threads < 1):
        raise ValueError(f"[quantize] n_threads must be a positive int, got {n_threads!r}")

    errors: list[str] = []

    # llama.cpp reports through its log only: one "[ i/ n] tensor ..." line per tensor, and its
    # errors; the core hands us every line while it runs.
    def on_log(level: int, text: bytes) -> None:
        line = text.decode("utf-8", "replace")
        m = _PROGRESS.match(line)
        if m and progress:
            i, n = int(m.group(1)), int(m.group(2))
            bar = "#" * (30 * i // n)
            sys.stderr.write(f"\r[dflash-native quantize] {name} [{bar:<30}] {i}/{n} {m.group(3)[:40]:<40}")
            if i == n:
                sys.stderr.write("\n")
            sys.stderr.flush()
        if level in (3, 4) or "error" in line.lower() or "failed" in line.lower():  # ggml: WARN, ERROR
            errors.append(line.strip())

    rc = _core.quantize(str(src), str(dst), FTYPES[name], n_threads or os.cpu_count() or 1, on_log)
    if rc != 0:
        detail = "; ".join(e for e in errors[-3:] if e) or "no message"
        raise ValueError(f"[quantize] llama.cpp could not quantize '{src}' to {name}: {detail}")
    return dst
