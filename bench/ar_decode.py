"""AR prefill and decode speed: dflash-native vs llama.cpp (llama-cpp-python) on the same GGUF files.

Both engines run in this process, alternating per repetition, with the same thread count,
F16 KV cache and flash attention, greedy decoding of the same tokens. Ratios are ours / llama.cpp.
--outtypes takes our converter's types (f32, f16, bf16, q8_0) and llama.cpp's quantized file types
(q4_k_m, q5_k_m, q6_k, q4_0, iq4_xs, ...: dflash_native.quantize over the F16 file).

--verify-curve adds, per type, the cost of a verify of 2, 4, 8, 16, 32 tokens over one AR step
(ours: Target.verify, all rows' logits, after a short prompt; llama.cpp: eval of N tokens, like
llama-bench pp-N, over eval of 1): the number that decides the best block size on a CPU.

    python bench/ar_decode.py --threads 2 --outtypes f16,q8_0,q4_k_m,q6_k,q4_0 --verify-curve \
        --json bench/results/ar_decode.jsonl

--moe runs the ~1B Qwen3.5-MoE shape instead (_common.QWEN35MOE_1B: 16 experts, top-4, a shared
expert); with --verify-curve it also prints the routed experts' time (ggml's MUL_MAT_ID nodes,
op profiler level 2) per verified token: a verify batch touches more experts than one token.

    python bench/ar_decode.py --moe --outtypes q8_0 --verify-curve --json bench/results/ar_decode.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (Timer, bench_target, cached_typed_gguf, git_rev, llama_bufts, llama_prepare,  # noqa: E402
                     machine, pass_timers, summarize, write_jsonl)


def bench_ours(path, prompt, n_decode, threads, n_ctx):
    from dflash_native import _core

    t = _core.Target(str(path), n_ctx=n_ctx, n_threads=threads, kv_type="f16")
    # the engine's measured matmul levels (csrc/kernels/cpu/matmul/dispatch.h), recorded with its rows
    run_info = {"engine_isa": t.isa, "matmul_dispatch": t.matmul_dispatch()}

    def run():
        t.reset()
        with Timer() as tp:
            logits = t.decode(prompt)
        tok = int(np.argmax(logits[-1]))
        with Timer() as td:
            for _ in range(n_decode):
                tok = int(np.argmax(t.decode([tok])[-1]))
        return tp.s, td.s

    run.info = run_info
    return run


def bench_llama(path, prompt, n_decode, threads, n_ctx, bufts):
    import llama_cpp

    llama_prepare(path, bufts)
    ll = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, n_ubatch=512, flash_attn=True, verbose=False)

    n_vocab = ll.n_vocab()

    def last_logits():
        # the last evaluated token's row (Llama.scores is only filled with logits_all=True)
        return np.ctypeslib.as_array(ll._ctx.get_logits(), shape=(n_vocab,))

    def run():
        ll.reset()  # clears llama.cpp's memory (KV and recurrent state) too
        with Timer() as tp:
            ll.eval(prompt)
        tok = int(np.argmax(last_logits()))
        with Timer() as td:
            for _ in range(n_decode):
                ll.eval([tok])
                tok = int(np.argmax(last_logits()))
        return tp.s, td.s

    return run


VERIFY_SIZES = (2, 4, 8, 16, 32)


def expert_cost(t, ours, reps):
    """{n: (median ms of the routed experts' MUL_MAT_ID nodes per token of an n-token pass, the
    share of the pass they take)} for n = 1 and VERIFY_SIZES, with the op profiler at level 2
    (each node timed alone: read the ratios, not the absolute times)."""
    from dflash_native import _core

    out = {}
    for n in (1,) + VERIFY_SIZES:
        per_tok, share = [], []
        for _ in range(reps):
            _core.profile(2)
            ours(n)
            rep = _core.profile_report()
            _core.profile(0)
            moe = sum(s for k, (c, s) in rep.items() if k.startswith("target") and k.endswith("/MUL_MAT_ID"))
            total = sum(s for k, (c, s) in rep.items() if k.startswith("target") and "/" in k)
            per_tok.append(1e3 * moe / n)
            share.append(moe / total if total else 0.0)
        out[n] = (summarize(per_tok)["median"], summarize(share)["median"])
    return out


def verify_curve(path, prompt, threads, reps, bufts, experts=False):
    """{engine: {n: median seconds of an n-token pass / median seconds of a 1-token step}}; with
    experts, also "experts": expert_cost."""
    import llama_cpp
    from dflash_native import _core

    block = [int(x) for x in np.random.default_rng(1).integers(10, 600, max(VERIFY_SIZES))]
    t = _core.Target(str(path), n_ctx=len(prompt) + 2 * max(VERIFY_SIZES) + 8, n_threads=threads, kv_type="f16",
                     max_verify=max(VERIFY_SIZES))
    llama_prepare(path, bufts)
    ll = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + 2 * max(VERIFY_SIZES) + 8, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, n_ubatch=512, flash_attn=True, verbose=False)

    ours, llama = pass_timers(t, ll, prompt, block)

    out = {}
    if experts:
        out["experts"] = expert_cost(t, ours, reps)
    for name, fn in (("dflash-native", ours), ("llama.cpp", llama)):
        fn(1)  # warm-up (graph plans)
        times = {n: summarize([fn(n) for _ in range(reps)])["median"] for n in (1,) + VERIFY_SIZES}
        out[name] = {n: times[n] / times[1] for n in VERIFY_SIZES} | {"step_s": times[1]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--outtypes", default="f16,q8_0")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a tiny model instead of the 0.5B shape (smoke run)")
    ap.add_argument("--moe", action="store_true", help="the ~1B Qwen3.5-MoE shape (16 experts, top-4) instead")
    ap.add_argument("--embedded", action="store_true",
                    help="the embedded default pair's target (its F16 file as shipped) instead; --outtypes is ignored")
    ap.add_argument("--verify-curve", action="store_true",
                    help="also time verifies of 2..32 tokens over one AR step, per type, ours and llama.cpp's")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra buffer types (no AMX, no repacked weights): its plain CPU "
                         "kernels. By default an AMX machine runs it with repacked weights but no AMX, as a CPU "
                         "without AMX does (_common.llama_bufts)")
    ap.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    a = ap.parse_args()
    bufts = llama_bufts(plain=a.no_extra_bufts)

    name, arch, shape = bench_target(a.moe, a.tiny)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(10, 600, a.prompt_len)]
    n_ctx = a.prompt_len + a.decode + 16

    print(f"# ar_decode: {machine()}; threads={a.threads}; prompt={a.prompt_len}; decode={a.decode}; "
          f"reps={a.reps} (+1 warm-up); llama.cpp weights: {bufts}; "
          f"rev {git_rev()}", flush=True)
    print(f"{'model':<16}{'type':<8}{'engine':<14}{'prefill tok/s':>14}{'decode tok/s':>14}")
    rows = []
    if bufts == "repack (no AMX)":
        print("# llama.cpp's repacked weights without AMX (its AMX path crashes here): as a CPU without AMX runs it")
    if a.embedded:
        from dflash_native.cli import default_pair

        name, files = "embedded-target", {"f16": default_pair()[0]}
    else:
        files = {t: None for t in a.outtypes.split(",")}
    for outtype, path in files.items():
        path = path or cached_typed_gguf(name, arch, outtype, **shape)
        runners = {"dflash-native": bench_ours(path, prompt, a.decode, a.threads, n_ctx),
                   "llama.cpp": bench_llama(path, prompt, a.decode, a.threads, n_ctx, bufts)}
        disp = runners["dflash-native"].info["matmul_dispatch"]
        print(f"# {outtype}: matmul levels measured at load ({1e3 * sum(c['wall_seconds'] for c in disp):.0f} ms): "
              + ("; ".join(f"{c['type']} x{c['columns']} {c['chosen']} ("
                           + ", ".join(f"{k} {1e3 * v:.3f}" for k, v in c['seconds'].items()) + " ms)" for c in disp)
                 or "none (one level, or the level set by the user)"), flush=True)
        res = {k: {"prefill": [], "decode": []} for k in runners}
        for rep in range(a.reps + 1):
            for k, run in runners.items():  # alternate engines within each repetition
                tp, td = run()
                if rep > 0:
                    res[k]["prefill"].append(a.prompt_len / tp)
                    res[k]["decode"].append(a.decode / td)
        for k in runners:
            p, d = summarize(res[k]["prefill"]), summarize(res[k]["decode"])
            print(f"{name:<16}{outtype:<8}{k:<14}{p['median']:>14.1f}{d['median']:>14.1f}", flush=True)
            rows.append({"bench": "ar_decode", "model": name, "outtype": outtype, "engine": k,
                         "threads": a.threads, "prompt_len": a.prompt_len, "n_decode": a.decode,
                         "prefill_tok_s": p, "decode_tok_s": d, "machine": machine(), "rev": git_rev(),
                         "llama_bufts": bufts, **getattr(runners[k], "info", {})})
        ours, ref = res["dflash-native"], res["llama.cpp"]
        rp = summarize(ours["prefill"])["median"] / summarize(ref["prefill"])["median"]
        rd = summarize(ours["decode"])["median"] / summarize(ref["decode"])["median"]
        print(f"{name:<16}{outtype:<8}{'ratio':<14}{rp:>14.3f}{rd:>14.3f}")
        rows.append({"bench": "ar_decode", "model": name, "outtype": outtype, "engine": "ratio ours/llama.cpp",
                     "prefill_ratio": rp, "decode_ratio": rd, "threads": a.threads, "machine": machine(),
                     "rev": git_rev(), "llama_bufts": bufts})
        if a.verify_curve:
            curve = verify_curve(path, prompt[:32], a.threads, a.reps, bufts, experts=a.moe)
            if a.moe:
                ex = curve.pop("experts")
                print(f"{name:<16}{outtype:<8}{'experts':<14}MUL_MAT_ID ms per token (share of the pass): "
                      + "  ".join(f"{n}: {ms:.2f} ({sh:.0%})" for n, (ms, sh) in ex.items()))
                rows.append({"bench": "verify_experts", "model": name, "outtype": outtype, "threads": a.threads,
                             "profile_level": 2, "mul_mat_id_ms_per_token": {str(n): v[0] for n, v in ex.items()},
                             "mul_mat_id_share": {str(n): v[1] for n, v in ex.items()}, "machine": machine(),
                             "rev": git_rev()})
            for k, c in curve.items():
                print(f"{name:<16}{outtype:<8}{k:<14}verify cost / AR step ({1e3 * c['step_s']:.1f} ms): "
                      + "  ".join(f"{n}: {c[n]:.2f}" for n in VERIFY_SIZES))
                rows.append({"bench": "verify_curve", "model": name, "outtype": outtype, "engine": k,
                             "threads": a.threads, "context": 32, "ar_step_s": c["step_s"],
                             "verify_over_ar": {str(n): c[n] for n in VERIFY_SIZES}, "machine": machine(),
                             "rev": git_rev(), "llama_bufts": bufts})
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
