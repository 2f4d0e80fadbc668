"""Kernel-only time of the own matmul (csrc/matmul.h) per weight type: the integer path (Q8
activations, integer block dots) against the dequantize-to-F32 path on the same rows
(`_core.testing.matmul(..., f32_path=True)`), and F16 for scale. One thread, rows quantized by
ggml's quantizer, the median of --reps timed calls (after one warm-up) per column count.

    python bench/matmul_kernels.py --json bench/results/matmul_kernels.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import git_rev, machine, summarize, write_jsonl  # noqa: E402

TYPES = ["F16", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def timed(fn, reps: int) -> dict:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return summarize(ts)


def main():
    from gguf import GGMLQuantizationType as Q

    from dflash_native import _core
    from reference.ggml_quant import ggml_quantize

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=1024, help="K, the row length")
    ap.add_argument("--n", default="1,16", help="column counts (tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    a = ap.parse_args()

    rng = np.random.default_rng(0)
    W = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    print(f"# matmul_kernels: {machine()}; W {a.rows} x {a.cols}; 1 thread; reps={a.reps}; rev {git_rev()}")
    print(f"{'type':<8}{'N':>4}{'integer ms':>12}{'F32 path ms':>13}{'F32/integer':>13}")
    rows = []
    for t in a.types.split(","):
        if t == "F16":
            raw, args = W.astype(np.float16), ()
        else:
            raw, args = ggml_quantize(W, Q[t]), (t,)
        for n in (int(v) for v in a.n.split(",")):
            x = rng.standard_normal((n, a.cols)).astype(np.float32)
            new = timed(lambda: _core.testing.matmul(raw, x, "", 1, *args), a.reps)
            old = timed(lambda: _core.testing.matmul(raw, x, "", 1, *args, f32_path=True), a.reps) if args else new
            ratio = old["median"] / new["median"]
            print(f"{t:<8}{n:>4}{1e3 * new['median']:>12.3f}{1e3 * old['median']:>13.3f}{ratio:>13.2f}")
            rows.append({"bench": "matmul_kernels", "type": t, "rows": a.rows, "cols": a.cols, "n": n, "threads": 1,
                         "integer_path_s": new, "f32_path_s": old, "f32_over_integer": ratio,
                         "machine": machine(), "rev": git_rev()})
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
