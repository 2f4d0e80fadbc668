"""Long generations: AR vs DFlash with the drafter window the GGUF records, the whole ring, and a
ring of 64, side by side on held-out prompts (issue 13: "never slower than AR at any length").

A drafter trained on short contexts, attending to thousands of ring positions it never saw in
training, stops drafting well: its acceptance collapses as the generation grows. The drafter GGUF
records the context it was trained with (dflash.trained_context_length), and an Engine without
drafter_window attends to that many positions. Configurations, one engine each, same prompts:

    AR             plain greedy decoding (the speculative engine with speculative=False)
    trained        the defaults: window = the drafter's trained context (Spec.window)
    whole ring     drafter_window = feature_ring_capacity (4096): the default before the key
    ring 64        feature_ring_capacity = 64

Per generated length: pooled mean acceptance length (committed tokens per round), tok/s (tokens
after the first over decode time, summed over prompts) and the lossless check (dflash_native.
lossless: identical, or a divergence only at a near-tie of AR's logits). Every JSON line records
the CPU, the matmul ISA, the load average before and after the run, and the rev.

    python bench/long_context.py --json bench/results/long_context.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, isa, machine, resolve_pair, write_jsonl  # noqa: E402

RING = 4096


def configs(B: int, cutoff: float) -> dict[str, dict]:
    base = dict(block_size=B, draft_cutoff=cutoff)
    return {"trained": dict(base), "whole ring": dict(base, drafter_window=RING, feature_ring_capacity=RING),
            "ring 64": dict(base, feature_ring_capacity=64)}


def fastest(runs):
    return min(runs, key=lambda r: r.stats.decode_s)


def run_length(engines: dict, prompts, gen: int, reps: int = 1) -> dict[str, dict]:
    """Every configuration on every prompt at one generated length; pooled per configuration.
    With reps > 1 each prompt runs every configuration reps times, interleaved, and each one's
    fastest pass counts (same tokens every pass): on a shared machine stolen time lands on one
    pass or another, rarely on all."""
    from dflash_native.lossless import first_divergence_gap

    ar_eng = engines["trained"]
    out = {name: dict(n=0, s=0.0, committed=0, rounds=0, gaps=[], n_gen=[], stop=set()) for name in ["AR", *engines]}
    for p in prompts:
        runs: dict[str, list] = {name: [] for name in out}
        for _ in range(reps):
            runs["AR"].append(ar_eng.generate(p.text, max_tokens=gen, speculative=False))
            for name, eng in engines.items():
                runs[name].append(eng.generate(p.text, max_tokens=gen))
        ar = fastest(runs["AR"])
        t = out["AR"]
        t["n"] += max(ar.stats.n_generated - 1, 0)
        t["s"] += ar.stats.decode_s
        t["n_gen"].append(ar.stats.n_generated)
        t["stop"].add(ar.stats.stop_reason)
        for name in engines:
            sp = fastest(runs[name])
            s, t = sp.stats, out[name]
            t["n"] += max(s.n_generated - 1, 0)
            t["s"] += s.decode_s
            t["committed"] += sum(k * n for k, n in enumerate(s.acceptance_histogram))
            t["rounds"] += s.rounds
            t["gaps"].append(first_divergence_gap(ar_eng, p.text, ar.tokens, sp.tokens))
            t["n_gen"].append(s.n_generated)
            t["stop"].add(s.stop_reason)
    return out


def main() -> None:
    import dflash_native as dn
    from dflash_native.lossless import verdict
    from dflash_native.train import corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gens", default="256,1024,2048", help="generated lengths, comma-separated")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per length")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-cutoff", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="interleaved passes per prompt and configuration; "
                                                          "each one's fastest counts")
    ap.add_argument("--target", type=Path, default=None, help="default: the embedded pair")
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--note", default="", help="recorded in every line (e.g. 'machine loaded by other jobs')")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    target, drafter = resolve_pair(a.target, a.drafter)
    gens = [int(g) for g in a.gens.split(",")]
    n_ctx = a.prompt_tokens + max(gens) + 2 * a.block_size + 8
    engines = {name: dn.Engine(target, drafter=drafter, n_ctx=n_ctx, n_threads=a.threads, **kw)
               for name, kw in configs(a.block_size, a.draft_cutoff).items()}
    windows = {name: eng._spec.window for name, eng in engines.items()}
    prompts = corpus.heldout_prompts(a.prompts, a.prompt_tokens, engines["trained"], seed=0)
    for eng in engines.values():  # warm-up: graph plans and caches
        eng.generate(prompts[0].text, max_tokens=16)
    load0 = os.getloadavg()
    cpu, isa_s, rev = machine(), isa(), git_rev()
    print(f"# long_context: {cpu}; {Path(target).name} + {Path(drafter).name}; B={a.block_size}, "
          f"draft_cutoff={a.draft_cutoff}, threads={a.threads}, reps={a.reps}, {a.prompts} held-out prompts of ~{a.prompt_tokens} "
          f"tokens; windows {windows}; load average {load0[0]:.2f}; rev {rev}")
    names = ["AR", *engines]
    print("| generated | " + " | ".join(f"{n} tok/s" for n in names) + " | "
          + " | ".join(f"{n} acc. len" for n in engines) + " | spec == AR |")
    print("|---:|" + "---:|" * (2 * len(names) - 1) + "---|")
    rows = []
    for gen in gens:
        res = run_length(engines, prompts, gen, a.reps)
        load1 = os.getloadavg()
        ar_tok_s = res["AR"]["n"] / res["AR"]["s"]
        cells, accs, checks = [], [], []
        for name in names:
            t = res[name]
            tok_s = t["n"] / t["s"]
            cells.append(f"{tok_s:.0f}")
            row = {"bench": "long_context", "config": name, "gen": gen, "tok_s": tok_s, "ar_tok_s": ar_tok_s,
                   "speedup": tok_s / ar_tok_s, "n_generated": t["n_gen"], "stop_reasons": sorted(t["stop"]),
                   "block_size": a.block_size, "draft_cutoff": a.draft_cutoff, "threads": a.threads, "reps": a.reps,
                   "prompts": len(prompts), "prompt_tokens": a.prompt_tokens, "target": Path(target).name,
                   "drafter": Path(drafter).name, "machine": cpu, "isa": isa_s,
                   "loadavg_before": load0[0], "loadavg_after": load1[0], "note": a.note, "rev": rev}
            if name != "AR":
                ok, cell = verdict(t["gaps"])
                acc = t["committed"] / max(t["rounds"], 1)
                accs.append(f"{acc:.2f}")
                checks.append(f"{name}: {cell}")
                row.update(window=windows[name], mean_acceptance_length=acc, rounds=t["rounds"],
                           spec_identical_prompts=t["gaps"].count(None), divergence_gaps=t["gaps"], lossless=ok)
            rows.append(row)
        print(f"| {gen} | " + " | ".join(cells) + " | " + " | ".join(accs) + " | " + "; ".join(checks) + " |",
              flush=True)
        load0 = load1
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
