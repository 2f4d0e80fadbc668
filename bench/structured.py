"""Structured output under speculation (issue 37): a JSON-schema request, constrained speculative
against constrained AR against unconstrained (speculative and AR), on one pair (default: the
embedded pair). Per mode: decode tok/s (median over --reps after a warm-up), mean acceptance length,
and for the constrained modes the grammar engine's cost (xgrammar masks, accepts, rollbacks) per
committed token as a fraction of an unconstrained AR step. All modes run side by side in one process,
so the ratios hold on a shared machine better than the absolute figures do; constrained speculative
output is checked equal to constrained AR output before anything is timed.

Two more tables say why the speedups differ. Per round (all reps pooled): committed tokens, verified
tokens, draft / verify ms and the grammar engine's ms, and masks made per committed token (a count:
it holds on a loaded machine). Then acceptance on one text: the constrained AR output replayed round
by round (fixed block size, no controller), where at each round's start the drafter's unmasked
greedy drafts and its masked drafts (the constrained round's) are matched against the same text,
against the unconstrained round's acceptance on the unconstrained text.

--drafters NAME=PATH ...: each drafter in turn on the same target (all the tables per drafter, its
speedups against its own AR in the same run), e.g. a drafter trained with `train-drafter
--constrained-share` against its control. --heldout N adds, per drafter, the acceptance on N held-out
code prompts (corpus.heldout_prompts: stdlib files never trained on; greedy, --verify's chain or
tree (budget 15, as bench/drafters.py's), B = 16, gate off: counts that do not depend on the load),
unconstrained and under the schema, and whether every output equals AR's.

    python bench/structured.py --json bench/results/structured.jsonl
    python bench/structured.py --drafters shipped=A.gguf new=B.gguf --heldout 16 --json ...
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
    ap.add_argument("--drafters", nargs="+", metavar="NAME=PATH", help="several drafters, one after another")
    ap.add_argument("--heldout", type=int, default=0, help="held-out code prompts for the acceptance table")
    ap.add_argument("--heldout-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--verify", default="chain", choices=["chain", "tree"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    target, drafter = resolve_pair(args.target, args.drafter)
    drafters = dict(d.split("=", 1) for d in args.drafters) if args.drafters else {Path(drafter).stem: drafter}
    rows = []
    for name, path in drafters.items():
        rows += one_drafter(args, target, name, path)
    write_jsonl(args.json, rows)


def one_drafter(args, target, name: str, drafter) -> list[dict]:
    import dflash_native as dn

    eng = dn.Engine(target, drafter=drafter, n_ctx=1024, n_threads=args.threads, verify=args.verify)
    c = dn.JsonSchema(SCHEMA)
    modes = {"constrained spec": dict(constraint=c), "constrained AR": dict(constraint=c, speculative=False),
             "unconstrained spec": dict(), "unconstrained AR": dict(speculative=False)}
    for p in PROMPTS:  # exactness first, and the warm-up
        a = eng.generate(p, max_tokens=args.max_tokens, **modes["constrained AR"])
        s = eng.generate(p, max_tokens=args.max_tokens, **modes["constrained spec"])
        assert a.tokens == s.tokens, f"constrained spec != constrained AR on {p!r}"
    res = {m: {"tok_s": [], "acc": [], "grammar_s_per_tok": [], "n": []} for m in modes}
    keys = ("n_generated", "rounds", "ar_steps", "verified_tokens", "decode_s", "draft_s", "verify_s", "constraint_s",
            "n_masks")
    pooled = {m: dict.fromkeys(keys, 0) for m in modes}
    by_prompt = {(m, p): [0, 0.0] for m in modes for p in PROMPTS}  # tokens, decode seconds
    for _ in range(args.reps):
        for m, kw in modes.items():
            for p in PROMPTS:
                r = eng.generate(p, max_tokens=args.max_tokens, **kw).stats
                res[m]["tok_s"].append(r.decode_tok_s)
                res[m]["acc"].append(r.mean_acceptance_length)
                res[m]["n"].append(r.n_generated)
                if r.n_generated:
                    res[m]["grammar_s_per_tok"].append(r.constraint_s / r.n_generated)
                for k in keys:
                    pooled[m][k] += getattr(r, k)
                by_prompt[m, p][0] += r.n_generated
                by_prompt[m, p][1] += r.decode_s
    ar_step_s = 1.0 / statistics.median(res["unconstrained AR"]["tok_s"])
    mach, rev = machine(), git_rev()
    rows = []
    print(f"\n=== drafter {name}\n{Path(target).name} + {Path(drafter).name}, verify={args.verify}, max_tokens={args.max_tokens}, "
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
        rows.append({"mode": m, "tok_s": t, "mean_acceptance": acc, "speedup_vs_ar": t["median"] / base,
                     "grammar_frac_of_ar_step": g, "n_generated": res[m]["n"]})
    rows += per_round(pooled, args.verify)
    rows += per_prompt(by_prompt)
    if args.verify == "chain":
        rows += same_text(eng, c, args.max_tokens)
    eng.close()
    if args.heldout:
        rows += heldout(target, drafter, c, args)
    for r in rows:
        r.update(bench="structured", target=Path(target).name, drafter=name, drafter_file=str(drafter),
                 verify=args.verify, max_tokens=args.max_tokens, machine=mach, git=rev)
    return rows


def heldout(target, drafter, c, args) -> list[dict]:
    """Mean acceptance length (committed tokens per round, pooled) on held-out code prompts, greedy
    chain or tree (args.verify, tree budget 15), B = 16, gate off, unconstrained and under the schema;
    outputs checked equal to AR's."""
    import dflash_native as dn
    from dflash_native.train import corpus

    eng = dn.Engine(target, drafter=drafter, block_size=16, gate=False, n_ctx=96 + args.heldout_tokens + 64,
                    n_threads=args.threads, verify=args.verify,
                    **({"tree_budget": 15} if args.verify == "tree" else {}))
    prompts = corpus.heldout_prompts(args.heldout, 96, eng, seed=0)
    rows = []
    for mode, kw in (("unconstrained", {}), ("constrained", {"constraint": c})):
        committed = rounds = same = 0
        for p in prompts:
            r = eng.generate(p.text, max_tokens=args.heldout_tokens, **kw)
            same += r.tokens == eng.generate(p.text, max_tokens=args.heldout_tokens, speculative=False, **kw).tokens
            h = r.stats.acceptance_histogram
            committed += sum(k * n for k, n in enumerate(h))
            rounds += sum(h)
        row = {"table": "heldout", "mode": mode, "prompts": len(prompts), "gen": args.heldout_tokens,
               "block_size": 16, "rounds": rounds, "mean_acceptance_length": committed / max(rounds, 1),
               "spec_equals_ar": same}
        print(f"held-out code prompts ({len(prompts)} x {args.heldout_tokens} tokens, B = 16, gate off, "
              f"{args.verify}), {mode}: "
              f"mean acceptance length {row['mean_acceptance_length']:.2f} over {rounds} rounds, "
              f"spec == AR {same}/{len(prompts)}", flush=True)
        rows.append(row)
    eng.close()
    return rows


def per_round(pooled: dict, verify: str) -> list[dict]:
    """The spec modes' pooled stats per round; AR modes per token (their 'round' is one step). The
    pooled speedup: all the mode's tokens over all its decode time, against its AR's."""
    print(f"\nper round ({verify}, all reps pooled; AR: per step)")
    print(f"{'mode':<20} {'committed':>9} {'verified':>8} {'draft ms':>8} {'verify ms':>9} {'grammar ms':>10} "
          f"{'masks/tok':>9} {'AR steps':>8} {'pooled vs AR':>12}")
    rows = []
    for m, a in pooled.items():
        ar = pooled["constrained AR" if m.startswith("constrained") else "unconstrained AR"]
        speedup = (ar["decode_s"] / ar["n_generated"]) / (a["decode_s"] / a["n_generated"])
        spec = m.endswith("spec")
        n_rounds = a["rounds"] if spec else a["n_generated"]
        if not n_rounds:
            continue
        row = {"mode": m, "table": "per_round", "rounds": a["rounds"], "ar_steps": a["ar_steps"],
               "committed_per_round": (a["n_generated"] - a["ar_steps"]) / n_rounds if spec else 1.0,
               "verified_per_round": a["verified_tokens"] / n_rounds if spec else None,
               "draft_ms": 1e3 * a["draft_s"] / n_rounds, "verify_ms": 1e3 * a["verify_s"] / n_rounds,
               "decode_ms": 1e3 * a["decode_s"] / n_rounds, "grammar_ms": 1e3 * a["constraint_s"] / n_rounds,
               "masks_per_token": a["n_masks"] / max(a["n_generated"], 1), "pooled_speedup_vs_ar": speedup}
        print(f"{m:<20} {row['committed_per_round']:>9.2f} {row['verified_per_round'] or float('nan'):>8.2f} "
              f"{row['draft_ms']:>8.3f} {row['verify_ms']:>9.3f} {row['grammar_ms']:>10.3f} "
              f"{row['masks_per_token']:>9.2f} {a['ar_steps']:>8} {speedup:>12.2f}")
        rows.append(row)
    return rows


def per_prompt(by_prompt: dict) -> list[dict]:
    """Each prompt's pooled speedup (its tokens over its decode time, against its AR's): the two
    modes write different texts, and the speedup follows the text."""
    print("\npooled speedup vs its AR, per prompt")
    rows = []
    for m in ("constrained spec", "unconstrained spec"):
        ar = m.replace("spec", "AR")
        x = [(by_prompt[ar, p][1] / by_prompt[ar, p][0]) / (by_prompt[m, p][1] / by_prompt[m, p][0]) for p in PROMPTS]
        print(f"{m:<20} " + " ".join(f"{v:>6.2f}" for v in x) + "   " + ", ".join(repr(p) for p in PROMPTS))
        rows.append({"mode": m, "table": "per_prompt", "prompts": PROMPTS, "pooled_speedup_vs_ar": x})
    return rows


def same_text(eng, c, max_tokens: int) -> list[dict]:
    """Accepted drafts per round on one text: the constrained AR output replayed by constrained chain
    rounds (fixed block size, no controller); at each round's start the drafter's unmasked greedy
    drafts are matched against the same text. The unconstrained rounds run on the unconstrained
    output. Counts, not timings."""
    from dflash_native import _core

    spec, greedy = eng._spec, _core.Sampling(0.0)
    B, controller = spec.block_size, spec.controller
    spec.controller = False

    def matched(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    tot = {"unmasked": 0, "masked": 0, "rounds": 0, "free": 0, "free_rounds": 0}
    try:
        for p in PROMPTS:
            ids = eng.tokenize(p)
            text = eng.generate(p, max_tokens=max_tokens, constraint=c, speculative=False).tokens
            matcher = eng._grammar_engine().matcher(c)
            j, last = 1, spec.prefill(ids, greedy, 0, matcher)
            while j + B < len(text):  # whole blocks only
                unmasked = list(spec.draft(last, B))
                com = list(spec.round(last, B, greedy, matcher).committed)
                assert com == text[j:j + len(com)], "a constrained round left the constrained AR text"
                tot["unmasked"] += matched(unmasked, text[j:])
                tot["masked"] += len(com) - 1
                tot["rounds"] += 1
                j, last = j + len(com), com[-1]
            free = eng.generate(p, max_tokens=max_tokens, speculative=False).tokens
            j, last = 1, spec.prefill(ids)
            while j + B < len(free):
                com = list(spec.round(last, B).committed)
                tot["free"] += len(com) - 1
                tot["free_rounds"] += 1
                j, last = j + len(com), com[-1]
    finally:
        spec.controller = controller
    row = {"table": "same_text", "block_size": B, "rounds": tot["rounds"],
           "unmasked_drafts_accepted": tot["unmasked"] / tot["rounds"],
           "masked_drafts_accepted": tot["masked"] / tot["rounds"],
           "unconstrained_drafts_accepted": tot["free"] / tot["free_rounds"]}
    print(f"\naccepted drafts per round (B={B}, no controller), {tot['rounds']} rounds on the constrained AR text: "
          f"unmasked drafts {row['unmasked_drafts_accepted']:.2f}, masked drafts {row['masked_drafts_accepted']:.2f}; "
          f"unconstrained rounds on the unconstrained text ({tot['free_rounds']} rounds): "
          f"{row['unconstrained_drafts_accepted']:.2f}")
    return [row]


if __name__ == "__main__":
    main()
