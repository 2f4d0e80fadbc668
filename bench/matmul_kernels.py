"""Kernel-only time of the own matmul (csrc/kernels/cpu/matmul/matmul.h) per weight type: the integer path (Q8
activations, integer block dots) against the dequantize-to-F32 path on the same rows
(`_core.testing.matmul(..., f32_path=True)`) and against ggml's own one-column CPU path
(`_core.testing.ggml_vec_dot`: ggml's from_float + vec_dot per output, what llama.cpp's decode
runs), and F16 for scale. One thread, rows quantized by ggml's quantizer, the median of --reps
timed calls (after one warm-up) per column count; the three kernels interleaved call by call.
"N/1" is the time of N columns over that of one (the verify cost curve of the kernel alone).

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


def interleaved(fns: dict, reps: int) -> dict:
    """Each function called once to warm up, then reps rounds calling each once in turn."""
    for fn in fns.values():
        fn()
    ts = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: summarize(v) for k, v in ts.items()}


def main():
    from gguf import GGMLQuantizationType as Q

    from dflash_native import _core
    from reference.ggml_quant import ggml_quantize

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=1024, help="K, the row length")
    ap.add_argument("--n", default="1,2,4,8,16,32", help="column counts (tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    a = ap.parse_args()

    rng = np.random.default_rng(0)
    W = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    print(f"# matmul_kernels: {machine()}; W {a.rows} x {a.cols}; 1 thread; reps={a.reps}; rev {git_rev()}")
    print(f"{'type':<8}{'N':>4}{'integer ms':>12}{'N/1':>7}{'F32 path ms':>13}{'ggml ms':>10}{'ggml/ours':>11}")
    rows = []
    for t in a.types.split(","):
        if t == "F16":
            raw, args = W.astype(np.float16), ()
        else:
            raw, args = ggml_quantize(W, Q[t]), (t,)
        one = None
        for n in (int(v) for v in a.n.split(",")):
            x = rng.standard_normal((n, a.cols)).astype(np.float32)
            fns = {"ours": lambda: _core.testing.matmul(raw, x, "", 1, *args)}
            if args:
                fns["f32"] = lambda: _core.testing.matmul(raw, x, "", 1, *args, f32_path=True)
                fns["ggml"] = lambda: _core.testing.ggml_vec_dot(raw, x, t)
            res = interleaved(fns, a.reps)
            new = res["ours"]
            one = new["median"] if one is None else one
            old, gg = res.get("f32", new), res.get("ggml")
            ggs = f"{1e3 * gg['median']:>10.3f}{gg['median'] / new['median']:>11.2f}" if gg else ""
            print(f"{t:<8}{n:>4}{1e3 * new['median']:>12.3f}{new['median'] / one:>7.2f}{1e3 * old['median']:>13.3f}{ggs}")
            rows.append({"bench": "matmul_kernels", "type": t, "rows": a.rows, "cols": a.cols, "n": n, "threads": 1,
                         "integer_path_s": new, "f32_path_s": old, "f32_over_integer": old["median"] / new["median"],
                         "ggml_vec_dot_s": gg, "ggml_over_integer": gg["median"] / new["median"] if gg else None,
                         "machine": machine(), "rev": git_rev()})
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
