"""The speculation controller on a busy machine (issue 35): one engine, consecutive held-out
requests, each run twice side by side (AR, then speculative under the controller) in three
phases: quiet, with a fixed background load (--load busy-loop processes, `while True: pass`),
and after the load stops (recovery). Per request: tok/s of both, their ratio, acceptance length,
the controller's AR steps and its mode afterwards. Only ratios measured side by side in one run
mean anything on a shared machine.

    python bench/controller_load.py --load 2 --requests 4 --gen 256 --json bench/results/controller_load.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, load_phase_args, load_phases, machine, resolve_pair, write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    load_phase_args(ap, load=2, gen=256)
    a = ap.parse_args()

    import dflash_native as dn
    from dflash_native import _core
    from dflash_native.train import corpus

    target, drafter = resolve_pair(a.target, a.drafter)
    eng = dn.Engine(target, drafter=drafter, n_threads=a.threads)
    prompts = corpus.heldout_prompts(3 * a.requests, 96, eng, seed=0)
    info = machine()
    print(f"# controller_load: {info}; {Path(target).name} + {Path(drafter).name}, threads={a.threads}, "
          f"load={a.load} busy loops, {a.requests} requests per phase, {a.gen} tokens; rev {git_rev()}")
    print(f"{'phase':7} {'req':>3} {'AR tok/s':>9} {'spec tok/s':>10} {'ratio':>6} {'acc len':>7} "
          f"{'AR steps':>8} {'mode':>5} {'exact':>5}")
    rows, k = [], 0
    for phase in load_phases(a.load):
        for i in range(a.requests):
            p, k = prompts[k].text, k + 1
            ar = eng.generate(p, max_tokens=a.gen, speculative=False)
            sp = eng.generate(p, max_tokens=a.gen)
            st = _core.testing.controller_state(eng._spec)
            if len(ar.tokens) < 2 or ar.stats.decode_s <= 0 or sp.stats.decode_s <= 0:
                print(f"{phase:7} {i:>3} (ended at its first token: no decode to time)", flush=True)
                continue
            r = dict(bench="controller_load", phase=phase, request=i, load=a.load if phase == "load" else 0,
                     ar_tok_s=(len(ar.tokens) - 1) / ar.stats.decode_s,
                     spec_tok_s=(len(sp.tokens) - 1) / sp.stats.decode_s, ar_s=ar.stats.decode_s,
                     spec_s=sp.stats.decode_s, n_tokens=len(sp.tokens) - 1,
                     acceptance=sp.stats.mean_acceptance_length, ar_steps=sp.stats.ar_steps,
                     rounds=sp.stats.rounds, mode=st["mode"], stall_s=st["stall_s"],
                     exact=sp.tokens == ar.tokens, gen=a.gen, threads=a.threads, machine=info, rev=git_rev())
            r["ratio"] = r["spec_tok_s"] / r["ar_tok_s"]
            rows.append(r)
            print(f"{phase:7} {i:>3} {r['ar_tok_s']:9.1f} {r['spec_tok_s']:10.1f} {r['ratio']:6.2f} "
                  f"{r['acceptance']:7.2f} {r['ar_steps']:8d} {r['mode']:>5} {str(r['exact']):>5}", flush=True)
        done = [r for r in rows if r["phase"] == phase]
        if done:  # the phase's aggregate: its tokens over its decode seconds, spec over AR
            ratio = sum(r["ar_s"] for r in done) / sum(r["spec_s"] for r in done)  # the same tokens both ways
            print(f"{phase:7} all {'':>9} {'':>10} {ratio:6.2f}  (the phase's tokens over its decode seconds)", flush=True)
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
