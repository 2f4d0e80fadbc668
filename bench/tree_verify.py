"""Tree verify vs chain verify on the embedded pair, side by side (issue 14).

Configurations, one engine each, fixed settings (gate=False: every step a round), same held-out
prompts, same run: AR; chain at B in {4, 8, 16}, with and without draft_cutoff 0.1; tree at
tree_budget in {4, 8, 16, 32, 63} (B = the drafter's 16). Per configuration, pooled over the
prompts: tokens per round (mean acceptance length), tokens per verified token (committed /
tokens through the verify passes: chain `last` + drafts, tree nodes + root), verify ms per round,
end-to-end tok/s and speedup over AR, and the lossless check (dflash_native.lossless). Every JSON
line records the CPU, the ISA and the rev.

    python bench/tree_verify.py --json bench/results/tree_verify.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, isa, machine, resolve_pair, write_jsonl  # noqa: E402


def configs() -> dict[str, dict]:
    out = {}
    for B in (4, 8, 16):
        out[f"chain B{B}"] = dict(block_size=B)
        out[f"chain B{B} c0.1"] = dict(block_size=B, draft_cutoff=0.1)
    for n in (4, 8, 16, 32, 63):
        out[f"tree {n}"] = dict(verify="tree", tree_budget=n)
    return out


def main() -> None:
    import dflash_native as dn
    from dflash_native.lossless import first_divergence_gap, verdict
    from dflash_native.train import corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=Path, default=None, help="default: the embedded pair")
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    target, drafter = resolve_pair(a.target, a.drafter)
    engines = {name: dn.Engine(target, drafter=drafter, n_ctx=a.gen + 256, n_threads=a.threads, gate=False, **kw)
               for name, kw in configs().items()}
    ar_eng = next(iter(engines.values()))
    prompts = [p.text for p in corpus.heldout_prompts(a.prompts, 96, ar_eng, seed=0)]
    for eng in engines.values():  # warm-up: graph plans
        eng.generate(prompts[0], max_tokens=32)
    meta = dict(bench="tree_verify", gen=a.gen, prompts=len(prompts), threads=a.threads, machine=machine(), isa=isa(),
                target=Path(target).name, drafter=Path(drafter).name, rev=git_rev())
    print(f"# tree_verify: {meta['machine']}; {meta['target']} + {meta['drafter']}; {len(prompts)} held-out prompts, "
          f"{a.gen} tokens, threads {a.threads}; load average {os.getloadavg()[0]:.2f}; rev {meta['rev']}")
    ars = [ar_eng.generate(p, max_tokens=a.gen, speculative=False) for p in prompts]
    ar_tok_s = sum(r.stats.n_generated - 1 for r in ars) / sum(r.stats.decode_s for r in ars)
    print(f"AR: {ar_tok_s:.0f} tok/s\n")
    print("| config | tokens / round | tokens / verified token | verify ms / round | tok/s | x AR | spec == AR |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for name, eng in engines.items():
        runs = [eng.generate(p, max_tokens=a.gen) for p in prompts]
        rounds = sum(r.stats.rounds for r in runs)
        committed = sum(sum(k * c for k, c in enumerate(r.stats.acceptance_histogram)) for r in runs)
        verified = sum(r.stats.verified_tokens for r in runs)
        verify_s = sum(r.stats.verify_s for r in runs)
        tok_s = sum(r.stats.n_generated - 1 for r in runs) / sum(r.stats.decode_s for r in runs)
        ok, cell = verdict([first_divergence_gap(ar_eng, p, ar.tokens, r.tokens) for p, ar, r in zip(prompts, ars, runs)])
        row = dict(meta, config=name, tokens_per_round=committed / rounds, tokens_per_verified=committed / verified,
                   verify_ms_per_round=1e3 * verify_s / rounds, tok_s=tok_s, ar_tok_s=ar_tok_s, speedup=tok_s / ar_tok_s,
                   lossless=ok, rounds=rounds)
        rows.append(row)
        print(f"| {name} | {row['tokens_per_round']:.2f} | {row['tokens_per_verified']:.3f} | "
              f"{row['verify_ms_per_round']:.2f} | {tok_s:.0f} | {row['speedup']:.2f}x | {cell} |", flush=True)
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
