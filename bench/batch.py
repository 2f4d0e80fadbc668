"""Batched target steps vs one-sequence steps (docs/architecture.md, "Batched target").

For each concurrency N: one target pass over N sequences' work (N AR tokens, or N verify blocks of B
tokens, each sequence at its own positions after its own prompt: target_session::decode_batch) against
the same work as N one-sequence passes (Target.decode_greedy / verify + commit), timed side by side in
one run, alternating, on the same file. Reported: milliseconds per step (the batched pass, the N solo
passes), their ratio, and the aggregate tokens per second each gives. With --engine also the batch
engine (spec/batch_engine.h): N greedy requests at once against the same N requests one at a time
through a one-slot engine, aggregate tokens per second.

The default target is the 0.5B-shaped Qwen3.5 hybrid at Q8_0 (its matmuls take the wide GEMM above
64 columns, so wide batches stay exact); --tiny: a smoke-run size.

    python bench/batch.py --json bench/results/batch.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN35_05B, bench_target, cached_drafter, cached_typed_gguf, git_rev, machine, summarize, write_jsonl  # noqa: E402


def main():
    from dflash_native import _core

    T = _core.testing
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--tiny", action="store_true", help="a small random target (smoke run)")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--block", type=int, default=8, help="verify block B")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="also the batch engine end to end")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (--engine)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    name, arch, shape = bench_target(moe=False, tiny=a.tiny)
    target = cached_typed_gguf(name, arch, a.outtype, **shape)
    rng = np.random.default_rng(0)
    n_max, B = max(a.n), a.block
    n_ctx = a.prompt + (a.reps + 2) * (B + 1) * n_max + 64
    common = dict(n_ctx=n_ctx, n_threads=a.threads, max_verify=B)
    batch_t = T.batch_target(str(target), n_max, **common)
    solo_t = _core.Target(str(target), **common)
    vocab = solo_t.n_vocab
    prompts = [list(map(int, rng.integers(3, vocab, a.prompt))) for _ in range(n_max)]

    def prefill():
        for s in range(n_max):
            T.reset_slot(batch_t, s)
        T.decode_batch(batch_t, [(s, prompts[s], "prefill") for s in range(n_max)])
        solo_t.reset()
        solo_t.decode(prompts[0])

    rows = []
    mach, rev = machine(), git_rev()
    print(f"{machine()}\ntarget {target.name}, B = {B}, prompt {a.prompt}, {a.threads} threads, "
          f"side by side (alternating), median of {a.reps}")
    print(f"{'kind':7} {'N':>3} {'tokens':>6} {'batched ms':>11} {'N solo ms':>10} {'solo/batched':>12} "
          f"{'batched tok/s':>14} {'solo tok/s':>11}")
    for kind in ("ar", "verify"):
        for n in a.n:
            prefill()
            width = 1 if kind == "ar" else B
            t_batch, t_solo = [], []
            for _ in range(a.reps + 1):  # the first of each is a warm-up
                work = [(s, list(map(int, rng.integers(3, vocab, width))), "decode" if kind == "ar" else "verify")
                        for s in range(n)]
                t0 = time.perf_counter()
                T.decode_batch(batch_t, work)
                if kind == "verify":
                    for s in range(n):
                        T.commit_slot(batch_t, s, 1)
                t_batch.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for _, toks, _ in work:
                    if kind == "ar":
                        solo_t.decode_greedy(toks)
                    else:
                        solo_t.verify(toks)
                        solo_t.commit(1)
                t_solo.append(time.perf_counter() - t0)
            sb, ss = summarize(t_batch[1:]), summarize(t_solo[1:])
            tok = n * width
            r = dict(bench="batch", kind=kind, n=n, block=width, tokens=tok, batched_s=sb, solo_s=ss,
                     ratio=ss["median"] / sb["median"], batched_tok_s=tok / sb["median"], solo_tok_s=tok / ss["median"],
                     target=target.name, outtype=a.outtype, prompt=a.prompt, threads=a.threads, machine=mach, rev=rev)
            rows.append(r)
            print(f"{kind:7} {n:>3} {tok:>6} {sb['median'] * 1e3:>11.2f} {ss['median'] * 1e3:>10.2f} "
                  f"{r['ratio']:>12.2f} {r['batched_tok_s']:>14.1f} {r['solo_tok_s']:>11.1f}")

    if a.engine:
        drafter = cached_drafter(name, a.outtype if a.outtype in ("f16", "q8_0", "f32") else "f16",
                                 dict(QWEN35_05B, **shape), block_size=B, n_layers=1)
        print(f"\nbatch engine, drafter {drafter.name}: N greedy requests of {a.max_tokens} tokens")
        print(f"{'N':>3} {'batched s':>10} {'one at a time s':>16} {'batched tok/s':>14} {'sequential tok/s':>17}")
        one_t = T.batch_target(str(target), 1, **common)
        one = T.BatchEngine(one_t, str(drafter), block_size=B)
        for n in a.n:
            eng = T.BatchEngine(T.batch_target(str(target), n, **common), str(drafter), block_size=B)
            t0 = time.perf_counter()
            slots = [eng.start(prompts[i], a.max_tokens) for i in range(n)]
            while eng.step():
                pass
            t_b = time.perf_counter() - t0
            for s in slots:
                eng.release(s)
            t0 = time.perf_counter()
            for i in range(n):
                s = one.start(prompts[i], a.max_tokens)
                while one.step():
                    pass
                one.release(s)
            t_s = time.perf_counter() - t0
            tok = n * a.max_tokens
            r = dict(bench="batch_engine", n=n, block=B, max_tokens=a.max_tokens, batched_s=t_b, sequential_s=t_s,
                     batched_tok_s=tok / t_b, sequential_tok_s=tok / t_s, target=target.name, drafter=drafter.name,
                     outtype=a.outtype, prompt=a.prompt, threads=a.threads, machine=mach, rev=rev)
            rows.append(r)
            print(f"{n:>3} {t_b:>10.2f} {t_s:>16.2f} {r['batched_tok_s']:>14.1f} {r['sequential_tok_s']:>17.1f}")
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
