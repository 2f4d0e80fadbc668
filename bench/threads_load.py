"""The CPU graphs' thread count on a busy machine (csrc/runtime/thread_governor.h): one engine
whose thread count the governor sets, against the same engine held at its asked count
(`_core.testing.set_threads`) and a one-thread engine, side by side on the same held-out requests
(AR and speculative), in three phases: quiet, with a fixed background load (--load busy-loop
processes, `while True: pass`), and after the load stops. Per request and setup: tok/s, and the
governed engine's threads after it; every setup's tokens must equal the fixed one's. Only ratios
measured side by side in one run mean anything on a shared machine.

    python bench/threads_load.py --load 4 --requests 4 --gen 128 --json bench/results/threads_load.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, load_phase_args, load_phases, machine, resolve_pair, write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    load_phase_args(ap, load=4, gen=128)
    a = ap.parse_args()

    import dflash_native as dn
    from dflash_native import _core
    from dflash_native.train import corpus

    T = _core.testing
    target, drafter = resolve_pair(a.target, a.drafter)
    engines = {"governed": dn.Engine(target, drafter=drafter, n_threads=a.threads),
               "fixed": dn.Engine(target, drafter=drafter, n_threads=a.threads),
               "1 thread": dn.Engine(target, drafter=drafter, n_threads=1)}
    T.set_threads(engines["fixed"]._core, a.threads)  # the governor off: always the asked count
    prompts = corpus.heldout_prompts(3 * a.requests, 96, engines["fixed"], seed=0)
    for e in engines.values():  # warm-up: graph plans
        e.generate(prompts[0].text, max_tokens=8)
    info, rev = machine(), git_rev()
    print(f"# threads_load: {info}; {Path(target).name} + {Path(drafter).name}, threads={a.threads}, "
          f"load={a.load} busy loops, {a.requests} requests per phase, {a.gen} tokens; rev {rev}")
    names = list(engines)
    print(f"{'phase':7} {'req':>3} {'mode':5} " + " ".join(f"{n + ' tok/s':>15}" for n in names)
          + f" {'governed/fixed':>14} {'threads now':>11} {'same':>5}")
    rows, k = [], 0
    for phase in load_phases(a.load):
        for i in range(a.requests):
            p, k = prompts[k].text, k + 1
            for spec in (False, True):
                tok_s, toks = {}, {}
                for n in names:
                    t0 = time.perf_counter()
                    r = engines[n].generate(p, max_tokens=a.gen, speculative=spec)
                    tok_s[n] = len(r.tokens) / (time.perf_counter() - t0)
                    toks[n] = r.tokens
                th = T.runner_threads(engines["governed"]._core)
                same = all(toks[n] == toks["fixed"] for n in names)
                row = dict(bench="threads_load", phase=phase, request=i, mode="spec" if spec else "ar",
                           load=a.load if phase == "load" else 0, tok_s=tok_s,
                           governed_over_fixed=tok_s["governed"] / tok_s["fixed"], threads_now=th["now"],
                           reductions=th["reductions"], same=same, gen=a.gen, threads=a.threads,
                           machine=info, rev=rev)
                rows.append(row)
                print(f"{phase:7} {i:>3} {row['mode']:5} " + " ".join(f"{tok_s[n]:15.1f}" for n in names)
                      + f" {row['governed_over_fixed']:14.2f} {th['now']:>11} {str(same):>5}", flush=True)
    bad = sum(not r["same"] for r in rows)
    print(f"requests whose tokens differ between the setups: {bad}")
    write_jsonl(a.json, rows)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
