"""The routed experts through the batch-invariant "moe_experts" op (csrc/kernels/cpu/moe_experts.h) against
ggml_mul_mat_id (issue 39), side by side in one run on one MoE target.

Two engines on the same file: ours (matmul="own": the experts through moe_experts, every other
matmul through matmul_op) and the ggml baseline (Engine.for_benchmark(matmul="ggml"): the experts
through ggml_mul_mat_id, the rest through ggml_mul_mat). Per engine, alternating the engines each
rep: an AR step (one token after a 64-token prompt), a verify pass of 16 tokens (what a round
of B = 16 runs; committed to 1 token after each) and the prefill of a 256-token prompt (one
prompt chunk, past the 64 columns up to which both kinds of matmul take our kernels regardless of
type). Then the same passes under the op profiler at
level 2 (csrc/base/profile.h: every node computed alone, so its totals run high: compare the two
engines, not absolute times): the time per AR step and per verify in the expert matmuls alone
("moe_experts" against "MUL_MAT_ID"). The table holds each figure's fastest rep (the least
disturbed by other work on the machine), the JSON lines also the medians. The "expert ms" columns
are the cost this change moves; the whole-step columns also carry the other matmuls' own-vs-ggml
difference.

The model: a Qwen3.5-MoE-shaped random target (hidden 1024, 6 layers, 64 experts of width 256,
top-4, a shared expert of 512) quantized by llama.cpp's quantizer, so that a verify of 16 tokens
routes about one token per expert, as Qwen3-30B-A3B's 128 experts top-8 do.

    python bench/moe_experts.py --json bench/results/moe_experts.jsonl
    python bench/moe_experts.py --types q4_k_m,q8_0,iq4_xs --reps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cached_typed_gguf, git_rev, isa, machine, write_jsonl  # noqa: E402

MOE_BENCH = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=6, full_attention_interval=3,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8,
                 num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512,
                 tie_word_embeddings=True)
VERIFY = 16
PROMPT_LEN = 64
PREFILL = 256  # a prompt chunk: more than 64 tokens (moe.cpp: experts_matmul)


def engines(path: Path, threads: int) -> dict:
    from dflash_native import _core

    kw = dict(n_ctx=512, kv_type="f16", max_verify=VERIFY, n_threads=threads)
    return {m: _core.testing.baseline_target(str(path), matmul=m, **kw) for m in ("own", "ggml")}


def time_ar(t, prompt: list[int], profiled: dict | None = None) -> float:
    t.reset()
    tok = t.decode_greedy(prompt)
    return timed(lambda: t.decode_greedy([tok]), profiled)


def time_verify(t, prompt: list[int], block: list[int], profiled: dict | None = None) -> float:
    t.reset()
    t.decode_greedy(prompt)
    dt = timed(lambda: t.verify_greedy(block), profiled)
    t.commit(1)
    return dt


def time_prefill(t, long_prompt: list[int], profiled: dict | None = None) -> float:
    t.reset()
    return timed(lambda: t.decode_greedy(long_prompt), profiled)


def timed(fn, profiled: dict | None) -> float:
    """Seconds of fn(); with `profiled`, fn runs under the op profiler at level 2, the seconds of
    its expert matmuls ("moe_experts" or ggml's "MUL_MAT_ID" nodes) are appended to
    profiled["secs"] and their op names added to profiled["ops"]."""
    from dflash_native import _core

    if profiled is not None:
        _core.profile(2)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    if profiled is not None:
        rep = _core.profile_report()
        _core.profile(0)
        keys = [k for k in rep if k.endswith(("/moe_experts", "/MUL_MAT_ID"))]
        profiled.setdefault("secs", []).append(sum(rep[k][1] for k in keys))
        profiled.setdefault("ops", set()).update(k.split("/", 1)[1] for k in keys)
    return dt


PASSES = ("ar", "verify", "prefill")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="q4_k_m", help="comma-separated quantization types (llama.cpp's names)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import numpy as np

    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(3, 30000, PROMPT_LEN)]
    block = [int(x) for x in rng.integers(3, 30000, VERIFY)]
    long_prompt = [int(x) for x in rng.integers(3, 30000, PREFILL)]
    print(f"machine: {machine()}")
    print(f"rev {git_rev()}, {a.threads} threads, model {MOE_BENCH['num_experts']} experts top-"
          f"{MOE_BENCH['num_experts_per_tok']} x {MOE_BENCH['num_hidden_layers']} layers, hidden "
          f"{MOE_BENCH['hidden_size']}, expert width {MOE_BENCH['moe_intermediate_size']}; fastest of {a.reps} reps "
          f"(medians in the JSON lines); load average {os.getloadavg()[0]:.2f} (other work on the machine "
          f"inflates every figure)\n")
    print(f"| type | experts via | AR step ms | verify {VERIFY} ms | prefill {PREFILL} ms | expert ms / AR step "
          f"(profiled) | expert ms / verify {VERIFY} (profiled) | expert ms / prefill {PREFILL} (profiled) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for ty in a.types.split(","):
        path = cached_typed_gguf("qwen35moe-bench", "qwen3_5_moe", ty, **MOE_BENCH)
        eng = engines(path, a.threads)
        load = list(os.getloadavg())
        runs = {"ar": lambda t, prof=None: time_ar(t, prompt, prof),
                "verify": lambda t, prof=None: time_verify(t, prompt, block, prof),
                "prefill": lambda t, prof=None: time_prefill(t, long_prompt, prof)}
        for t in eng.values():  # warm-up: every graph shape once
            for run in runs.values():
                run(t)
        wall = {(k, p): [] for k in eng for p in PASSES}
        prof = {(k, p): {} for k in eng for p in PASSES}
        for _ in range(a.reps):  # the engines alternate; then the same passes profiled
            for k, t in eng.items():
                for p, run in runs.items():
                    wall[k, p].append(run(t))
        for _ in range(a.reps):
            for k, t in eng.items():
                for p, run in runs.items():
                    run(t, prof[k, p])
        res = {}
        for k in eng:
            ops = {p: "/".join(sorted(prof[k, p]["ops"])) for p in PASSES}  # the prefill's may differ
            op = ops["ar"] + "".join(f", {p}: {ops[p]}" for p in PASSES if ops[p] != ops["ar"])
            r = {"op": op}
            for p in PASSES:
                r[f"{p}_ms"] = 1e3 * min(wall[k, p])
                r[f"{p}_median_ms"] = 1e3 * statistics.median(wall[k, p])
                r[f"expert_{p}_ms_profiled"] = 1e3 * min(prof[k, p]["secs"])
                r[f"expert_{p}_median_ms_profiled"] = 1e3 * statistics.median(prof[k, p]["secs"])
                r[f"experts_op_{p}"] = ops[p]
            res[k] = r
            print(f"| {ty} | {op} ({k}) | " + " | ".join(f"{r[f'{p}_ms']:.2f}" for p in PASSES) + " | "
                  + " | ".join(f"{r[f'expert_{p}_ms_profiled']:.2f}" for p in PASSES) + " |")
            rows.append(dict(bench="moe_experts", type=ty, engine=k, experts_op=op, threads=a.threads, reps=a.reps,
                             verify_tokens=VERIFY, prompt_tokens=PROMPT_LEN, prefill_tokens=PREFILL,
                             model=dict(MOE_BENCH), **{x: v for x, v in r.items() if x != "op"}, machine=machine(),
                             isa=isa(), load_avg=load, rev=git_rev()))
        o, g = res["own"], res["ggml"]
        print(f"| {ty} | own / ggml | " + " | ".join(f"{o[f'{p}_ms'] / g[f'{p}_ms']:.2f}" for p in PASSES) + " | "
              + " | ".join(f"{o[f'expert_{p}_ms_profiled'] / max(g[f'expert_{p}_ms_profiled'], 1e-9):.2f}"
                           for p in PASSES) + " |")
        for t in eng.values():
            t.reset()
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
