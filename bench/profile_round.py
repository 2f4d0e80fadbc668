"""Where a speculative round's time goes: op-level totals of the trained pair on held-out prompts.

Runs AR and DFlash over the same held-out prompts with the engine's op profiler on
(dflash_native._core.profile, csrc/base/profile.h) and prints, per graph ("target": AR steps and
verify passes, "draft", "encode": the feature-ring push), the time of each op and of the phases
around the compute, per round and per AR token.

    python bench/profile_round.py --block 8 --cutoff 0.1            # phases only (level 1)
    python bench/profile_round.py --block 8 --cutoff 0.1 --level 2  # every node timed alone

Level 2 computes one node at a time, which adds a thread wake-up per node: read its shares,
not its absolute times.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--cutoff", type=float, default=0.1)
    ap.add_argument("--level", type=int, default=1, choices=(1, 2))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--matmul", default="own")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import dflash_native as dn
    from dflash_native import _core
    from dflash_native.cli import default_pair
    from dflash_native.train import corpus

    target, drafter = (a.target, a.drafter) if a.target else default_pair()
    eng = dn.Engine.for_benchmark(target, drafter=drafter, block_size=a.block, n_ctx=96 + a.gen + 2 * a.block + 8,
                                  n_threads=a.threads, matmul=a.matmul, draft_cutoff=a.cutoff)
    prompts = corpus.heldout_prompts(a.prompts, 96, eng, seed=0)
    eng.generate(prompts[0].text, max_tokens=16, speculative=False)  # warm-up
    eng.generate(prompts[0].text, max_tokens=16)

    def profiled(spec: bool, max_tokens: int):
        _core.profile(a.level)
        stats = [eng.generate(p.text, max_tokens=max_tokens, speculative=spec).stats for p in prompts]
        rep = _core.profile_report()
        _core.profile(0)
        return stats, rep

    records = []
    for mode in ("AR", "DFlash"):
        spec = mode == "DFlash"
        _, pre = profiled(spec, 1)  # the prefills alone, subtracted below
        stats, rep = profiled(spec, a.gen)
        n_tok = sum(s.n_generated for s in stats)
        rounds = sum(s.rounds for s in stats) if spec else n_tok - len(stats)
        wall = sum(s.decode_s for s in stats)
        unit = "round" if spec else "AR step"
        print(f"\n## {mode}: {n_tok} tokens, {rounds} {unit}s, decode {1e3 * wall / rounds:.3f} ms per {unit}"
              f" (level {a.level}, prefill excluded)")
        print(f"| graph/op | calls per {unit} | ms per {unit} | share of decode |")
        print("|---|---:|---:|---:|")
        total = 0.0
        rows = {k: (c - pre.get(k, (0, 0.0))[0], s - pre.get(k, (0, 0.0))[1]) for k, (c, s) in rep.items()}
        rows = {k: v for k, v in rows.items() if v[0] > 0}  # drop what only the prefills ran
        for key, (calls, s) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            total += s
            print(f"| {key} | {calls / rounds:.2f} | {1e3 * s / rounds:.3f} | {100 * s / wall:.1f}% |")
        print(f"| (outside graphs and commit: accept, sampling, Python) | | {1e3 * (wall - total) / rounds:.3f} | "
              f"{100 * (wall - total) / wall:.1f}% |")
        records.append({"bench": "profile_round", "mode": mode, "level": a.level, "B": a.block, "draft_cutoff": a.cutoff,
                        "tokens": n_tok, "steps": rounds, "ms_per_step": 1e3 * wall / rounds,
                        "ms_per_step_by_key": {k: 1e3 * s / rounds for k, (c, s) in rows.items()},
                        "calls_per_step_by_key": {k: c / rounds for k, (c, s) in rows.items()},
                        "prompts": len(prompts), "gen": a.gen, "threads": a.threads, "matmul": a.matmul,
                        "machine": machine(), "rev": git_rev()})
    write_jsonl(a.json, records)


if __name__ == "__main__":
    main()
