"""Long generations and long prompts: AR vs DFlash under the controller (the defaults) and under
fixed settings, side by side on held-out prompts (issue 13: "never slower than AR at any length").

Configurations, one engine each, same prompts, same run:

    AR              plain greedy decoding (an engine's generate(speculative=False))
    defaults        Engine(target, drafter=...) untouched: the controller (gate=True) picks each
                    step (AR or a round, and how many drafts to verify), window = the drafter's
                    trained context (dflash.trained_context_length), B = the drafter's block size
    fixed ...       gate=False: every step a round of block size B, cut by draft_cutoff c
    fixed B16 wW    gate=False, B=16, drafter_window = W (256, 1024) whatever the drafter was trained
                    with: a drafter's training window apart from the window it drafts with (only
                    when --configs names it)
    whole ring      gate=False, B=8, c=0.1, drafter_window = ring = 4096: issue 13's failing default

Two tables. Generated lengths (--gens, default 256..8192) after held-out prompts of ~96 tokens;
and a long prompt (--long-prompt tokens of held-out text, default 4096) followed by --long-gens.
Per row: tok/s (tokens after the first over decode time, summed over prompts), speedup over AR,
mean acceptance length (committed tokens per round; AR steps are not rounds), and the lossless
check (dflash_native.lossless: identical, or a divergence only at a near-tie of AR's logits).
The summary columns: the best fixed setting's speedup, defaults / best fixed, and the acceptance
length relative to the first length's (issue 13's goals: defaults >= 1.0x AR everywhere; AL at 4K
>= 0.85x AL at 256; controller >= 0.95x the best fixed setting). Every JSON line records the CPU,
the ISA, the load average before and after, and the rev.

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


ON_REQUEST = ("fixed B16 w256", "fixed B16 w1024")  # run only when --configs names them


def configs() -> dict[str, dict]:
    fixed = dict(gate=False)
    return {
        "defaults": {},
        "fixed B16": dict(fixed),
        "fixed B16 c0.1": dict(fixed, draft_cutoff=0.1),
        "fixed B8": dict(fixed, block_size=8),
        "fixed B8 c0.1": dict(fixed, block_size=8, draft_cutoff=0.1),
        "fixed B4": dict(fixed, block_size=4),
        "fixed B16 w256": dict(fixed, drafter_window=256),
        "fixed B16 w1024": dict(fixed, drafter_window=1024),
        "whole ring": dict(fixed, block_size=8, draft_cutoff=0.1, drafter_window=RING, feature_ring_capacity=RING),
    }


class Prompt:
    def __init__(self, ids: list[int], name: str):
        self.ids, self.name = ids, name


def long_prompts(n: int, n_tokens: int, eng) -> list[Prompt]:
    """`n` prompts of exactly `n_tokens` tokens: the start of the longest held-out files."""
    from dflash_native.train import corpus

    texts = sorted(corpus.iter_texts("heldout"), key=lambda t: -len(t[1]))
    out = []
    for name, text in texts:
        ids = eng.tokenize(text)
        if len(ids) >= n_tokens:
            out.append(Prompt(ids[:n_tokens], name))
        if len(out) == n:
            return out
    raise SystemExit(f"fewer than {n} held-out files have {n_tokens} tokens")


def fastest(runs):
    return min(runs, key=lambda r: r.stats.decode_s)


def run_length(engines: dict, prompts, gen: int, reps: int) -> dict[str, dict]:
    """Every configuration on every prompt at one generated length; pooled per configuration.
    With reps > 1 each prompt runs every configuration reps times, interleaved, and each one's
    fastest pass counts (same tokens every pass): on a shared machine stolen time lands on one
    pass or another, rarely on all."""
    from dflash_native.lossless import first_divergence_gap

    ar_eng = engines["defaults"]
    out = {name: dict(n=0, s=0.0, committed=0, rounds=0, ar_steps=0, switches=0, gaps=[], n_gen=[], stop=set())
           for name in ["AR", *engines]}
    for p in prompts:
        runs: dict[str, list] = {name: [] for name in out}
        for _ in range(reps):
            runs["AR"].append(ar_eng.generate(p.ids, max_tokens=gen, speculative=False))
            for name, eng in engines.items():
                runs[name].append(eng.generate(p.ids, max_tokens=gen))
        ar = fastest(runs["AR"])
        for name in out:
            r = fastest(runs[name])
            s, t = r.stats, out[name]
            t["n"] += max(s.n_generated - 1, 0)
            t["s"] += s.decode_s
            t["n_gen"].append(s.n_generated)
            t["stop"].add(s.stop_reason)
            if name == "AR":
                continue
            t["committed"] += sum(k * c for k, c in enumerate(s.acceptance_histogram))
            t["rounds"] += s.rounds
            t["ar_steps"] += s.ar_steps
            t["switches"] += s.controller_switches
            t["gaps"].append(first_divergence_gap(ar_eng, p.ids, ar.tokens, r.tokens))
    return out


def table(title: str, engines: dict, prompts, gens: list[int], a, meta: dict) -> list[dict]:
    from dflash_native.lossless import verdict

    names = ["AR", *engines]
    fixed = [n for n in engines if n.startswith("fixed")]
    print(f"\n{title}\n")
    print("| generated | " + " | ".join(f"{n} tok/s (x AR)" for n in names) + " | "
          + " | ".join(f"{n} AL" for n in engines) + " | best fixed | defaults / best fixed | AR steps (defaults) "
          "| spec == AR |")
    print("|---:|" + "---:|" * (2 * len(names) - 1) + "---|---:|---:|---|")
    rows, al0 = [], {}
    load0 = os.getloadavg()
    for gen in gens:
        res = run_length(engines, prompts, gen, a.reps)
        load1 = os.getloadavg()
        ar_tok_s = res["AR"]["n"] / res["AR"]["s"]
        speed = {n: (res[n]["n"] / res[n]["s"]) / ar_tok_s for n in names}
        best = max(fixed, key=lambda n: speed[n])
        cells, accs, bad = [], [], []
        for name in names:
            t = res[name]
            tok_s = t["n"] / t["s"]
            cells.append(f"{tok_s:.0f}" + ("" if name == "AR" else f" ({speed[name]:.2f}x)"))
            row = dict(meta, table=title, config=name, gen=gen, tok_s=tok_s, ar_tok_s=ar_tok_s, speedup=speed[name],
                       n_generated=t["n_gen"], stop_reasons=sorted(t["stop"]), loadavg_before=load0[0],
                       loadavg_after=load1[0])
            if name != "AR":
                ok, cell = verdict(t["gaps"])
                acc = t["committed"] / max(t["rounds"], 1)
                al0.setdefault(name, acc)
                accs.append(f"{acc:.2f}")
                if not ok:
                    bad.append(f"{name}: {cell}")
                row.update(window=engines[name]._spec.window, block_size=engines[name].block_size,
                           gate=engines[name].gate, draft_cutoff=engines[name].draft_cutoff,
                           mean_acceptance_length=acc, al_vs_first_length=acc / al0[name] if al0[name] else None,
                           rounds=t["rounds"], ar_steps=t["ar_steps"], controller_switches=t["switches"],
                           spec_identical_prompts=t["gaps"].count(None), divergence_gaps=t["gaps"], lossless=ok)
            if name == "defaults":
                row.update(best_fixed=best, best_fixed_speedup=speed[best], vs_best_fixed=speed[name] / speed[best])
            rows.append(row)
        d = res["defaults"]
        print(f"| {gen} | " + " | ".join(cells) + " | " + " | ".join(accs) + f" | {best} ({speed[best]:.2f}x) | "
              f"{speed['defaults'] / speed[best]:.2f} | {d['ar_steps']} of {sum(d['n_gen'])}, {d['switches']} switches | "
              + ("; ".join(bad) or "yes") + " |", flush=True)
        load0 = load1
    return rows


def main() -> None:
    import dflash_native as dn
    from dflash_native.train import corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gens", default="256,1024,2048,4096,8192", help="generated lengths, comma-separated")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per length")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--long-prompt", type=int, default=4096, help="tokens of the long prompts (0: no such table)")
    ap.add_argument("--long-gens", default="256,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="interleaved passes per prompt and configuration; "
                                                          "each one's fastest counts")
    ap.add_argument("--configs", default="",
                    help="comma-separated subset of the configurations (default: all but the fixed B16 wW ones)")
    ap.add_argument("--target", type=Path, default=None, help="default: the embedded pair")
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--note", default="", help="recorded in every line (e.g. 'machine loaded by other jobs')")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    target, drafter = resolve_pair(a.target, a.drafter)
    gens = [int(g) for g in a.gens.split(",") if g]
    long_gens = [int(g) for g in a.long_gens.split(",") if g] if a.long_prompt else []
    n_ctx = max([a.prompt_tokens + g for g in gens] + [a.long_prompt + g for g in long_gens]) + 64
    chosen = configs()
    if a.configs:
        if unknown := [n for n in a.configs.split(",") if n not in chosen]:
            ap.error(f"--configs: unknown configuration(s) {unknown}, known: {list(chosen)}")
        chosen = {n: chosen[n] for n in a.configs.split(",")}
        chosen.setdefault("defaults", {})
    else:
        chosen = {n: kw for n, kw in chosen.items() if n not in ON_REQUEST}
    engines = {name: dn.Engine(target, drafter=drafter, n_ctx=n_ctx, n_threads=a.threads, **kw)
               for name, kw in chosen.items()}
    eng0 = engines["defaults"]
    prompts = [Prompt(eng0.tokenize(p.text), p.text[:30]) for p in
               corpus.heldout_prompts(a.prompts, a.prompt_tokens, eng0, seed=0)]
    for eng in engines.values():  # warm-up: graph plans and caches
        eng.generate(prompts[0].ids, max_tokens=16)
    meta = dict(bench="long_context", threads=a.threads, reps=a.reps, prompts=a.prompts, target=Path(target).name,
                drafter=Path(drafter).name, machine=machine(), isa=isa(), note=a.note, rev=git_rev())
    print(f"# long_context: {meta['machine']}; {meta['target']} + {meta['drafter']}; threads={a.threads}, "
          f"reps={a.reps}, {a.prompts} prompts per row; trained window {eng0._spec.window}, n_ctx {n_ctx}; "
          f"load average {os.getloadavg()[0]:.2f}; rev {meta['rev']}")
    rows = table(f"Generated length after held-out prompts of ~{a.prompt_tokens} tokens", engines, prompts, gens, a,
                 dict(meta, prompt_tokens=a.prompt_tokens))
    if long_gens:
        lp = long_prompts(a.prompts, a.long_prompt, eng0)
        rows += table(f"Generated length after a {a.long_prompt}-token prompt (held-out files: "
                      f"{', '.join(p.name for p in lp)})", engines, lp, long_gens, a,
                      dict(meta, prompt_tokens=a.long_prompt))
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
