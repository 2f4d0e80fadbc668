"""Structured output under speculation (issue 37): a JSON-schema request, constrained speculative
against constrained AR against unconstrained (speculative and AR), on one pair (default: the
embedded pair). Per mode: decode tok/s (median over --reps after a warm-up), mean acceptance length,
and for the constrained modes the grammar engine's cost (xgrammar masks, accepts, rollbacks) per
committed token as a fraction of an unconstrained AR step. All modes run side by side in one process,
so the ratios hold on a shared machine better than the absolute figures do; constrained speculative
output is checked equal to constrained AR output before anything is timed.

    python bench/structured.py --json bench/results/structured.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _common import git_rev, machine, resolve_pair, summarize, write_jsonl

# an order: three line items and a status; bounded strings (maxLength), free integers
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 16},
        "items": {"type": "array", "minItems": 3, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"},
                                           "gift": {"type": "boolean"}},
                            "required": ["sku", "qty", "gift"]}},
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["customer", "items", "status"],
}
PROMPTS = ["# the order as JSON\norder = ", "def load_order():\n    return ", "Order record:\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--verify", default="chain", choices=["chain", "tree"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import dflash_native as dn

    target, drafter = resolve_pair(args.target, args.drafter)
    eng = dn.Engine(target, drafter=drafter, n_ctx=1024, n_threads=args.threads, verify=args.verify)
    c = dn.JsonSchema(SCHEMA)
    modes = {"constrained spec": dict(constraint=c), "constrained AR": dict(constraint=c, speculative=False),
             "unconstrained spec": dict(), "unconstrained AR": dict(speculative=False)}
    for p in PROMPTS:  # exactness first, and the warm-up
        a = eng.generate(p, max_tokens=args.max_tokens, **modes["constrained AR"])
        s = eng.generate(p, max_tokens=args.max_tokens, **modes["constrained spec"])
        assert a.tokens == s.tokens, f"constrained spec != constrained AR on {p!r}"
    res = {m: {"tok_s": [], "acc": [], "grammar_s_per_tok": [], "n": []} for m in modes}
    for _ in range(args.reps):
        for m, kw in modes.items():
            for p in PROMPTS:
                r = eng.generate(p, max_tokens=args.max_tokens, **kw).stats
                res[m]["tok_s"].append(r.decode_tok_s)
                res[m]["acc"].append(r.mean_acceptance_length)
                res[m]["n"].append(r.n_generated)
                if r.n_generated:
                    res[m]["grammar_s_per_tok"].append(r.constraint_s / r.n_generated)
    ar_step_s = 1.0 / statistics.median(res["unconstrained AR"]["tok_s"])
    mach, rev = machine(), git_rev()
    rows = []
    print(f"{Path(target).name} + {Path(drafter).name}, verify={args.verify}, max_tokens={args.max_tokens}, "
          f"{args.reps} reps x {len(PROMPTS)} prompts; {mach}")
    print(f"{'mode':<20} {'tok/s':>8} {'spread':>15} {'accept':>7} {'vs AR':>6} {'grammar/AR step':>16}")
    for m in modes:
        t = summarize(res[m]["tok_s"])
        base = statistics.median(res["constrained AR" if m.startswith("constrained") else "unconstrained AR"]["tok_s"])
        g = statistics.median(res[m]["grammar_s_per_tok"]) / ar_step_s if m.startswith("constrained") else None
        acc = statistics.median(res[m]["acc"]) if m.endswith("spec") else None
        print(f"{m:<20} {t['median']:>8.1f} {t['min']:>7.1f}-{t['max']:<7.1f} "
              f"{acc if acc is not None else float('nan'):>7.2f} {t['median'] / base:>6.2f} "
              f"{g if g is not None else float('nan'):>16.3f}")
        rows.append({"bench": "structured", "mode": m, "target": Path(target).name, "verify": args.verify,
                     "max_tokens": args.max_tokens, "tok_s": t, "mean_acceptance": acc, "speedup_vs_ar": t["median"] / base,
                     "grammar_frac_of_ar_step": g, "n_generated": res[m]["n"], "machine": mach, "git": rev})
    write_jsonl(args.json, rows)


if __name__ == "__main__":
    main()
